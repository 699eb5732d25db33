"""``tandem demo``: one prompt answered three ways through the same local verifier, side by side.

Cloud-only decoding (the verifier decodes every token itself), then Tandem with the ``cloud_cost`` objective
(fewest verifier forwards without being slower than cloud-only) and with the ``latency`` objective (fastest
answer). Each row is measured on this machine: tokens/s, verify forwards and the verifier's busy time per token.
The last column prices the same forwards on a GPU cost curve (``deploy/cost-curves``, simulated: what one session
alone would cost an H200 serving a 7B target), because a CPU verifier shares its cores with the drafter and hides
what the product changes where it runs. At temperature 0 the three answers are the target's, token for token.
"""
from __future__ import annotations

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
CURVE = Path(__file__).resolve().parents[1] / "deploy" / "cost-curves" / "h200-roofline-qwen2.5-7b.json"


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


def compare(args, address: str, load_drafter, paired) -> int:
    """Answer ``args.prompt`` cloud-only, then under both objectives; print the latency run's answer and a table.
    ``load_drafter(args)`` makes the drafter; ``paired(client)`` matches it to the target (``drafting``)."""
    from tandem.cloud.pacing import CostCurve
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
            ("lock-step chains of 4", FixedPlanner(TreeShape(1, 4, 4), stream=False))]
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
    finally:
        client.close()
    print(table(rows, curve.name.split(":")[0] if curve else "no curve"))
    if sampling.greedy:
        differ = [next(i for i, (x, y) in enumerate(zip(a + [-1], answers[0] + [-2])) if x != y)
                  for a in answers[1:] if a != answers[0]]
        print("the answers are identical, token for token" if not differ else
              f"the answers part at token {min(differ)}: the target's own near-tie between forward shapes on this "
              f"CPU (tests/test_lossless.py tells those from errors)")
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
