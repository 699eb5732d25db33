"""Edge->cloud speculative decoding against target-only decoding, on HumanEval prompts, in one run.

    python -m bench.speculative --limit 8 --max-new-tokens 128 --tree 1,6,6 --tree 4,16,6 --json out.json

Target-only greedy decoding runs on the same verifier engine and model file (one token per forward); each tree
shape then runs the full edge path (llama.cpp drafter -> gRPC on localhost -> llama.cpp verifier). Prints JSON
(the first --tree at top level, every tree under "runs"), writes a Markdown report, and exits 1 when any output
diverges from target-only decoding other than at a measured near-tie (temperature 0 only).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from cloud import reference
from cloud.acceptance import Sampling
from cloud.llama_engine import LlamaVerifierEngine
from cloud.server import serve
from edge.client import EdgeClient, GenerationStats
from edge.drafting import TreeShape
from edge.llama_drafter import LlamaDrafter
from orchestrator import logs, models
from orchestrator.policy import DraftPolicy

from .netdelay import DelayInterceptor
from .output import finish
from .prompts import humaneval, humaneval_messages


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run_shape(client: EdgeClient, prompts, refs, noise, args, shape: TreeShape, label: str) -> dict:
    total = GenerationStats()
    verdicts, wall = [], 0.0
    sampling = Sampling(args.temperature, seed=args.seed)
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        gen = client.generate(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, shape=shape).result()
        s = gen.stats
        total.generated_tokens += s.generated_tokens
        total.rounds += s.rounds
        total.drafted_nodes += s.drafted_nodes
        total.accepted_tokens += s.accepted_tokens
        for d, (a, r) in enumerate(zip(s.accepted_by_depth, s.reached_by_depth)):
            while len(total.accepted_by_depth) <= d:
                total.accepted_by_depth.append(0)
                total.reached_by_depth.append(0)
            total.accepted_by_depth[d] += a
            total.reached_by_depth[d] += r
        for f in ("draft_us", "verify_us", "queue_us", "network_us", "prefill_us"):
            setattr(total, f, getattr(total, f) + getattr(s, f))
        wall += s.wall_s
        if args.temperature == 0:
            verdicts.append(reference.classify(gen.tokens, ref, noise))
        _progress(f"{label} prompt {i + 1}/{len(prompts)}: {s.summary()}"
                  + (f" [{verdicts[-1][0]}]" if verdicts else ""))
    total.wall_s = wall
    base_tokens = sum(len(r.tokens) for r in refs)
    base_tps = base_tokens / sum(r.wall_s for r in refs)
    row = {
        "tree": label,
        "prompts": len(prompts),
        "lossless_exact": sum(v[0] == "exact" for v in verdicts) if verdicts else None,
        "divergences_near_tie": sum(v[0] == "near_tie" for v in verdicts) if verdicts else None,
        "divergences_other": sum(v[0] == "other" for v in verdicts) if verdicts else None,
        "tau": round(total.tau, 3),
        "alpha_by_depth": [round(a, 3) for a in total.alpha_by_depth],
        "target_forwards_per_token": round(total.rounds / total.generated_tokens, 4),
        "drafted_accepted": round(total.accepted_tokens / max(1, total.drafted_nodes), 3),
        "tokens": total.generated_tokens,
        "tokens_per_s": round(total.tokens_per_s, 2),
        "baseline_tokens_per_s": round(base_tps, 2),
        "speedup": round(total.tokens_per_s / base_tps, 3),
        "time_split_s": {"draft": round(total.draft_us / 1e6, 2), "verify": round(total.verify_us / 1e6, 2),
                         "verifier_prefill": round(total.prefill_us / 1e6, 2),
                         "network_and_rest": round(total.network_us / 1e6, 2)},
    }
    return row


def report(result: dict, path: Path) -> None:
    lines = [
        "# Speculative decoding bench", "",
        f"{result['prompts']} HumanEval prompts, {result['max_new_tokens']} new tokens, temperature "
        f"{result['temperature']}, {result['threads']} threads per engine, one-way link delay "
        f"{result['delay_ms_one_way']} ms, batch-shape noise "
        f"{result['batch_shape_noise']:.3f} (max |logit delta|). Baseline: target-only decoding on the same "
        f"engine and model file, {result['baseline_tokens_per_s']} tokens/s in this run.", "",
        "| tree k,N,D / mode | tau | forwards/token | drafted accepted | tokens/s | speedup | exact | near-tie "
        "| other |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        lines.append(f"| {r['tree']} | {r['tau']} | {r['target_forwards_per_token']} | {r['drafted_accepted']} | "
                     f"{r['tokens_per_s']} | {r['speedup']}x | {r['lossless_exact']} | "
                     f"{r['divergences_near_tie']} | {r['divergences_other']} |")
    lines += ["", "Acceptance by depth (alpha_d):", "", "| tree | " + " | ".join(
        f"d={d + 1}" for d in range(max(len(r["alpha_by_depth"]) for r in result["runs"]))) + " |",
        "|---|" + "---|" * max(len(r["alpha_by_depth"]) for r in result["runs"])]
    for r in result["runs"]:
        lines.append(f"| {r['tree']} | " + " | ".join(str(a) for a in r["alpha_by_depth"]) + " |")
    lines += ["", "Time split per run (seconds): " + "; ".join(
        f"{r['tree']}: {r['time_split_s']}" for r in result["runs"]), "",
        "On one CPU host the drafter and the verifier share the cores, so tokens/s measures the protocol, not the "
        "deployment: in production the drafter's cost is on the user's device and the verifier's on the GPU."]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=8, help="HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tree", action="append", help="k,N,D (repeatable; default 1,6,6 and 4,16,6)")
    ap.add_argument("--adaptive", action="store_true", help="add a run with the adaptive draft policy")
    ap.add_argument("--proactive", action="store_true", help="add a proactive-drafting run of the first --tree")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="emulated one-way link delay (in-process)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--json", type=Path, help="also write the JSON here")
    ap.add_argument("--report", type=Path, default=Path("bench/out/speculative.md"))
    args = ap.parse_args(argv)
    logs.configure()
    shapes = [TreeShape.parse(t) for t in (args.tree or ["1,6,6", "4,16,6"])]

    engine = LlamaVerifierEngine(models.resolve(args.target, "target"), n_ctx=4096, n_threads=args.threads)
    drafter = LlamaDrafter(models.resolve(args.drafter, "drafter"), n_ctx=4096, n_threads=args.threads)
    tok = engine.model
    prompts = [tok.tokenize(tok.chat_prompt(humaneval_messages(p))) for p in humaneval(args.limit)]

    refs = []
    for i, p in enumerate(prompts):
        refs.append(reference.greedy(engine, p, args.max_new_tokens))
        _progress(f"target-only prompt {i + 1}/{len(prompts)}: {len(refs[-1].tokens)} tokens, "
                  f"{len(refs[-1].tokens) / refs[-1].wall_s:.1f} tokens/s")
    noise = max(reference.batch_shape_noise(engine, p, r.tokens[:8]) for p, r in zip(prompts[:2], refs[:2]))
    _progress(f"batch-shape noise {noise:.3f}")

    server, port = serve(engine, "127.0.0.1:0", max_sessions=2)
    address = f"127.0.0.1:{port}"
    link = [DelayInterceptor(args.delay_ms)] if args.delay_ms else []
    configs = [(str(s), EdgeClient(drafter, address, interceptors=link), s) for s in shapes]
    if args.adaptive:
        configs.append(("adaptive", EdgeClient(drafter, address, interceptors=link, policy=DraftPolicy()), shapes[0]))
    if args.proactive:
        configs.append((f"{shapes[0]} proactive", EdgeClient(drafter, address, interceptors=link, proactive=True),
                        shapes[0]))
    t0 = time.perf_counter()
    runs = [run_shape(client, prompts, refs, noise, args, shape, label) for label, client, shape in configs]
    for _, client, _ in configs:
        client.close()
    server.stop(grace=None)

    result = {**runs[0], "runs": runs, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "delay_ms_one_way": args.delay_ms,
              "threads": args.threads, "batch_shape_noise": round(noise, 4),
              "bench_s": round(time.perf_counter() - t0, 1), "target": engine.model_id,
              "drafter": drafter.model.identity}
    bad = sum(r["divergences_other"] or 0 for r in runs)
    return finish(result, args.json, report, args.report, not bad,
                  f"{bad} divergences from target-only decoding that are not near-ties", "bench")


if __name__ == "__main__":
    sys.exit(main())
