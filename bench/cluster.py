"""The verifier pool on a real multi-node Ray cluster: three raylets on this machine (``ray.cluster_utils``), a
head and two worker nodes offering one replica each, and a worker node killed mid-generation.

    python -m bench.cluster --limit 4 --max-new-tokens 64 --json out.json

Measured, in order, on the default pair (llama.cpp target replicas, one thread each; real llama.cpp drafters in
this process, one per edge session):

1. placement: the two replicas start on different nodes (``SPREAD``, one unit each of the replica resource);
2. prefix-aware placement across nodes: a conversation's next turn goes to the node holding its prefix although
   the other node is less loaded, and the prefix is not computed again (``cached_tokens``);
3. failover: ``--limit`` edge sessions generate concurrently; once each has ``--kill-after-tokens`` tokens, the
   raylet of the node holding the most sessions is SIGKILLed. Every session resumes on the other node (the edge
   re-opens on its committed history); per session: resumes, the longest wait for a token after the kill against
   the longest before it, and its output against target-only greedy decoding on the same engine;
4. replacement: a fresh worker node joins; the time until the pool has replaced the lost replica there and a
   generation on the pool is token-exact again.

Every process shares this machine's two cores, so times here show the mechanics (how long a resume stalls a
session, how long a replacement takes to load), not a cluster's capacity. Exits 1 when a session's output differs
from the target's other than at a measured near-tie, is short, fails, or the pool does not recover.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from tandem.core import logs

from .output import cpu_name, finish

RESOURCE = "tandem_verifier"
# the head notices a dead raylet after 4 missed 0.5 s health checks (Ray's default is ~30 s)
FAST_FAILURE = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 4}


def _progress(msg: str) -> None:
    print(f"[bench.cluster] {msg}", file=sys.stderr, flush=True)


class Timed:
    """One edge session consumed on its own thread: when each text delta arrived, and the tokens by then."""

    def __init__(self, gen):
        self.gen, self.arrivals, self.error = gen, [], None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for _ in self.gen:
                self.arrivals.append((time.perf_counter(), len(self.gen.tokens)))
        except Exception as e:  # reported in the results
            self.error = repr(e)

    def waits_ms(self, after: float = 0.0, before: float = float("inf")) -> list[float]:
        """The time between consecutive deltas that arrived inside (after, before]."""
        ts = [t for t, _ in self.arrivals]
        return [1000 * (b - a) for a, b in zip(ts, ts[1:]) if after < b <= before]


def prefix_follow(backend, prompts: list[list[int]]) -> dict:
    """A first turn on one replica; another conversation then loads that replica; the first conversation's next
    turn (its prompt + answer + a new message) still goes where its prefix is cached."""
    import asyncio

    from tandem.cloud.backend import OpenRequest
    from tandem.cloud.session import DraftRequest, Limits
    run, lim = asyncio.run, Limits(8, 4, 4)
    first = tuple(prompts[0])
    a = run(backend.open(OpenRequest(first, limits=lim)))
    warm = backend.replica_of(a.session_id)
    bonus = run(backend.verify(a.session_id, DraftRequest(len(first)))).bonus
    run(backend.close(a.session_id))
    other = run(backend.open(OpenRequest(tuple(prompts[1]), limits=lim)))
    loaded = backend.replica_of(other.session_id)
    turn = first + (bonus,) + tuple(prompts[1][-40:])
    b = run(backend.open(OpenRequest(turn, limits=lim)))
    out = {"first_turn_replica": warm, "other_conversation_replica": loaded,
           "next_turn_replica": backend.replica_of(b.session_id), "next_turn_prompt_tokens": len(turn),
           "next_turn_cached_tokens": b.cached_tokens, "nodes": backend.nodes()}
    out["followed"] = out["next_turn_replica"] == warm and b.cached_tokens >= len(first) - 1
    for s in (b, other):
        run(backend.close(s.session_id))
    return out


def wait_for(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def failover(cluster, nodes, backend, address: str, prompts, refs, noise: float, make_drafter, args) -> dict:
    from tandem.cloud import reference
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    shape = TreeShape.parse(args.tree)
    clients = [EdgeClient(make_drafter(), address, shape, backoff_s=0.1) for _ in prompts]
    t0 = time.perf_counter()
    runs = [Timed(c.generate(p, max_new_tokens=args.max_new_tokens)) for c, p in zip(clients, prompts)]
    started = wait_for(lambda: all(len(r.gen.tokens) >= args.kill_after_tokens for r in runs) or
                       any(r.error or not r.thread.is_alive() for r in runs), 600)
    by_node, load = backend.nodes(), backend.load()
    victim = max(load, key=load.get)
    on_victim = load[victim]
    node = next(n for n in nodes if n.node_id == by_node[victim])
    t_kill = time.perf_counter()
    tokens_at_kill = sum(len(r.gen.tokens) for r in runs)
    os.kill(node.all_processes["raylet"][0].process.pid, signal.SIGKILL)
    _progress(f"killed the raylet of {victim}'s node with {on_victim} sessions, {tokens_at_kill} tokens in")
    for r in runs:
        r.thread.join(timeout=900)
    t_done = time.perf_counter()
    sessions = []
    for i, (r, ref) in enumerate(zip(runs, refs)):
        kind, at = reference.classify(r.gen.tokens, ref, noise)
        before, after = r.waits_ms(before=t_kill), r.waits_ms(after=t_kill)
        sessions.append({"session": i, "tokens": len(r.gen.tokens), "resumes": r.gen.stats.resumes,
                         "output": kind, "first_difference": at, "error": r.error,
                         "wait_ms_max_before_kill": round(max(before), 1) if before else None,
                         "wait_ms_max_after_kill": round(max(after), 1) if after else None})
    for c in clients:
        c.close()
    decoded_after = sum(len(r.gen.tokens) for r in runs) - tokens_at_kill
    return {"killed_replica": victim, "sessions_on_killed_node": on_victim, "started": started,
            "tokens_at_kill": tokens_at_kill,
            "tokens_per_s_before_kill": round(tokens_at_kill / (t_kill - t0), 2),
            "tokens_per_s_after_kill": round(decoded_after / (t_done - t_kill), 2) if t_done > t_kill else None,
            "kill_to_all_done_s": round(t_done - t_kill, 1),
            "resumed_sessions": sum(s["resumes"] > 0 for s in sessions),
            "replicas_after_kill": sorted(backend.load()), "sessions": sessions}


def replacement(cluster, backend, address: str, prompt, ref, make_drafter, worker) -> dict:
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    lost = backend.replacing
    t0 = time.perf_counter()
    fresh = worker(cluster)
    back = wait_for(lambda: not backend.replacing and len(backend.load()) == 2, 600)
    t_back = time.perf_counter() - t0
    n = 16
    client = EdgeClient(make_drafter(), address, TreeShape(1, 4, 4))
    tokens = client.generate(prompt, max_new_tokens=n).result().tokens
    client.close()
    return {"replacements_pending_before": lost, "replaced": back, "node_join_to_replica_serving_s": round(t_back, 1),
            "replica_on_fresh_node": fresh.node_id in backend.nodes().values(),
            "generation_after_exact": tokens == ref.tokens[:n]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=4, help="concurrent edge sessions (half HumanEval, half ShareGPT)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--kill-after-tokens", type=int, default=8, help="every session has this many when the node dies")
    ap.add_argument("--tree", default="1,4,4", help="k,N,D the edges draft")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/cluster.md"))
    args = ap.parse_args(argv)
    if args.limit < 2:
        ap.error("--limit needs at least 2 sessions (one per node)")
    logs.configure()
    import ray
    from ray.cluster_utils import Cluster

    from tandem.cloud import reference
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    from tandem.cloud.server import serve
    from tandem.edge.llama_drafter import LlamaDrafter
    from tandem.orchestrator import models
    from tandem.orchestrator.datasets import humaneval, humaneval_messages, sharegpt
    from tandem.orchestrator.pool.ray_pool import PoolBackend

    t_start = time.perf_counter()
    target, drafter_path = models.fetch("target"), models.fetch("drafter")
    engine = LlamaVerifierEngine(target, n_ctx=1024, n_threads=os.cpu_count() or 1, max_sessions=1)
    tok = engine.model
    chats = [humaneval_messages(p) for p in humaneval((args.limit + 1) // 2)] + sharegpt(args.limit // 2)
    prompts = [tok.tokenize(tok.chat_prompt(c)) for c in chats][: args.limit]
    refs = []
    for i, p in enumerate(prompts):
        refs.append(reference.greedy(engine, p, args.max_new_tokens))
        _progress(f"reference {i + 1}/{len(prompts)}: {len(refs[-1].tokens)} tokens")
    noise = max(reference.batch_shape_noise(engine, p, r.tokens[:8]) for p, r in zip(prompts[:2], refs[:2]))
    model_id = engine.model_id
    del engine, tok

    def make_drafter():
        return LlamaDrafter(drafter_path, n_ctx=1024, n_threads=1)

    def worker(cluster):
        return cluster.add_node(num_cpus=1, resources={RESOURCE: 1})

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": FAST_FAILURE})
    nodes = [worker(cluster), worker(cluster)]
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    t_pool = time.perf_counter()
    backend = PoolBackend(2, "llama.cpp", dict(model_path=str(target), n_ctx=1024, n_threads=1,
                                               max_sessions=args.limit, prefix_cache_tokens=1024),
                          max_sessions_per_replica=args.limit, replica_resource=RESOURCE, call_timeout_s=60,
                          replace_backoff_s=1.0)
    pool_up_s = time.perf_counter() - t_pool
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    try:
        where = backend.nodes()
        _progress(f"pool up in {pool_up_s:.1f} s: {where}")
        follow = prefix_follow(backend, prompts)
        _progress(f"prefix-aware placement: {follow}")
        fail = failover(cluster, nodes, backend, address, prompts, refs, noise, make_drafter, args)
        _progress(f"failover: {({k: v for k, v in fail.items() if k != 'sessions'})}")
        repl = replacement(cluster, backend, address, prompts[0], refs[0], make_drafter, worker)
        _progress(f"replacement: {repl}")
    finally:
        srv.stop(grace=None)
        backend.shutdown()
        ray.shutdown()
        cluster.shutdown()
    s = fail["sessions"]
    lossless = all(x["output"] in ("exact", "near_tie") for x in s)
    complete = all(x["tokens"] == len(r.tokens) and not x["error"] for x, r in zip(s, refs))
    ok = (lossless and complete and fail["resumed_sessions"] >= fail["sessions_on_killed_node"]
          and len(set(where.values())) == 2 and follow["followed"] and repl["replaced"]
          and repl["generation_after_exact"])
    result = {"ok": ok, "lossless_ok": lossless, "complete": complete, "measured": True,
              "cpu": cpu_name(),
              "nodes": 3, "replicas": 2, "sessions": len(prompts), "max_new_tokens": args.max_new_tokens,
              "tree": args.tree, "engine": model_id,
              "batch_shape_noise": round(noise, 4), "pool_up_s": round(pool_up_s, 1),
              "replica_nodes": where, "replicas_on_distinct_nodes": len(set(where.values())) == 2,
              "prefix_follow": follow, "failover": fail, "replacement": repl,
              "bench_s": round(time.perf_counter() - t_start, 1)}
    return finish(result, args.json, report, args.report, ok,
                  "a session lost or changed tokens, or the pool did not place, fail over or recover as it must",
                  "bench.cluster")


def report(r: dict, path: Path) -> None:
    f, follow, repl = r["failover"], r["prefix_follow"], r["replacement"]
    lines = ["# The verifier pool on a three-node Ray cluster", "",
             f"Measured on one machine ({r['cpu']}): a Ray head and two worker nodes (`ray.cluster_utils.Cluster`), "
             f"two llama.cpp replicas of {r['engine']}, {r['sessions']} edge sessions with real llama.cpp drafters "
             f"drafting {r['tree']} (k,N,D), {r['max_new_tokens']} new tokens each. Every process shares the "
             "machine's cores: the times show the mechanics, not a cluster's capacity.", "",
             f"- **ok: {r['ok']}**; lossless_ok {r['lossless_ok']} (target-only greedy decoding on the same engine, "
             f"batch-shape noise {r['batch_shape_noise']}), every session complete: {r['complete']}.",
             f"- Placement: replicas on distinct nodes: {r['replicas_on_distinct_nodes']} (pool up in "
             f"{r['pool_up_s']} s).",
             f"- Prefix-aware placement across nodes: the next turn went to {follow['next_turn_replica']} (first "
             f"turn on {follow['first_turn_replica']}, another conversation loading it), "
             f"{follow['next_turn_cached_tokens']} of {follow['next_turn_prompt_tokens']} prompt tokens cached.",
             f"- Failover: the raylet of {f['killed_replica']}'s node SIGKILLed with {f['sessions_on_killed_node']} "
             f"sessions on it and {f['tokens_at_kill']} tokens committed; {f['resumed_sessions']} sessions resumed "
             f"on the other node; all done {f['kill_to_all_done_s']} s after the kill. Committed tokens/s before the "
             f"kill (two replicas) {f['tokens_per_s_before_kill']}, after (one) {f['tokens_per_s_after_kill']}.",
             f"- Replacement: a fresh node joined; the pool served on it after "
             f"{repl['node_join_to_replica_serving_s']} s (a Ray worker start and a model load); replica on the "
             f"fresh node: {repl['replica_on_fresh_node']}; the next generation token-exact: "
             f"{repl['generation_after_exact']}.", "",
             "| session | tokens | resumes | output | longest wait before the kill ms | longest wait after it ms |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {s['session']} | {s['tokens']} | {s['resumes']} | {s['output']} | {s['wait_ms_max_before_kill']} | "
              f"{s['wait_ms_max_after_kill']} |" for s in f["sessions"]]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
