"""The simulator against the real ``tandem serve`` at 32, 64 and 128 concurrent edge sessions.

    python -m bench.scale --clients 32,64,128 --json out.json

The real side: ``tandem serve --engine scripted`` (the product's servicer, scheduler, chunked prefill and admission,
in its own process) paces every forward to a GPU cost curve slowed ``--cost-scale`` K times, so that this CPU keeps
up with the rounds of a hundred sessions; beside it, N devices, each the product's ``EdgeClient`` with its round
loop and draft policy, in a closed loop (ask, read the whole answer, ask again) for a warm-up and a measured window.
Their drafter replays the acceptance traces recorded on the real pair (``bench.capsim.traces``): a tree drafted at
output position p holds exactly the nodes the simulator's ``trees.build`` says hold (a chain holds min(L[p], d)),
as the scripted target's tokens (its greedy next token after t is t + 1), and every drafting operation sleeps the
device class's time x K. Everything real is then K times slower than the simulated world; times are divided by K
before they are measured with the simulator's own definitions (``capsim.world.received``, ``request_measures``,
``summarize``).

The simulated side: ``bench.capacity``'s world on the same curve, traces, device, answer length, batch window / K
and forward budget, its link the round trip the real sessions measured beyond the verifier (loopback plus this
machine's Python on both ends, / K: what the real sessions paid and the model must know), pooled over
``--seeds``.

What is compared, at each count: the answers' per-token latency p50 and p99 (answers of at least 4 tokens) and the
tokens per second all sessions received in the window. What it validates is the model of queueing, batching, chunked
prefill, the round loop and the policy at scale; not the forward's physics: the paced engine prices a forward by its
tokens alone, so the simulated forward is the curve alone too (no KV read, floor or attention term; those are
formulas, held by their own tests). Exits 1 when a point is off by more than ``--max-error-pct``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Sequence

from tandem.cloud.engines.pacing import CostCurve
from tandem.cloud.engines.scripted_engine import ScriptedEngine
from tandem.core import lifetime
from tandem.core.tree import DraftTree, TreeShape
from tandem.edge.client import EdgeClient, health
from tandem.edge.drafting import BuiltTree
from tandem.edge.policy import DraftPolicy, PolicyConfig

from .capacity import DEFAULT_TRACES
from .capsim import trees
from .capsim.physics import Device, Forward
from .capsim.regimes import DEVICES
from .capsim.traces import Text, Traces
from .capsim.world import MIN_ITL_TOKENS, Config, Request, World, received, request_measures, summarize
from .curves import curve_path
from .linkproxy import LinkProfile

VOCAB = 256  # the scripted target's vocabulary: it counts 1, 2, ... from a prompt ending in 0; EOS is 255
MISS = 190  # drafted tokens the target never emits here: MISS + node index (answers stay below MISS - 1 tokens)
METRICS = ("itl_p50_ms", "itl_p99_ms", "server_tokens_per_s")


def _progress(msg: str) -> None:
    print(f"[bench.scale] {msg}", file=sys.stderr, flush=True)


class TraceTokenizer:
    """The scripted target's vocabulary (``"<t> "``), so the verifier pairs with it by fingerprint."""
    n_vocab = VOCAB

    def __init__(self):
        self._engine = ScriptedEngine(vocab_size=VOCAB)
        self.vocab_fingerprint = self._engine.vocab_fingerprint

    def piece(self, token: int) -> bytes:
        return self._engine.piece(token)

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return [int(t) for t in text.split()]


class TraceDrafter:
    """``edge.drafter.Drafter`` replaying one text's acceptance trace on the device class's clock (x ``scale``):
    what ``capsim.edge_client.SimDrafter`` does on the virtual clock, here with real sleeps."""
    name = "trace"
    n_ctx = 4096

    def __init__(self, device: Device, scale: float, agree: float):
        self.device, self.scale, self.agree = device, scale, agree
        self.tokenizer = TraceTokenizer()
        self.history: list[int] = []
        self.n_kv = self.prompt_len = 0
        self.ranks = trees.Ranks((), random.Random(0))

    def replay(self, text: Text, rng: random.Random) -> None:
        """The next generation's text (its chains' runs) and the draws of its trees' other candidates."""
        self.ranks = trees.Ranks(text.runs, rng)

    def start(self, prompt) -> None:
        self.history, self.n_kv, self.prompt_len = list(prompt), 0, len(prompt)

    def pending(self) -> int:
        return len(self.history) - self.n_kv

    def catch_up(self) -> None:
        time.sleep(self.pending() * self.device.catch_up_ms * self.scale / 1000)
        self.n_kv = len(self.history)

    def draft(self, shape: TreeShape) -> BuiltTree:
        self.catch_up()
        start = len(self.history) - self.prompt_len
        built = trees.build(shape, start, self.ranks, self.agree)
        # an output position p is the target's token p + 1 (the prompt ends in 0); a miss a token it never emits
        tokens = tuple(t + 1 if t < trees.MISS else MISS + i for i, t in enumerate(built.tree.tokens))
        time.sleep(built.tree.depth * self.device.level_ms * (1 + 0.5 * (shape.k - 1)) * self.scale / 1000)
        return BuiltTree(DraftTree(tokens, built.tree.parents), built.candidate, built.logp)

    def commit(self, built: BuiltTree, accepted, tokens) -> None:
        self.history += list(tokens)
        self.n_kv = min(len(self.history), self.n_kv + min(len(accepted), max(0, len(built.tree) - 1)))


class Record:
    """What the devices' round loops saw, verdict by verdict (``list.append`` is atomic: threads share one)."""

    def __init__(self):
        self.overhead_ms: list[float] = []  # per tree round, beyond the verifier's queue and forward
        self.verify_ms: list[float] = []  # per verdict: the verifier's forward (+ acceptance) time
        self.queue_ms: list[float] = []  # per tree round: its wait for a forward
        self.batch_sessions: list[int] = []  # per verdict: the sessions its forward held
        self.modes: list[str] = []  # the policy's choice at each decision

    def summary(self, scale: float) -> dict:
        """Means per verdict (times / ``scale``: simulated ms) and the share of each mode chosen."""
        def mean(xs, div=1.0):
            return round(statistics.fmean(xs) / div, 2) if xs else None
        modes = {m: round(self.modes.count(m) / len(self.modes), 3) for m in sorted(set(self.modes))}
        return {"verdicts": len(self.verify_ms), "verify_ms_mean": mean(self.verify_ms, scale),
                "queue_ms_mean": mean(self.queue_ms, scale), "overhead_ms_mean": mean(self.overhead_ms, scale),
                "batch_sessions_mean": mean(self.batch_sessions), "policy_modes": modes}


class RecordingPolicy(DraftPolicy):
    """The product's draft policy, also keeping what each verdict showed in a ``Record``."""

    def __init__(self, config: PolicyConfig, record: Record, **kw):
        super().__init__(config, **kw)
        self.record = record

    def observe_price(self, marginal_ms: float, sessions: int, token_budget: int) -> None:
        self.record.batch_sessions.append(sessions)
        super().observe_price(marginal_ms, sessions, token_budget)

    def observe(self, r) -> None:
        rec = self.record
        rec.verify_ms.append(r.forward_ms)
        if not r.streamed and r.round_ms > 0:
            rec.overhead_ms.append(max(0.0, r.round_ms - r.verify_ms))
            rec.queue_ms.append(max(0.0, r.verify_ms - r.forward_ms))
        n = self.decisions_made
        super().observe(r)
        if self.decisions_made > n:
            rec.modes.append(self.decisions[-1]["chose"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def device_keys(clients: int) -> list[str]:
    """One verifier key per device: a device is a tenant, with its own per-key limits (a burst of opens from many
    devices behind one key meets that key's cap on streams not yet opened, by design)."""
    return [secrets.token_urlsafe(24) for _ in range(clients)]


def serve(args, clients: int, keys: Sequence[str] = (), host: Sequence[str] | None = None):
    """``tandem serve --engine scripted`` paced to the curve; ``host``: with ``bench.trace_host``'s host drafter
    (these its flags)."""
    port = _free_port()
    cmd = ["tandem.orchestrator.cli"] if host is None else ["bench.trace_host", *host, "--"]
    argv = [sys.executable, "-m", *cmd, "serve", "--engine", "scripted", "--no-gateway",
            "--grpc-port", str(port), "--max-sessions", str(clients), "--verifier-cost", str(curve_path(args.curve)),
            "--cost-scale", str(args.cost_scale), "--max-batch-tokens", str(args.max_batch_tokens),
            "--batch-window-ms", str(args.window_ms), "--max-tree-nodes", "64", "--max-tree-depth", "16"]
    env = {**os.environ, "TANDEM_VERIFIER_KEYS": ",".join(keys)} if keys else None
    proc = lifetime.spawn(argv, stdout=sys.stderr, stderr=sys.stderr, env=env)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            health(address, timeout_s=2.0)  # (Health needs no key)
            return proc, address
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"tandem serve did not come up on {address} (exit {proc.poll()})") from None
            time.sleep(0.5)


def run_real(args, traces: Traces, device: Device, clients: int) -> tuple[dict, dict]:
    """The real run at ``clients`` sessions: the simulator's raw measures (in simulated seconds) and what the
    sessions measured beyond the verifier."""
    k = args.cost_scale
    keys = device_keys(clients)
    proc, address = serve(args, clients, keys)
    agree = traces.acceptance(args.dataset)
    t0_s, t1_s = args.warmup_s, args.warmup_s + args.duration_s
    ramp_s = max(1.0, min(args.warmup_s / 2, 5.0))
    done: list[Request] = []
    open_: list[Request] = []
    gaps: list[float] = []
    stats: list = []  # the generations' statistics (the round loop's own), in the window
    lock = threading.Lock()
    errors: list[BaseException] = []
    wrong: list[int] = []  # devices that received an answer other than the scripted target's
    cpu0 = _cpu_s(proc.pid), time.process_time()
    record = Record()
    start = time.perf_counter() + 1.0

    def now() -> float:  # simulated seconds since the run began
        return (time.perf_counter() - start) / k

    def device_loop(i: int) -> None:
        rng = random.Random(args.seed * 1_000_003 + i)
        drafter = TraceDrafter(device, k, agree)
        policy = RecordingPolicy(PolicyConfig(widths=args.widths), record)
        with EdgeClient(drafter, address, policy=policy, adapters=False, api_key=keys[i]) as client:
            time.sleep(max(0.0, start + rng.random() * ramp_s * k - time.perf_counter()))
            while now() < t1_s:
                text = traces.request(args.dataset, args.answer_tokens, rng)
                drafter.replay(text, random.Random(rng.random()))
                r, mine = Request(now(), args.answer_tokens), []
                gen = client.generate([0] * text.prompt_tokens, max_new_tokens=args.answer_tokens)
                seen, ended = 0, True
                for _ in gen:
                    t, n = now(), len(gen.tokens) - seen
                    if n <= 0:
                        continue
                    seen += n
                    if t >= t1_s:
                        ended = False
                        gen.cancel()
                        break
                    received(r, n, t, t0_s, t1_s, mine)
                st = gen.stats
                if ended and gen.tokens != list(range(1, args.answer_tokens + 1)):
                    wrong.append(i)  # not the target's own output: the product's round loop is broken
                with lock:
                    (done if ended and now() < t1_s else open_).append(r)
                    gaps.extend(mine)
                    if now() >= t0_s:
                        stats.append(st)

    def guarded(i: int) -> None:
        try:
            device_loop(i)
        except BaseException as e:  # reported after the run: one device's failure fails the bench
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(clients)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(1.0, start + (t1_s + 60) * k - time.perf_counter()))
        wall = time.perf_counter() - start
        server_cpu_s = _cpu_s(proc.pid) - cpu0[0]
        # the server's Python runs under one lock: its CPU time per verdict is about the serial host time each
        # verdict adds after a forward (acceptance, the reply), which the simulator is told (simulated ms)
        cpu = {"server_cpu_share": round(server_cpu_s / wall, 2),
               "clients_cpu_share": round((time.process_time() - cpu0[1]) / wall, 2),
               "host_ms_per_verdict": round(1000 * server_cpu_s / max(1, len(record.verify_ms)) / k, 4)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if errors:
        raise RuntimeError(f"{len(errors)} device(s) failed; the first: {errors[0]!r}") from errors[0]
    for r in open_:  # what the simulator, stopped at t1, knows of a request still running then
        if r.first >= t1_s:
            r.first = -1.0
    samples = {**request_measures(done, open_, t0_s, t1_s), "gaps": gaps, "gpu_ms": 0.0, "waiting": 0,
               "sums": dict.fromkeys(("forwards", "batches", "verifies", "committed", "forward_ms", "forward_tokens",
                                      "queue_ms", "beyond", "prefill_ms", "busy_ms", "drafter_ms",
                                      "drafter_refused"), 0),
               "depth_sessions": [], "refused": ""}
    rounds = sum(st.rounds for st in stats)
    loop = {"tokens_per_verify": round(sum(st.generated_tokens for st in stats) / max(1, rounds), 3),
            **record.summary(k)}
    return samples, {"round_overhead_ms": sorted(x / k for x in record.overhead_ms), "round_loop": loop,
                     "lossless_ok": not wrong, **cpu}


def link_of(overhead_ms: list[float]) -> LinkProfile:
    """The simulated link from the real sessions' per-round time beyond the verifier (simulated ms): half the
    median each way, jitter spanning its 10th to 90th percentile (two uniform +-j draws: p10..p90 = 2.21 j)."""
    if not overhead_ms:
        return LinkProfile()
    q = statistics.quantiles(overhead_ms, n=10)
    return LinkProfile(one_way_ms=statistics.median(overhead_ms) / 2, jitter_ms=max(0.0, q[-1] - q[0]) / 2.21)


def sim_config(args, device: Device, clients: int, link: LinkProfile, host_ms: float = 0.0) -> Config:
    # the paced engine prices a forward by its tokens alone: so does this one (no KV, floor or attention term)
    forward = Forward(CostCurve.load(curve_path(args.curve)), past_end="extrapolate", label="derived")
    return Config("tandem_adaptive", args.dataset, clients, 1, forward, device, link,
                  answer_tokens=args.answer_tokens, warmup_s=args.warmup_s, duration_s=args.duration_s,
                  window_ms=args.window_ms / args.cost_scale, max_batch_tokens=args.max_batch_tokens,
                  batched_prefill=True, widths=args.widths, seed=args.seed,
                  host_ms_per_verdict=host_ms)


def simulate(cfg: Config, traces: Traces, seeds: int) -> tuple[dict, dict]:
    """The simulator's row pooled over ``seeds`` runs, and what its devices' policies saw (as the real ones')."""
    record, samples = Record(), []
    for s in range(seeds):
        world = World(replace(cfg, seed=cfg.seed + s), traces)
        for user in world.devices:
            user.planner = RecordingPolicy(PolicyConfig(widths=cfg.widths), record)
        samples.append(world.samples())
    return summarize(samples, cfg), record.summary(1.0)


def compare(real: dict, sim: dict, clients: int) -> list[dict]:
    out = []
    for m in METRICS:
        r, s = real.get(m), sim.get(m)
        err = round(100 * (s - r) / r, 1) if r and s is not None else None
        out.append({"clients": clients, "metric": m, "real": r, "simulated": s, "error_pct": err})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="32,64,128", help="concurrent sessions, comma-separated")
    ap.add_argument("--curve", default="derived-l40s-qwen2.5-14b.json", help="the GPU cost curve both sides pace to")
    ap.add_argument("--cost-scale", type=float, default=4.0,
                    help="K: the real run is K times slower than the simulated world (so this CPU keeps up)")
    ap.add_argument("--device", default="laptop", choices=sorted(DEVICES))
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--answer-tokens", type=int, default=128, help=f"tokens per answer (at most {MISS - 2})")
    ap.add_argument("--warmup-s", type=float, default=4.0, help="simulated seconds before the window")
    ap.add_argument("--duration-s", type=float, default=12.0, help="the measured window, simulated seconds")
    ap.add_argument("--window-ms", type=float, default=2.0, help="the verifier's batch window, real ms")
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--widths", default="1,2", help="tree widths the draft policy prices")
    ap.add_argument("--seeds", type=int, default=3, help="simulated runs pooled per count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="the first N client counts only (0: all)")
    ap.add_argument("--max-error-pct", type=float, default=10.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.widths = tuple(int(w) for w in args.widths.split(","))
    if not 4 <= args.answer_tokens <= MISS - 2:
        ap.error(f"--answer-tokens must be 4..{MISS - 2}: the scripted target counts up below the drafts' misses")
    counts = [int(c) for c in args.clients.split(",")][: args.limit or None]
    traces = Traces.load(args.traces)
    device = DEVICES[args.device]
    rows, validation = [], []
    for n in counts:
        t = time.perf_counter()
        _progress(f"{n} sessions: the real run ({(args.warmup_s + args.duration_s) * args.cost_scale:.0f} s) ...")
        real_samples, measured = run_real(args, traces, device, n)
        cfg = sim_config(args, device, n, link_of(measured["round_overhead_ms"]), measured["host_ms_per_verdict"])
        real = summarize([real_samples], cfg)
        _progress(f"{n} sessions: the simulator, {args.seeds} seed(s), with and without the host's time ...")
        (sim, sim_loop), (sim_no_host, _) = (simulate(c, traces, args.seeds)
                                             for c in (cfg, replace(cfg, host_ms_per_verdict=0.0)))
        points = compare(real, sim, n)
        for p, q in zip(points, compare(real, sim_no_host, n)):
            p["error_pct_without_host_time"] = q["error_pct"]
        validation += points
        ov = measured.pop("round_overhead_ms")
        rows.append({"clients": n, "real": real, "simulated": sim, "simulated_without_host_time": sim_no_host,
                     "simulated_round_loop": sim_loop,
                     "link": asdict(cfg.link),
                     "round_overhead_ms_p50": round(statistics.median(ov), 2) if ov else None, **measured,
                     "bench_s": round(time.perf_counter() - t, 1)})
        _progress(f"{n} sessions: " + "; ".join(f"{p['metric']} {p['real']} real vs {p['simulated']} simulated "
                                               f"({p['error_pct']:+} %)" for p in points if p["error_pct"] is not None)
                  + f"; CPU: server {measured['server_cpu_share']}, clients {measured['clients_cpu_share']}")
    bad = [p for p in validation if p["error_pct"] is None or abs(p["error_pct"]) > args.max_error_pct]
    lossless = all(r["lossless_ok"] for r in rows)
    out = {"ok": not bad and lossless, "lossless_ok": lossless,
           "label": "simulated (both sides: a paced scripted verifier and its model)",
           "curve": str(args.curve), "cost_scale": args.cost_scale, "device": asdict(device),
           "dataset": args.dataset, "answer_tokens": args.answer_tokens, "min_itl_tokens": MIN_ITL_TOKENS,
           "warmup_s": args.warmup_s, "duration_s": args.duration_s, "seeds": args.seeds,
           "widths": list(args.widths), "max_batch_tokens": args.max_batch_tokens, "traces": str(args.traces),
           "max_error_pct": args.max_error_pct, "rows": rows, "validation": validation}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    if bad:
        _progress(f"{len(bad)} point(s) off by more than {args.max_error_pct} %")
    if not lossless:
        _progress("an answer was not the target's own tokens")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
