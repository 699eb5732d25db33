"""``tandem demo``: one prompt answered three ways through the same local verifier, side by side.

Cloud-only decoding (the verifier decodes every token itself), then Tandem with the ``cloud_cost`` objective
(fewest verifier forwards without being slower than cloud-only) and with the ``latency`` objective (fastest
answer). Each row is measured on this machine: tokens/s, verify forwards and the verifier's busy time per token.
The last column prices the same forwards on a GPU cost curve (``deploy/cost-curves``, simulated: what one session
alone would cost an H200 serving a 7B target), because a CPU verifier shares its cores with the drafter and hides
what the product changes where it runs. At temperature 0 the three answers are the target's, token for token.
The last line says what this device and this pair would give against a GPU verifier shared by many users:
sessions per GPU and GPU-ms per token against server-only decoding, in closed form (``gpu_line``), fed with this
run's measured acceptance and drafting speed; simulated, and labelled so.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.core import lifetime

from . import drafting, models

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."
WARM_UP = "Write a Python function that says whether a string is a palindrome, ignoring case and spaces."
CURVES = Path(__file__).resolve().parents[1] / "deploy" / "cost-curves"
CURVE = CURVES / "h200-roofline-qwen2.5-7b.json"
# the GPU line's regime: a target whose weights are most of a forward at this SLO, where device drafting can pay
# (for a laptop's drafting, bench.capacity's map simulates the same ratio to server-only within 1 %; where the
# forward is a small part of the SLO the closed form is too kind to drafting, and the line says where to look)
GPU_CURVES = {"14B on an L40S-class card": CURVES / "derived-l40s-qwen2.5-14b.json"}
GPU_SLO_MS = 50.0  # the per-token latency a GPU deployment promises each user (bench.capacity's default SLO)
GPU_RTT_MS = 20.0  # a metro link's round trip to the GPU
GPU_CONTEXT = 1024  # tokens of context each session's KV holds (read once by every forward it is in)
LAPTOP_LEVEL_MS = 6.0  # a laptop drafting the 0.5B (derived, as bench.capacity's laptop device: an M4's llama.cpp)
CHAIN = 4  # the lock-step run's chain depth: its acceptance and drafting speed feed the GPU line


@dataclass(frozen=True)
class Row:
    method: str
    tokens: int
    tokens_per_s: float
    verify_forwards: int
    verify_ms_per_token: float  # the verifier's busy time (forward + acceptance), measured
    gpu_ms_per_token: float | None  # the same forwards on the GPU curve, simulated

    @classmethod
    def of(cls, method: str, stats, curve) -> "Row":
        n = max(1, stats.generated_tokens)
        gpu = None
        if curve is not None and stats.rounds:
            # forwards hold their root plus the checked nodes; the curve is near-flat over a few tokens, so the
            # mean tree size prices them to within a few per cent
            gpu = stats.rounds * curve(1 + stats.drafted_nodes / stats.rounds) / n
        return cls(method, stats.generated_tokens, stats.tokens_per_s, stats.rounds, stats.verify_us / 1000 / n, gpu)


def table(rows: list[Row], curve_name: str) -> str:
    head = f"{'':22}{'tokens/s':>9}{'verify':>10}{'verifier':>10}{'GPU':>10}"
    sub = f"{'':22}{'':>9}{'forwards':>10}{'ms/token':>10}{'ms/token':>10}"
    lines = [head, sub]
    for r in rows:
        gpu = f"{r.gpu_ms_per_token:10.2f}" if r.gpu_ms_per_token is not None else f"{'-':>10}"
        lines.append(f"{r.method:22}{r.tokens_per_s:9.1f}{r.verify_forwards:10d}{r.verify_ms_per_token:10.1f}{gpu}")
    lines.append(f"measured on this machine; GPU ms/token simulated on {curve_name} (one session alone)")
    return "\n".join(lines)


def sessions_per_gpu(curve, slo_ms: float, depth: int, tau: float, device_ms: float = 0.0,
                     kv_ms: float = 0.0, cap: int = 1 << 14) -> tuple[int, float]:
    """Closed form (docs/design.md, "Where speculation pays"): the most sessions one GPU holds at a per-token SLO,
    and the GPU-ms each committed token costs there. ``curve(n)``: ms for a forward of n tokens.

    Server-only decoding (depth 0): every session's token in each forward, back to back; a token every forward,
    so the forward must fit ``slo_ms``. Tandem: forwards back to back, each verifying the chains (depth + 1 tokens)
    of the n sessions whose drafts are in; a session's round is its device's part (``device_ms``: drafting and the
    link), a wait of up to one forward and its own forward, and commits ``tau`` tokens, so a round must fit
    tau x ``slo_ms``; the GPU then holds n x round / forward sessions (the others draft meanwhile). Each session in a
    forward reads its context's KV once (``kv_ms``). No prompts, no queueing past one forward: a bound, not a
    simulation (``bench.capacity`` simulates)."""
    best, cost = 0, 0.0
    for n in range(1, cap + 1):
        forward = curve(n * (depth + 1)) + n * kv_ms
        round_ms = forward if depth == 0 else device_ms + 2 * forward
        if round_ms > tau * slo_ms:
            break
        held = n if depth == 0 else int(n * round_ms / forward)
        if held > best:
            best, cost = held, forward / (n * tau)
    return best, cost


def gpu_curve(path: Path) -> tuple:
    """A derived GPU curve (``deploy/cost-curves/derive.py``) and the ms one session's context KV takes to read."""
    from tandem.cloud.engines.pacing import CostCurve
    d = json.loads(path.read_text())
    return CostCurve.load(path), GPU_CONTEXT * d["kv_bytes_per_token"] / (d["hbm_gb_s"] * 1e9) * 1000


def gpu_line(curves: dict, tau: float, level_ms: float, depth: int = CHAIN) -> str:
    """What this pair (``tau`` tokens per verify forward with chains of ``depth``) would give on each GPU (name:
    (ms for n tokens, a session's KV read in ms)) against server-only decoding, drafted at this device's measured
    ``level_ms`` a level and at a laptop's: simulated, closed form."""
    parts = []
    for name, (curve, kv_ms) in curves.items():
        ar, ar_ms = sessions_per_gpu(curve, GPU_SLO_MS, 0, 1.0, kv_ms=kv_ms)
        part = f"{name}: server-only {ar} sessions a GPU ({ar_ms:.3f} GPU-ms a token)"
        for who, level in (("this device", level_ms), ("a laptop", LAPTOP_LEVEL_MS)):
            held, cost = sessions_per_gpu(curve, GPU_SLO_MS, depth, tau, GPU_RTT_MS + depth * level, kv_ms)
            part += f", Tandem drafting on {who} {held} ({cost:.3f}; {held / ar if ar else 0:.2f}x)"
        parts.append(part)
    return (f"on a GPU, simulated (closed form, derived curves; {GPU_SLO_MS:g} ms a token, {GPU_CONTEXT} tokens of "
            f"context, {GPU_RTT_MS:g} ms round trip, this run's {tau:.2f} tokens per verify forward with chains of "
            f"{depth}; this device {level_ms:.0f} ms a drafted level, a laptop {LAPTOP_LEVEL_MS:g}): "
            + "; ".join(parts) + ". Where a forward is a small part of the per-token budget (a 7B on an H200) it "
            "does not pay: the README's 'When it pays'")


def compare(args, address: str, load_drafter, paired) -> int:
    """Answer ``args.prompt`` cloud-only, then under both objectives; print the latency run's answer and a table.
    ``load_drafter(args)`` makes the drafter; ``paired(client)`` matches it to the target (``drafting``)."""
    from tandem.cloud.engines.pacing import CostCurve
    from tandem.core.sampling import Sampling
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.planner import FixedPlanner
    from tandem.edge.policy import DraftPolicy

    curve = CostCurve.load(CURVE) if CURVE.is_file() else None
    client = paired(EdgeClient(load_drafter(args), address, TreeShape(1, 4, 4)))
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed, args.min_p)
    prompt = client.prompt_tokens([{"role": "user", "content": args.prompt}])
    runs = [("cloud-only", FixedPlanner(None)), ("tandem (cloud_cost)", DraftPolicy(objective="cloud_cost")),
            ("tandem (latency)", DraftPolicy(objective="latency")),
            (f"lock-step chains of {CHAIN}", FixedPlanner(TreeShape(1, CHAIN, CHAIN), stream=False))]
    rows, answers = [], []
    try:
        # a client keeps its policy across requests (what it learns of the link, the costs and this user's text):
        # each answers one other request first, unshown, as it would have in use; the first of these also pages
        # the models in, so no row pays for it
        warm = client.prompt_tokens([{"role": "user", "content": WARM_UP}])
        for method, planner in runs:
            print(f"{method}: warming up ...", file=sys.stderr, flush=True)
            client.generate(warm, max_new_tokens=args.max_tokens, sampling=sampling, planner=planner).result()
        for method, planner in runs:
            print(f"{method} ...", file=sys.stderr, flush=True)
            gen = client.generate(prompt, max_new_tokens=args.max_tokens, sampling=sampling, planner=planner)
            last = method == runs[-1][0]
            for text in gen:
                if last:
                    print(text, end="", flush=True)
            if last:
                print(flush=True)
            rows.append(Row.of(method, gen.stats, curve))
            answers.append(gen.tokens)
            chains = gen.stats  # the last run: lock-step chains, whose acceptance and drafting the GPU line uses
    finally:
        client.close()
    curve_name = curve.name.split(":")[0] if curve else "no curve"
    print(table(rows, curve_name))
    if sampling.greedy:
        differ = [next(i for i, (x, y) in enumerate(zip(a + [-1], answers[0] + [-2])) if x != y)
                  for a in answers[1:] if a != answers[0]]
        print("the answers are identical, token for token" if not differ else
              f"the answers part at token {min(differ)}: the target's own near-tie between forward shapes on this "
              f"CPU (tests/test_lossless.py tells those from errors)")
    curves = {name: gpu_curve(p) for name, p in GPU_CURVES.items() if p.is_file()}
    if curves and chains.rounds and chains.trees:
        print(gpu_line(curves, chains.generated_tokens / chains.rounds, chains.draft_us / 1000 / chains.trees / CHAIN))
    return 0


def run(args) -> int:
    """``tandem demo``: fetch the pair, start a local verifier process, answer one prompt through edge -> gRPC ->
    cloud three ways (``compare``)."""
    from tandem.edge.client import RemoteError, health

    for role in models.ROLES:
        models.fetch(role)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    # split the cores between the verifier process and the drafter in this process
    server_threads, args.drafter_threads = drafting.threads(0.5), drafting.threads(0.5)
    cmd = [sys.executable, "-m", "tandem.orchestrator.cli", "serve", "--grpc-port", str(port), "--threads",
           str(server_threads), "--target", args.target or "default", "--n-ctx", str(args.n_ctx),
           "--no-gateway", "--prefix-cache-tokens", "0"]  # each run prefills its prompt: like for like
    print(f"starting the verifier on {address} ...", file=sys.stderr, flush=True)
    server = lifetime.spawn(cmd, stdout=subprocess.DEVNULL)  # dies with this process, even by SIGKILL
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                health(address, timeout_s=2)
                break
            except RemoteError:
                if server.poll() is not None or time.monotonic() > deadline:
                    print("the verifier did not start; run `tandem serve` to see why", file=sys.stderr)
                    return 1
                time.sleep(0.5)
        return compare(args, address, drafting.load_drafter, drafting.paired)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
