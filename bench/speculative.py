"""Edge->cloud speculative decoding against target-only decoding, on HumanEval prompts, in one run.

    python -m bench.speculative --limit 8 --max-new-tokens 128 --tree 1,6,6 --tree 4,16,6 --adaptive --json out.json
    python -m bench.speculative --limit 4 --temperature 0.7 --adaptive --json sampled.json

Target-only decoding runs on the same verifier engine and model file (one token per forward, greedy or sampled
with the same per-position draws); then each configuration runs the full edge path (llama.cpp drafter -> gRPC on
localhost -> verifier, llama.cpp or ``--engine torch``): ``cloud_ar`` (the verifier decodes alone and streams),
each ``--tree`` pipelined (drafted while the verifier streams) and, with ``--lock-step``, in lock-step rounds,
``--adaptive`` (the policy, ``--objective``), ``--proactive``. Prints JSON (the first --tree at top level, every
configuration under "runs"), writes a Markdown report, and exits 1 on a correctness failure:

- greedy: an output diverging from target-only decoding other than at a measured near-tie;
- sampled (``--temperature`` > 0): a pinned-seed output diverging from target-only sampling with the same seed
  other than where a draw lies within ``reference.SAMPLED_BOUNDARY`` of a CDF edge, or the distribution check
  failing: the joint distribution of the first two tokens over ``--samples`` edge generations with fresh entropy,
  against the target's exact distribution (chi-square, p < 1e-4 fails).

Cloud cost: ``verifier_ms_per_token`` is the verifier's busy time (its verify_us) per committed token, and
``verifier_cost_vs_target_only`` its ratio to target-only decoding's time per token on the same engine.
The adaptive run's ``policy.requests`` keeps, prompt by prompt, the tokens each mode committed and the policy's
decisions (phase ends and re-checks, with the rates they stood on).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from tandem.cloud import reference
from tandem.cloud.engines import load_engine
from tandem.cloud.server import serve
from tandem.core import logs
from tandem.core.llama_runtime import LlamaModel
from tandem.core.sampling import Sampling, warp
from tandem.core.tree import TreeShape
from tandem.edge.client import EdgeClient, GenerationStats, wait_idle
from tandem.edge.drafter import load_drafter
from tandem.edge.planner import FixedPlanner
from tandem.orchestrator import models
from tandem.edge.policy import DraftPolicy

from .netdelay import DelayInterceptor
from .output import finish, policy_log_since, policy_mark, policy_summary, ProbedPolicy
from tandem.orchestrator.datasets import humaneval, humaneval_messages

def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def sampling_for(args, i: int) -> Sampling:
    return Sampling(args.temperature, top_p=args.top_p, seed=args.seed + i) if args.temperature else Sampling()


def run_prompt(client: EdgeClient, planner, prompt, ref, noise, args, i: int, label: str):
    policy = planner if isinstance(planner, DraftPolicy) else None
    mark = policy_mark(policy) if policy is not None else None
    gen = client.generate(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling_for(args, i),
                          planner=planner).result()
    verdict = (reference.classify(gen.tokens, ref, noise) if not args.temperature
               else reference.classify_sampled(gen.tokens, ref))
    _progress(f"{label} prompt {i + 1}: {gen.stats.summary()} [{verdict[0]}]")
    # with the policy: what each mode ran in this request, and why (phase ends and re-checks)
    return gen.stats, verdict, (policy_log_since(policy, mark) if policy is not None and mark is not None else None)


def summarise(label: str, results: list, refs, planner, base_ms_per_token: float) -> dict:
    """One configuration's row from its per-prompt (stats, verdict, policy log); ``refs``: target-only decoding of
    the same prompts, run interleaved with every configuration (prompt by prompt), so a host that speeds up or slows
    down during the run shifts baseline and configurations alike."""
    total = GenerationStats()
    for s, _, _ in results:
        total.add(s)
    verdicts, ttft = [v for _, v, _ in results], [s.ttft_s for s, _, _ in results]
    base_tokens = sum(len(r.tokens) for r in refs)
    base_tps = base_tokens / sum(r.wall_s for r in refs)
    row = {
        "tree": label,
        "prompts": len(results),
        "lossless_exact": sum(v[0] == "exact" for v in verdicts),
        "divergences_near_tie": sum(v[0] == "near_tie" for v in verdicts),
        "divergences_other": sum(v[0] == "other" for v in verdicts),
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
        "ttft_ms": round(1000 * float(np.mean(ttft)), 1),
        "verifier_ms_per_token": round(total.verifier_ms_per_token, 2),
        "verifier_cost_vs_target_only": round(total.verifier_ms_per_token / base_ms_per_token, 3),
        "trees": total.trees, "streamed_tokens": total.streamed_tokens, "rebased_tokens": total.rebased_tokens,
        "stale_trees": total.stale_trees, "dead_trees": total.dead_trees, "proactive_hits": total.proactive_hits,
    }
    if isinstance(planner, DraftPolicy):
        summary = policy_summary(planner)
        row["policy"] = {"rates_tokens_per_s": summary.pop("rates"), **summary,
                         "requests": [log for _, _, log in results]}
    return row


def distribution_check(engine, client: EdgeClient, prompt: list[int], sampling: Sampling, samples: int) -> dict:
    """First two tokens of ``samples`` generations with fresh entropy through the whole edge path, against the
    target's exact joint distribution p(x1) p(x2 | x1) (cells the test can see: x1 with p >= 1e-4)."""
    from scipy import stats

    from tandem.core.tree import DraftTree
    seq = engine.new_sequence()
    try:
        engine.prefill(seq, prompt[:-1])
        p1 = warp(np.array(engine.forward_tree(seq, prompt[-1], DraftTree())[0]), sampling)
    finally:
        engine.release(seq)
    joint = {}
    for x1 in np.flatnonzero(p1 >= 1e-4):
        seq = engine.new_sequence()
        try:
            engine.prefill(seq, prompt)
            p2 = warp(np.array(engine.forward_tree(seq, int(x1), DraftTree())[0]), sampling)
        finally:
            engine.release(seq)
        for x2 in np.flatnonzero(p2 >= 1e-6):
            joint[(int(x1), int(x2))] = p1[x1] * p2[x2]
    counts: dict = {}
    for i in range(samples):
        toks = tuple(client.generate(prompt, max_new_tokens=2, sampling=sampling).result().tokens)
        counts[toks] = counts.get(toks, 0) + 1
        if (i + 1) % 50 == 0:
            _progress(f"distribution check {i + 1}/{samples}")
    n = sum(counts.values())
    big = [k for k, p in joint.items() if p * n >= 5]
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    exp = [joint[k] * n for k in big] + [n * (1 - sum(joint[k] for k in big))]
    p_value = float(stats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - joint.get(k, 0.0)) for k in set(counts) | set(joint))
    return {"samples": n, "cells": len(big) + 1, "chi2_p_value": round(p_value, 6), "total_variation": round(tv, 4),
            "ok": p_value > 1e-4}


def report(result: dict, path: Path) -> None:
    sampled = result["temperature"] > 0
    lines = [
        "# Speculative decoding bench", "",
        f"{result['prompts']} HumanEval prompts, {result['max_new_tokens']} new tokens, temperature "
        f"{result['temperature']}, {result['threads']} threads per engine, one-way link delay "
        f"{result['delay_ms_one_way']} ms, batch-shape noise {result['batch_shape_noise']:.3f} (max |logit delta|). "
        f"Baseline: target-only {'sampled' if sampled else 'greedy'} decoding on the same engine and model file, "
        f"{result['baseline_tokens_per_s']} tokens/s and {result['baseline_ms_per_token']} ms of verifier time per "
        f"token in this run.", "",
        "| configuration | tau | forwards/token | drafted accepted | tokens/s | speedup | TTFT ms | verifier ms/token "
        "| cloud cost vs target-only | exact | near-tie | other |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        lines.append(f"| {r['tree']} | {r['tau']} | {r['target_forwards_per_token']} | {r['drafted_accepted']} | "
                     f"{r['tokens_per_s']} | {r['speedup']}x | {r['ttft_ms']} | {r['verifier_ms_per_token']} | "
                     f"{r['verifier_cost_vs_target_only']}x | {r['lossless_exact']} | {r['divergences_near_tie']} | "
                     f"{r['divergences_other']} |")
    depth = max(len(r["alpha_by_depth"]) for r in result["runs"])
    lines += ["", "Acceptance by depth (alpha_d):", "", "| configuration | " + " | ".join(
        f"d={d + 1}" for d in range(depth)) + " |", "|---|" + "---|" * depth]
    for r in result["runs"]:
        lines.append(f"| {r['tree']} | " + " | ".join(str(a) for a in r["alpha_by_depth"]) + " |")
    for r in result["runs"]:
        if "policy" in r:
            lines += ["", f"Policy ({r['tree']}): measured rates {r['policy']['rates_tokens_per_s']}, chose "
                      f"{r['policy']['favourite']}; predicted vs measured tree round times: "
                      f"{r['policy']['prediction']}; its probes of the other modes lost "
                      f"{r['policy'].get('explore_loss_ms', '-')} ms against the favourite."]
            if r["policy"].get("requests"):  # (older JSON has none)
                lines += ["", "Tokens each mode committed, prompt by prompt: " + "; ".join(
                    ", ".join(f"{m} {n}" for m, n in q["tokens_by_mode"].items() if n)
                    for q in r["policy"]["requests"]) + "."]
    if "deterministic" in result:
        d = result["deterministic"]
        lines += ["", f"Deterministic mode: verifier logits independent of batch shape, so every run must be exact "
                  f"(near-ties fail too). Its cost: target-only decoding at {d['default_engine_tokens_per_s']} "
                  f"tokens/s without the mode, {d['target_only_vs_default_engine']}x that with it (prefill "
                  f"included); {d['same_tokens_as_default_engine']}/{result['prompts']} prompts decode to the same "
                  f"tokens with and without the mode."]
    if "distribution" in result:
        d = result["distribution"]
        lines += ["", f"Distribution check (first two tokens, {d['samples']} generations with fresh entropy, "
                  f"{d['cells']} cells): chi-square p = {d['chi2_p_value']}, total variation {d['total_variation']}"
                  f" -> {'ok' if d['ok'] else 'FAILED'}."]
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
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="sampled runs pin seed + prompt index")
    ap.add_argument("--samples", type=int, default=200, help="generations of the distribution check (sampled)")
    ap.add_argument("--tree", action="append", help="k,N,D (repeatable; default 1,6,6 and 4,16,6)")
    ap.add_argument("--lock-step", action="store_true", help="also run each --tree in lock-step rounds")
    ap.add_argument("--adaptive", action="store_true", help="add a run with the adaptive draft policy")
    ap.add_argument("--objective", default="latency", choices=("latency", "cloud_cost"))
    ap.add_argument("--proactive", action="store_true", help="add a proactive-drafting run of the first --tree")
    ap.add_argument("--no-cloud-ar", action="store_true", help="skip the cloud-only streaming run")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="emulated one-way link delay (in-process)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--drafter-engine", default="llama.cpp", choices=("llama.cpp", "onnx"))
    ap.add_argument("--drafter-vocab", default="", help="VocabTrim head (.npy) for the onnx drafter")
    ap.add_argument("--engine", default="llama.cpp", choices=("llama.cpp", "torch"),
                    help="the verifier's engine (torch: float32 on CPU, slow; pass a small --target)")
    ap.add_argument("--deterministic", action="store_true",
                    help="verifier in deterministic mode (logits independent of batch shape): every divergence "
                         "fails, near-ties included; also times target-only decoding without the mode (its cost)")
    ap.add_argument("--json", type=Path, help="also write the JSON here")
    ap.add_argument("--report", type=Path, default=Path("bench/out/speculative.md"))
    args = ap.parse_args(argv)
    logs.configure()
    shapes = [TreeShape.parse(t) for t in (args.tree or ["1,6,6", "4,16,6"])]

    target = models.resolve(args.target, "target")
    common = dict(model_path=str(target), n_ctx=4096, n_threads=args.threads)
    engine = load_engine(args.engine, **common, deterministic=args.deterministic)
    default_engine = load_engine(args.engine, **common) if args.deterministic else None
    drafter = load_drafter(args.drafter_engine, model_path=models.resolve(args.drafter, "drafter"), n_ctx=4096,
                           n_threads=args.threads, **({"vocab": args.drafter_vocab, "learn_vocab": False}
                                                      if args.drafter_vocab else {}))
    tok = engine.model if args.engine == "llama.cpp" else LlamaModel(target, vocab_only=True)
    prompts = [tok.tokenize(tok.chat_prompt(humaneval_messages(p))) for p in humaneval(args.limit)]

    first = [reference.decode(engine, p, 16, sampling_for(args, i)) for i, p in enumerate(prompts[:2])]
    noise = max(reference.batch_shape_noise(engine, p, r.tokens[:8]) for p, r in zip(prompts[:2], first))
    _progress(f"batch-shape noise {noise:.3f}")

    server, port = serve(engine, "127.0.0.1:0", max_sessions=2)
    address = f"127.0.0.1:{port}"
    link = [DelayInterceptor(args.delay_ms)] if args.delay_ms else []
    client = EdgeClient(drafter, address, interceptors=link)
    configs = [] if args.no_cloud_ar else [("cloud_ar", client, FixedPlanner(None))]
    configs += [(str(s), client, FixedPlanner(s)) for s in shapes]
    if args.lock_step:
        configs += [(f"{s} lock-step", client, FixedPlanner(s, stream=False)) for s in shapes]
    if args.adaptive:
        configs.append(("adaptive", client, ProbedPolicy(objective=args.objective)))
    if args.proactive:
        eager = EdgeClient(drafter, address, interceptors=link, proactive=True)
        configs.append((f"{shapes[0]} proactive", eager, FixedPlanner(shapes[0])))
    t0 = time.perf_counter()
    for _, c, planner in configs:
        if isinstance(planner, DraftPolicy):  # a real client keeps its policy across requests: warm it up
            c.generate(prompts[0], max_new_tokens=args.max_new_tokens, planner=planner).result()
    refs, results, default_refs = [], {label: [] for label, _, _ in configs}, []
    for i, p in enumerate(prompts):  # prompt by prompt, every configuration: drift hits all alike
        refs.append(reference.decode(engine, p, args.max_new_tokens, sampling_for(args, i)))
        if default_engine is not None:  # the mode's cost: the same decoding without it
            default_refs.append(reference.decode(default_engine, p, args.max_new_tokens, sampling_for(args, i)))
        _progress(f"target-only prompt {i + 1}/{len(prompts)}: {len(refs[-1].tokens)} tokens, "
                  f"{len(refs[-1].tokens) / refs[-1].wall_s:.1f} tokens/s")
        for label, c, planner in configs:
            wait_idle(drafter)
            drafter.start([])  # cold for every run: the last configuration's cells of this prompt would help
            results[label].append(run_prompt(c, planner, p, refs[-1], noise, args, i, label))
    base_ms_per_token = 1000 * sum(r.wall_s for r in refs) / sum(len(r.tokens) for r in refs)
    runs = [summarise(label, results[label], refs, planner, base_ms_per_token) for label, _, planner in configs]
    first = next(r for r in runs if r["tree"] == str(shapes[0]))
    result = {**first, "runs": runs, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "delay_ms_one_way": args.delay_ms, "threads": args.threads, "batch_shape_noise": round(noise, 4),
              "baseline_ms_per_token": round(base_ms_per_token, 2), "target": engine.model_id,
              "drafter": drafter.model.identity if hasattr(drafter, "model") else
              f"{Path(drafter.meta['source']).name} (onnx {drafter.meta['quant']}, head {drafter.vocab_k} ids)",
              "drafter_engine": args.drafter_engine, "deterministic_mode": args.deterministic,
              "engine": args.engine}
    ok = not sum(r["divergences_other"] for r in runs)
    why = "divergences from target-only decoding that are not near-ties"
    if args.deterministic:  # bit-identical logits: a near-tie is no excuse
        ok &= not sum(r["divergences_near_tie"] for r in runs)
        why = "divergences from target-only decoding (deterministic mode: near-ties included)"
        default_tps = sum(len(r.tokens) for r in default_refs) / sum(r.wall_s for r in default_refs)
        result["deterministic"] = {
            "default_engine_tokens_per_s": round(default_tps, 2),
            "target_only_vs_default_engine": round(result["baseline_tokens_per_s"] / default_tps, 3),
            "same_tokens_as_default_engine": sum(a.tokens == b.tokens for a, b in zip(refs, default_refs)),
        }
    if args.temperature:
        result["distribution"] = distribution_check(engine, client, prompts[0],
                                                    Sampling(args.temperature, top_p=args.top_p), args.samples)
        ok &= result["distribution"]["ok"]
        why += " / the distribution check"
    result["bench_s"] = round(time.perf_counter() - t0, 1)
    for _, c, _ in configs:
        c.close()
    server.stop(grace=None)
    return finish(result, args.json, report, args.report, ok, why, "bench")


if __name__ == "__main__":
    sys.exit(main())
