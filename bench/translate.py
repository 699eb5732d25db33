"""Drafting through translation against the native pair, in one run: what another tokenizer costs.

Two arms on the same verifier (the target on the llama.cpp engine, in-process gRPC): the pinned drafter
(*native*) and the same drafter rewritten with its token ids shuffled (``bench/gguf_copies.py: permuted_copy``):
the same model and segmentation of text but no id in common, so the verifier refuses it as it is and the edge
pairs it by translation (``edge/translate.py``). Each arm drafts lock-step chains on the same prompts (HumanEval
and ShareGPT, greedy); prompts alternate which arm goes first. Reported per dataset: tokens per verify forward,
tokens/s, drafting ms per round, and the translated arm's ratios to the native one. Correctness: every answer is
checked against target-only greedy decoding on the same engine (exact, or a measured batch-shape near-tie); the
bench exits 1 otherwise. The shuffled copy measures the mechanism's cost alone; a third arm, *cross*, is a drafter
of another family (``--cross-drafter``, default Gemma 3 270M: another tokenizer, other merges, its own training),
which also loses acceptance where the two tokenizers cut text differently; a fourth, *cloud_only*, decodes with no
drafts at all, the baseline every arm must beat to be worth running.

    python -m bench.translate --limit 4 --max-new-tokens 64 --json bench/out/translate.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from bench.output import finish


def _progress(msg: str) -> None:
    print(f"[bench.translate] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.translate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=4, help="prompts per dataset (HumanEval, ShareGPT)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--chain", type=int, default=6, help="chain depth drafted every round (lock-step)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--cross-drafter", default="gemma3-270m",
                    help="a drafter of another family, a named model or a GGUF path ('none': no such arm)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/translate.md"))
    args = ap.parse_args(argv)

    from bench.gguf_copies import CACHE, permuted_copy
    from tandem.cloud import reference
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    from tandem.cloud.server import serve
    from tandem.core import logs
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.llama_drafter import LlamaDrafter
    from tandem.edge.planner import FixedPlanner
    from tandem.orchestrator import datasets, models
    logs.configure()

    engine = LlamaVerifierEngine(models.resolve(args.target, "target"), n_ctx=2048, n_threads=args.threads,
                                 max_sessions=2)
    server, port = serve(engine, "127.0.0.1:0", max_sessions=2)
    native_path = models.resolve(args.drafter, "drafter")
    _progress("writing (once) the drafter with its ids shuffled")
    paths = {"native": native_path, "translated": permuted_copy(native_path, CACHE)}
    if args.cross_drafter != "none":
        _progress(f"fetching (once) the cross-family drafter {args.cross_drafter}")
        paths["cross"] = models.resolve(args.cross_drafter, "drafter")
    shape = TreeShape(1, args.chain, args.chain)
    clients = {}
    for arm, path in paths.items():
        clients[arm] = EdgeClient(LlamaDrafter(path, n_ctx=2048, n_threads=args.threads), f"127.0.0.1:{port}",
                                  shape, stream=False)
        paired = clients[arm].pair_with_target()
        if paired != ("translated" if arm == "cross" else arm):
            raise SystemExit(f"the {arm} drafter paired as {paired!r}")
    planners = {arm: FixedPlanner(shape, stream=False) for arm in paths}
    planners["cloud_only"] = FixedPlanner(None)  # the native client, decoding with no drafts
    arms = [*paths, "cloud_only"]
    chats = {"humaneval": [datasets.humaneval_messages(p) for p in datasets.humaneval(args.limit)],
             "sharegpt": datasets.sharegpt(args.limit)}
    rows, failures = [], []
    noise = None
    try:
        for dataset, items in chats.items():
            for i, chat in enumerate(items):
                prompt = clients["native"].prompt_tokens(chat)
                ref = reference.greedy(engine, prompt, args.max_new_tokens)
                if noise is None:
                    noise = reference.batch_shape_noise(engine, prompt, ref.tokens[:8])
                order = arms if i % 2 == 0 else arms[::-1]  # no arm always first (warm caches, a busy host)
                for arm in order:
                    t0 = time.perf_counter()
                    client = clients.get(arm, clients["native"])
                    gen = client.generate(prompt, max_new_tokens=args.max_new_tokens, planner=planners[arm]).result()
                    wall = time.perf_counter() - t0
                    verdict = reference.classify(gen.tokens, ref, noise)
                    if verdict[0] not in ("exact", "near_tie"):
                        failures.append(f"{arm} {dataset} #{i}: {verdict}")
                    s = gen.stats
                    rows.append({"arm": arm, "dataset": dataset, "prompt": i, "tokens": s.generated_tokens,
                                 "verify_forwards": s.rounds, "wall_s": round(wall, 3),
                                 "draft_ms": round(s.draft_us / 1000, 1), "check": verdict[0],
                                 "drafted": s.drafted_nodes, "accepted": s.accepted_tokens})
                    _progress(f"{dataset} #{i} {arm}: {s.generated_tokens} tokens, {s.rounds} forwards, "
                              f"{s.generated_tokens / wall:.1f} tokens/s ({verdict[0]})")
    finally:
        for c in clients.values():
            c.close()
        server.stop(grace=None)

    summary: dict = {}
    for dataset in chats:
        for arm in arms:
            rs = [r for r in rows if r["arm"] == arm and r["dataset"] == dataset]
            tokens, forwards = sum(r["tokens"] for r in rs), sum(r["verify_forwards"] for r in rs)
            drafted = sum(r["drafted"] for r in rs)
            summary.setdefault(dataset, {})[arm] = {
                "tokens_per_forward": round(tokens / max(1, forwards), 3),
                "tokens_per_s": round(tokens / max(1e-9, sum(r["wall_s"] for r in rs)), 2),
                "draft_ms_per_round": round(sum(r["draft_ms"] for r in rs) / max(1, forwards), 1),
                "acceptance": round(sum(r["accepted"] for r in rs) / drafted, 3) if drafted else None}
        n = summary[dataset]["native"]
        for arm in arms[1:]:
            a = summary[dataset][arm]
            summary[dataset][f"{arm}_vs_native"] = {
                "tokens_per_forward": round(a["tokens_per_forward"] / n["tokens_per_forward"], 3),
                "tokens_per_s": round(a["tokens_per_s"] / n["tokens_per_s"], 3)}
        base = summary[dataset]["cloud_only"]["tokens_per_s"]
        summary[dataset]["tokens_per_s_vs_cloud_only"] = {
            arm: round(summary[dataset][arm]["tokens_per_s"] / base, 3) for arm in paths}
    result = {"bench": "translate", "arms": arms, "paths": {a: Path(p).name for a, p in paths.items()},
              "chain": args.chain, "max_new_tokens": args.max_new_tokens,
              "limit": args.limit, "noise": round(noise or 0.0, 4), "lossless_ok": not failures,
              "failures": failures, "summary": summary, "rows": rows}
    return finish(result, args.json, _report, args.report, not failures, "; ".join(failures), "bench.translate")


def _report(result: dict, path: Path) -> None:
    lines = ["# Drafting through translation against the native pair", "",
             f"**Measured** on this machine: lock-step chains of {result['chain']}, {result['max_new_tokens']} new "
             f"tokens, {result['limit']} prompts per dataset, greedy; lossless_ok = {result['lossless_ok']}.", "",
             "Arms: " + ", ".join(f"{a} ({p})" for a, p in result.get("paths", {}).items()) + ", cloud_only.", "",
             "| dataset | arm | acceptance | tokens per verify forward | tokens/s | ÷ cloud-only "
             "| drafting ms per round |",
             "|---|---|---|---|---|---|---|"]
    for dataset, arms in result["summary"].items():
        vs = arms.get("tokens_per_s_vs_cloud_only", {})
        for arm in result.get("arms", ["native", "translated"]):
            a = arms[arm]
            lines.append(f"| {dataset} | {arm} | {a.get('acceptance')} | {a['tokens_per_forward']} | "
                         f"{a['tokens_per_s']} | {vs.get(arm, '')} | {a['draft_ms_per_round']} |")
        for key in [k for k in arms if k.endswith("_vs_native")]:
            r = arms[key]
            lines.append(f"| {dataset} | {key.replace('_vs_', ' / ')} | | {r['tokens_per_forward']}x | "
                         f"{r['tokens_per_s']}x | | |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
