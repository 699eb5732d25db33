"""Cache-aware routing in a pool of verifier replicas: prefix-cache hits and first-token time per turn when sessions
are placed by prefix, against placement by load alone.

    python -m bench.routing --limit 4 --turns 5 --json bench/out/routing.json

A Ray pool of ``--replicas`` llama.cpp replicas (one thread each, prefix cache on) behind the gRPC front. ``--limit``
ShareGPT conversations run at once, one client each, turn after turn with cloud-only decoding (the first token
waits for the replica's prefill alone), each turn after a seeded random pause (``--think-s``), so turns of
different conversations interleave as real users' do: turn n's prompt is the conversation so far with the target's
own answers.
Two runs, each on a fresh pool (cold caches): ``routed`` (orchestrator/pool/placement.py records the prompts each
replica opened and sends a later turn where its prefix is) and ``by_load`` (the record off: least loaded, ties by
name). Concurrent, unsynchronised conversations are what make the difference: alone, least-loaded placement
lands every turn on the first replica by accident, and conversations in lock-step fall into a fixed pattern.

``lossless_ok``: wherever both runs saw the same prompt, their answers agree token by token, or differ at a measured
near-tie of the target's own logits; else the bench exits 1.
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np

from .output import finish

RUNS = ("routed", "by_load")


def _progress(msg: str) -> None:
    print(f"[routing] {msg}", file=sys.stderr, flush=True)


def run_pool(routed: bool, target: str, drafter_path: str, dialogues: list[list[str]],
             args) -> tuple[list[list[dict]], int]:
    """Every conversation on its own thread, turn after turn, through a fresh pool: per conversation, per turn,
    prompt, answer, TTFT and cached tokens; and how many sessions were placed by prefix."""
    import ray

    from tandem.cloud.server import serve
    from tandem.core.chat_template import ChatTemplate
    from tandem.edge.client import EdgeClient
    from tandem.edge.llama_drafter import LlamaDrafter
    from tandem.edge.planner import FixedPlanner
    from tandem.orchestrator.pool.ray_pool import PoolBackend

    ray.init(num_cpus=args.replicas, include_dashboard=False, log_to_driver=False, configure_logging=False)
    backend = PoolBackend(args.replicas, "llama.cpp",
                          dict(model_path=target, n_ctx=4096, n_threads=1, max_sessions=len(dialogues),
                               prefix_cache_tokens=args.prefix_cache_tokens),
                          max_sessions_per_replica=len(dialogues))
    if not routed:
        backend.placement.remember = 0
    server, port = serve(backend=backend, address="127.0.0.1:0", max_sessions=len(dialogues) * args.replicas)
    info = backend.info
    template = ChatTemplate(info.chat_template, info.bos_token, info.eos_token)
    cloud_only = FixedPlanner(None)
    out: list[list[dict]] = [[] for _ in dialogues]
    errors: list[BaseException] = []
    start = threading.Barrier(len(dialogues))

    def converse(c: int, user_turns: list[str]) -> None:
        try:  # the drafter only tokenizes here: cloud-only decoding never drafts
            drafter = LlamaDrafter(drafter_path, n_ctx=4096, n_threads=1)
            client = EdgeClient(drafter, f"127.0.0.1:{port}", None)
            tok = drafter.tokenizer
            messages: list[dict] = []
            start.wait()
            think = random.Random(c)  # the same pauses in both runs
            for i, text in enumerate(user_turns):
                time.sleep(think.uniform(0, args.think_s))  # the user reads and types: turns interleave freely
                messages.append({"role": "user", "content": text})
                prompt = tok.tokenize(template.render(messages))
                gen = client.generate(prompt, max_new_tokens=args.max_new_tokens, planner=cloud_only).result()
                out[c].append({"turn": i + 1, "prompt": prompt, "answer": gen.tokens,
                               "ttft_ms": 1000 * gen.stats.ttft_s, "cached_tokens": gen.stats.cached_tokens})
                messages.append({"role": "assistant", "content": gen.text})
            client.close()
        except BaseException as e:  # reported after the join
            errors.append(e)

    threads = [threading.Thread(target=converse, args=(c, d)) for c, d in enumerate(dialogues)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    routed_n = backend.placement.prefix_routed
    server.stop(grace=None)
    backend.shutdown()
    if ray.is_initialized():
        ray.shutdown()
    if errors:
        raise errors[0]
    _progress(f"{'routed' if routed else 'by_load'}: {routed_n} sessions placed by prefix")
    return out, routed_n


def summarise(convs: list[list[dict]]) -> dict:
    later = [t for conv in convs for t in conv if t["turn"] > 1]  # turn 1 can only hit a shared system prompt
    per_turn = []
    for i in range(max(len(c) for c in convs)):
        at = [c[i] for c in convs if len(c) > i]
        per_turn.append({"turn": i + 1, "ttft_ms": round(float(np.mean([t["ttft_ms"] for t in at])), 1),
                         "prompt_tokens": round(float(np.mean([len(t["prompt"]) for t in at])), 1),
                         "cached_tokens": round(float(np.mean([t["cached_tokens"] for t in at])), 1)})
    return {"per_turn": per_turn,
            "hit_share": round(sum(t["cached_tokens"] for t in later) / max(1, sum(len(t["prompt"]) for t in later)),
                               3),
            "ttft_ms_mean_later_turns": round(float(np.mean([t["ttft_ms"] for t in later])), 1) if later else 0.0,
            "ttft_s_total": round(sum(t["ttft_ms"] for c in convs for t in c) / 1000, 2)}


def check(results: dict, target: str) -> tuple[bool, list[dict]]:
    """Answers to identical prompts must agree, or differ at a measured near-tie."""
    pairs = [(c, a, b) for c, (ca, cb) in enumerate(zip(results["routed"], results["by_load"]))
             for a, b in zip(ca, cb) if a["prompt"] == b["prompt"] and a["answer"] != b["answer"]]
    if not pairs:
        return True, []
    from tandem.cloud import reference
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    engine = LlamaVerifierEngine(target, n_ctx=4096, max_sessions=1)
    verdicts = []
    for c, a, b in pairs:
        ref = reference.greedy(engine, a["prompt"], max(len(a["answer"]), len(b["answer"])))
        noise = reference.batch_shape_noise(engine, a["prompt"], ref.tokens[:8])
        kinds = [reference.classify(x["answer"], ref, noise) for x in (a, b)]
        kind, at = max(kinds, key=lambda v: ("exact", "near_tie", "other").index(v[0]))
        verdicts.append({"conversation": c, "turn": a["turn"], "kind": kind, "at": at})
    return all(v["kind"] != "other" for v in verdicts), verdicts


def report(result: dict, path: Path) -> None:
    r, b = result["runs"]["routed"], result["runs"]["by_load"]
    lines = ["# Cache-aware routing in a verifier pool", "",
             f"{result['replicas']} llama.cpp replicas (1 thread each, prefix cache {result['prefix_cache_tokens']} "
             f"tokens), {result['conversations']} ShareGPT conversations at once x {result['turns']} turns, "
             f"{result['max_new_tokens']} new tokens per answer, pauses up to {result['think_s']} s before each "
             f"turn, greedy, cloud-only decoding through gRPC (the "
             f"first token waits for the prefill alone). Each run on a fresh pool. lossless_ok = "
             f"{result['lossless_ok']}.", "",
             "| placement | prompt tokens from the cache (turns 2+) | mean TTFT ms, turns 2+ | total TTFT s | "
             "placed by prefix |", "|---|---|---|---|---|",
             f"| by prefix (routed) | {r['hit_share']:.1%} | {r['ttft_ms_mean_later_turns']} | {r['ttft_s_total']} | "
             f"{result['prefix_routed']} |",
             f"| by load | {b['hit_share']:.1%} | {b['ttft_ms_mean_later_turns']} | {b['ttft_s_total']} | 0 |", "",
             "| turn | prompt tokens | cached, routed | cached, by load | TTFT ms, routed | TTFT ms, by load |",
             "|---|---|---|---|---|---|"]
    for tr, tb in zip(r["per_turn"], b["per_turn"]):
        lines.append(f"| {tr['turn']} | {tr['prompt_tokens']} | {tr['cached_tokens']} | {tb['cached_tokens']} | "
                     f"{tr['ttft_ms']} | {tb['ttft_ms']} |")
    if result["verdicts"]:
        lines += ["", f"Answers that differ between the runs: {result['verdicts']}"]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=4, help="conversations, run at once")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--think-s", type=float, default=3.0,
                    help="a user's pause before each turn, uniform in [0, think-s] (seeded per conversation)")
    ap.add_argument("--prefix-cache-tokens", type=int, default=4096)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/routing.md"))
    args = ap.parse_args(argv)

    from tandem.core import logs
    from tandem.orchestrator import models
    from tandem.orchestrator.datasets import sharegpt_dialogues
    logs.configure()
    target = str(models.resolve(args.target, "target"))
    drafter = str(models.resolve(args.drafter, "drafter"))
    dialogues = sharegpt_dialogues(args.turns, args.limit)
    if len(dialogues) < args.limit:
        _progress(f"only {len(dialogues)} conversations have {args.turns} user turns")
    t0 = time.perf_counter()
    raw, routed_n = {}, 0
    for name in RUNS:
        _progress(f"run {name}: {len(dialogues)} conversations x {args.turns} turns on {args.replicas} replicas")
        raw[name], placed = run_pool(name == "routed", target, drafter, dialogues, args)
        routed_n += placed
    ok, verdicts = check(raw, target)
    result = {"lossless_ok": ok, "runs": {n: summarise(raw[n]) for n in RUNS}, "verdicts": verdicts,
              "replicas": args.replicas, "conversations": len(dialogues), "turns": args.turns,
              "max_new_tokens": args.max_new_tokens, "prefix_cache_tokens": args.prefix_cache_tokens,
              "think_s": args.think_s,
              "prefix_routed": routed_n, "target": Path(target).name, "bench_s": round(time.perf_counter() - t0, 1)}
    return finish(result, args.json, report, args.report, ok,
                  "answers diverge between placements other than at near-ties", "routing")


if __name__ == "__main__":
    sys.exit(main())
