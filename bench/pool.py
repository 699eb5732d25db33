"""Verifier throughput under concurrency: batched vs one-session-per-forward vs target-only AR serving.

    python -m bench.pool --limit 16 --sessions 1,4,8,16 --max-new-tokens 64 --json out.json

What is measured is the cloud side: committed tokens per second of one verifier replica and verify forwards per
committed token. On this 2-core machine 16 real drafters would eat the CPU the verifier is measured on, so the
edges are *replayed*: first every session runs alone with the real llama.cpp drafter over gRPC and its draft trees
are recorded; then N replay clients send those same trees concurrently over gRPC (the draft of round r assumes the
committed length the verifier actually reached, so a replay stays valid whatever happens). Modes:

- ``batched``: the engine loop verifies all pending trees in one forward;
- ``unbatched``: the same loop, one session per forward;
- ``ar``: target-only serving of the same sessions: empty trees (one token per round), batched;
- ``budget`` (with ``--verify-budget-tokens B``): batched, and each forward holds at most B tokens, reached by
  pruning the least probable nodes across all sessions' trees (``cloud/budget.py``) instead of holding drafts back;
- ``budget_ms`` (with ``--verify-budget-ms T``): the same with a latency target, each forward holding the tokens
  the replica's fitted forward cost says fit T ms (and at most ``--verify-budget-tokens`` when given too).

``--verifier-cost FILE --cost-scale S`` replays against a simulated verifier (``cloud.engines.pacing.PacedEngine``):
real logits, each verify forward paced to the cost curve's time x S (e.g. the measured H200 curve, flat to ~48 tokens:
the GPU regime). Pacing can only slow a forward down, so S must lift the curve above this CPU's own forward times
for the sizes that run (``paced_late_ms`` in each row says by how much it failed to); results are labelled simulated.

Each row also gives the p50/p99 verify latency a draft sees at the verifier (queue + forward, from its verdict;
a session's first draft, which waits behind the other sessions' prefills, is left out), the decode rate after
each session's first token (``decode_tokens_per_s``, ``tpot_ms_p50``) and what a round costs the replay client
beyond the verifier (``client_overhead_ms_p10/50/90``).

``--decode-together --deterministic`` (with ``--lock-step`` chains, ``--tree 1,D,D``) makes the runs
``bench.capacity --validate-pool`` replays in its simulator: sessions start decoding together once all have
opened (this CPU's prefills are not paced), and logits do not depend on batch shape, so no replay flips a near-tie
and falls back to one token per forward for want of a recorded tree.

``lossless_ok``: every output in every mode is token-identical to the session run alone. The bench exits 1 if
any output diverges other than at a measured near-tie (batch shapes move logits by up to the measured noise).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from tandem.cloud import reference
from tandem.cloud.backend import LocalBackend
from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
from tandem.cloud.scheduler import Scheduler
from tandem.cloud.server import serve
from tandem.core.tree import DraftTree
from tandem.edge.client import EdgeClient
from tandem.core.tree import TreeShape
from tandem.edge.llama_drafter import LlamaDrafter
from tandem.core import logs
from tandem.orchestrator import models
from tandem.protos import verifier_pb2 as pb
from tandem.protos import verifier_pb2_grpc as pb_grpc

from tandem.orchestrator.datasets import humaneval, humaneval_messages, sharegpt

from .capsim.validate import decode_rates


def _progress(msg: str) -> None:
    print(f"[bench.pool] {msg}", file=sys.stderr, flush=True)


Recorded = tuple[int, DraftTree, tuple[float, ...]]  # committed length drafted at, tree, nodes' path log-probs


class RecordingDrafter:
    """Wraps a llama.cpp drafter and records every tree it drafts, in order: the committed length it hangs below,
    the tree and its nodes' path log-probabilities."""

    def __init__(self, inner):
        self.inner = inner
        self.trees: list[Recorded] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, prompt):
        self.trees = []
        self.inner.start(prompt)

    def draft(self, shape):
        built = self.inner.draft(shape)
        logp = tuple(min(0.0, x) for x in built.logp) if len(built.logp) == len(built.tree) else ()
        self.trees.append((len(self.inner.history), built.tree, logp))
        return built


def pick(trees: list[Recorded], committed: int) -> Recorded:
    """The recorded tree drafted nearest below ``committed`` that can still reach past it (the verifier walks it
    down the tokens committed since, as it rebases any draft), or an empty tree at ``committed``."""
    best = None
    for rec in trees:
        if rec[0] <= committed <= rec[0] + rec[1].depth - 1 and (best is None or rec[0] > best[0]):
            best = rec
    return best or (committed, DraftTree(), ())


def replay(address: str, prompt: list[int], trees: list[Recorded], max_new: int,
           latency_ms: list[float] | None = None, spans: list[tuple[int, float, float]] | None = None,
           opened_all: threading.Barrier | None = None, overhead_ms: list[float] | None = None) -> list[int]:
    """One edge session that sends pre-recorded trees by committed length (a replay whose rounds commit other
    amounts than the recording's, e.g. under a verify budget, still sends each position's tree), an empty tree
    where none reaches; returns its tokens and appends each verdict's queue + verify time to ``latency_ms`` and
    (tokens, first verdict, last verdict) in perf_counter seconds to ``spans``. With ``opened_all`` it drafts
    only once every session of the run has opened: decoding starts together, no prefill runs between forwards.
    ``overhead_ms`` gets, per round after the first, what the round took beyond the verifier's queue and forward:
    this client's turn from verdict to next draft, and the messages' transport both ways."""
    requests: queue.SimpleQueue = queue.SimpleQueue()
    with grpc.insecure_channel(address) as ch:
        responses = pb_grpc.VerifierStub(ch).Session(iter(requests.get, None), timeout=900)

        def wire(rec: Recorded, sid: str, seq: int) -> pb.Draft:
            base, t, logp = rec
            return pb.Draft(session_id=sid, committed_len=base, seq=seq,
                            tree=pb.DraftTree(tokens=t.tokens, parents=t.parents), node_logprobs=logp)

        requests.put(pb.SessionRequest(open=pb.Open(prompt_tokens=prompt, limits=pb.Limits(
            max_new_tokens=max_new, max_tree_nodes=64, max_tree_depth=16))))
        opened = next(responses).opened
        if opened_all is not None:
            opened_all.wait()
        sent, seq = pick(trees, len(prompt)), 1
        requests.put(pb.SessionRequest(draft=wire(sent, opened.session_id, seq)))
        verdict, tokens = next(responses).verdict, []
        first = last = time.perf_counter()
        while True:
            t = sent[1]
            tokens += [t.tokens[i] for i in verdict.accepted] + ([verdict.bonus_token] if verdict.bonus_token >= 0
                                                                 else [])
            if latency_ms is not None and seq > 1:  # the first waits behind the other sessions' prefills
                latency_ms.append((verdict.queue_us + verdict.verify_us) / 1000)
            if verdict.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                break
            sent, seq = pick(trees, len(prompt) + len(tokens)), seq + 1
            requests.put(pb.SessionRequest(draft=wire(sent, opened.session_id, seq)))
            verdict = next(responses).verdict
            now = time.perf_counter()
            if overhead_ms is not None:
                overhead_ms.append(1000 * (now - last) - (verdict.queue_us + verdict.verify_us) / 1000)
            last = now
        if spans is not None:
            spans.append((len(tokens), first, time.perf_counter()))
        requests.put(pb.SessionRequest(close=pb.Close(session_id=opened.session_id)))
        requests.put(None)
        next(responses)
    return tokens


def run_mode(engine, prompts, trees, n: int, mode: str, args) -> tuple[dict, list[list[int]]]:
    if args.verifier_cost:
        from tandem.cloud.engines.pacing import CostCurve, PacedEngine
        engine = PacedEngine(engine, CostCurve.load(args.verifier_cost), args.cost_scale)
    scheduler = Scheduler(engine, max_batch_tokens=args.max_batch_tokens, window_ms=args.window_ms,
                          batching=mode != "unbatched",
                          verify_budget_tokens=args.verify_budget_tokens if mode in ("budget", "budget_ms") else 0,
                          verify_budget_ms=args.verify_budget_ms if mode == "budget_ms" else 0.0)
    backend = LocalBackend(engine, max_sessions=engine.max_sessions, scheduler=scheduler)
    server, port = serve(backend=backend, address="127.0.0.1:0")
    outs: list = [None] * n
    empty: list[Recorded] = []
    latency_ms: list[float] = []  # list.append is atomic: the replay threads share it
    spans: list[tuple[int, float, float]] = []
    overhead_ms: list[float] = []
    together = threading.Barrier(n) if args.decode_together else None

    def one(i):
        outs[i] = replay(f"127.0.0.1:{port}", prompts[i], empty if mode == "ar" else trees[i], args.max_new_tokens,
                         latency_ms, spans, together, overhead_ms)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    server.stop(grace=None)
    scheduler.stop()
    tokens = sum(len(o) for o in outs)
    row = {"sessions": n, "mode": mode, "committed_tokens_per_s": round(tokens / wall, 2),
           "verify_forwards_per_token": round(scheduler.stats.forwards / tokens, 4),
           "mean_sessions_per_forward": round(scheduler.stats.mean_batch, 2), "tokens": tokens,
           "wall_s": round(wall, 2),
           "verify_latency_ms_p50": round(float(np.percentile(latency_ms, 50)), 1),
           "verify_latency_ms_p99": round(float(np.percentile(latency_ms, 99)), 1),
           "tokens_per_forward": round(scheduler.stats.tokens / max(1, scheduler.stats.forwards), 1),
           "pruned_nodes": scheduler.stats.pruned_nodes, **decode_rates(spans),
           **{f"client_overhead_ms_p{q}": round(float(np.percentile(overhead_ms, q)), 2) for q in (10, 50, 90)}}
    if args.verifier_cost:
        row["paced_late_ms"] = round(engine.late_ms, 1)
    return row, outs


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("batched", "unbatched", "ar", "budget", "budget_ms"):
        pts = sorted((r["sessions"], r["committed_tokens_per_s"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.set_xlabel("concurrent edge sessions")
    ax.set_ylabel("committed tokens/s per verifier replica")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Verifier throughput vs concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=16, help="prompts (half HumanEval, half ShareGPT)")
    ap.add_argument("--sessions", default="1,4,8,16")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree", default="2,8,6", help="k,N,D of the recorded drafts")
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--window-ms", type=float, default=2.0)
    ap.add_argument("--verify-budget-tokens", type=int, default=0,
                    help="add a 'budget' mode: batched, at most this many tokens per verify forward (0: no such mode)")
    ap.add_argument("--verify-budget-ms", type=float, default=0.0,
                    help="add a 'budget_ms' mode: batched, each verify forward sized to this latency target (0: none)")
    ap.add_argument("--verifier-cost", default="", help="simulate the verifier: pace forwards to this cost curve")
    ap.add_argument("--cost-scale", type=float, default=1.0, help="multiply the cost curve's times")
    ap.add_argument("--lock-step", action="store_true",
                    help="record lock-step edges (a tree every round) instead of pipelined ones, whose trees are "
                         "rarer on shared cores: the heaviest verify load per session")
    ap.add_argument("--decode-together", action="store_true",
                    help="sessions draft only once all have opened (no prefill between forwards): the runs "
                         "bench.capacity --validate-pool replays")
    ap.add_argument("--deterministic", action="store_true",
                    help="logits independent of batch shape: every replay commits what its recording did, so none "
                         "falls back to one token per forward after a near-tie flip (the runs --validate-pool reads)")
    ap.add_argument("--modes", default="batched,unbatched,ar", help="which of batched,unbatched,ar to run")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/pool.md"))
    args = ap.parse_args(argv)
    logs.configure()
    counts = [int(x) for x in args.sessions.split(",")]
    modes = [m for m in args.modes.split(",") if m] + (["budget"] if args.verify_budget_tokens else []) + \
        (["budget_ms"] if args.verify_budget_ms else [])
    if not set(modes) <= {"batched", "unbatched", "ar", "budget", "budget_ms"}:
        ap.error(f"--modes takes batched, unbatched and ar, got {args.modes!r}")
    n_max = max(counts)
    if args.limit < n_max:
        ap.error(f"--limit {args.limit} is below the largest session count {n_max}")

    engine = LlamaVerifierEngine(models.resolve("default", "target"), n_ctx=1024, n_threads=args.threads,
                                 max_sessions=n_max, deterministic=args.deterministic)
    tok = engine.model
    chats = [("humaneval", i, humaneval_messages(p)) for i, p in enumerate(humaneval((args.limit + 1) // 2))] + \
        [("sharegpt", i, c) for i, c in enumerate(sharegpt(args.limit // 2))]
    tokenized = [(ds, i, tok.tokenize(tok.chat_prompt(c))) for ds, i, c in chats]
    kept = [(ds, i, p) for ds, i, p in tokenized if len(p) <= 512][: args.limit]
    prompts, prompts_from = [p for _, _, p in kept], [[ds, i] for ds, i, _ in kept]
    if len(prompts) < n_max:
        ap.error("not enough prompts of at most 512 tokens")

    # 1. every session alone, with the real drafter over gRPC: outputs + the trees it drafted
    drafter = RecordingDrafter(LlamaDrafter(models.resolve("default", "drafter"), n_ctx=1024,
                                            n_threads=args.threads))
    backend = LocalBackend(engine, max_sessions=n_max)
    server, port = serve(backend=backend, address="127.0.0.1:0")
    client = EdgeClient(drafter, f"127.0.0.1:{port}", TreeShape.parse(args.tree), stream=not args.lock_step)
    alone, trees = [], []
    for i, p in enumerate(prompts):
        gen = client.generate(p, max_new_tokens=args.max_new_tokens).result()
        alone.append(gen.tokens)
        trees.append(list(drafter.trees))
        _progress(f"recorded session {i + 1}/{len(prompts)} alone: {gen.stats.summary()}")
    client.close()
    server.stop(grace=None)
    backend.scheduler.stop()
    refs = [reference.greedy(engine, p, args.max_new_tokens) for p in prompts]
    noise = max(reference.batch_shape_noise(engine, p, r.tokens[:8]) for p, r in zip(prompts[:2], refs[:2]))

    # 2. replayed concurrent sessions, every mode and count in this one run
    rows, identical, near_ties, other = [], True, 0, 0
    for n in counts:
        for mode in modes:
            row, outs = run_mode(engine, prompts, trees, n, mode, args)
            for i, out in enumerate(outs):
                if out != alone[i]:
                    identical = False
                    kind, _ = reference.classify(out, refs[i], noise)
                    near_ties += kind == "near_tie"
                    other += kind == "other"
            rows.append(row)
            _progress(json.dumps(row))

    result = {"lossless_ok": identical, "divergences_near_tie": near_ties, "divergences_other": other,
              "batch_shape_noise": round(noise, 4), "tree": args.tree, "max_new_tokens": args.max_new_tokens,
              "prompts": len(prompts), "engine": engine.model_id, "threads": args.threads,
              "verify_budget_tokens": args.verify_budget_tokens, "verify_budget_ms": args.verify_budget_ms,
              "verifier_cost": args.verifier_cost, "cost_scale": args.cost_scale,
              "lock_step": args.lock_step, "decode_together": args.decode_together,
              "deterministic": args.deterministic, "window_ms": args.window_ms,
              "max_batch_tokens": args.max_batch_tokens, "prompts_from": prompts_from, "results": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    args.report.parent.mkdir(parents=True, exist_ok=True)
    png = args.report.with_suffix(".png")
    plot(rows, png)
    lines = ["# Verifier pool bench", "",
             f"One llama.cpp verifier replica ({engine.model_id}, {args.threads} threads), {len(prompts)} prompts "
             f"(HumanEval + ShareGPT), {args.max_new_tokens} new tokens, recorded trees {args.tree}"
             f"{' (lock-step edges)' if args.lock_step else ''}. "
             f"lossless_ok={identical} (near-tie flips {near_ties}, other {other}; noise {noise:.3f}).", "",
             f"![throughput]({png.name})", "",
             "| sessions | mode | committed tokens/s | vs ar | verify forwards / token | sessions / forward | "
             "tokens / forward | verify latency p50 / p99 ms | pruned nodes |",
             "|---|---|---|---|---|---|---|---|---|"]
    ar = {r["sessions"]: r["committed_tokens_per_s"] for r in rows if r["mode"] == "ar"}
    lines += [f"| {r['sessions']} | {r['mode']} | {r['committed_tokens_per_s']} | "
              f"{round(r['committed_tokens_per_s'] / ar[r['sessions']], 2) if r['sessions'] in ar else '-'}x | "
              f"{r['verify_forwards_per_token']} | {r['mean_sessions_per_forward']} | {r['tokens_per_forward']} | "
              f"{r['verify_latency_ms_p50']} / {r['verify_latency_ms_p99']} | {r['pruned_nodes']} |" for r in rows]
    lines += ["", "Edges are replayed from recorded drafts so that only the verifier is measured (see the module "
              "docstring); this CPU host stands in for a GPU, where batching is far cheaper per token."]
    if args.verifier_cost:
        late = ", ".join(f"{r['sessions']} {r['mode']}: {r['paced_late_ms']:.0f} ms" for r in rows)
        lines += ["", f"**Simulated verifier**: every verify forward paced to {args.verifier_cost} x {args.cost_scale} "
                  f"(real logits). Times and rates are on that scaled clock (divide ms by {args.cost_scale} for the "
                  "simulated hardware's); only ratios carry over. A forward this CPU computed slower than the scaled "
                  f"curve breaks the simulation; the time by which forwards overran it, per row: {late}."]
    args.report.write_text("\n".join(lines) + "\n")
    _progress(f"report: {args.report}")
    return 1 if other else 0


if __name__ == "__main__":
    sys.exit(main())
