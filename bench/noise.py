"""Batch-shape noise as the lossless checker measures it (one-token forwards beside another session) against the noise
of the tree forwards it judges, on the real pair, in one run.

    python -m bench.noise --limit 8 --json bench/out/noise.json

For ``--limit`` HumanEval and ``--limit`` ShareGPT prompts: the target's greedy reference (``--max-new-tokens``),
then a speculative generation for each tree shape through a verifier that records its rows at every committed
position. Up to the first divergence the verifier's row and the reference's are rows of the same position, and the
"swaps" between them (how far the gap between the reference's best token and each of its 7 runners-up moved, both
ways) are the noise that decides near-ties. ``cloud.reference.batch_shape_noise`` measures the same quantity
without any tree forward; ``classify`` bounds the near-ties it excuses by how often its swaps exceed each gap,
times ``reference.SWAP_SAFETY``.

Reported: both swap distributions (the fraction above each gap), their largest values, the reference's top-2 gaps,
and every first divergence with its gap. Exit 1 when, at any gap, the tree forwards' swaps exceed it more than
``SWAP_SAFETY`` times as often as the checker's model says (``Noise.swap_probability``: the measured bulk, the fitted
tail; with at least 20 tree swaps above the gap: the rare tail is noise of its own): the checker's excuse would
then be too tight and fail honest output.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from .output import cpu_name, finish

GAPS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)
SHAPES = ("4,16,6", "1,6,6")


def _progress(msg: str) -> None:
    print(f"[noise] {msg}", file=sys.stderr, flush=True)


class RowRecorder:
    """Delegates to the engine and keeps, for each committed position, the verifier's logits at the reference's
    best tokens there (``want[k]``: (token, logit) pairs of position k, best first)."""

    def __init__(self, inner):
        self.inner, self.want, self.got = inner, None, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward_batch(self, jobs):
        out = self.inner.forward_batch(jobs)
        self._rows = {id(j.seq): np.array(r) for j, r in zip(jobs, out)}
        return out

    def keep_path(self, seq, tree, path):
        rows = self._rows.pop(id(seq))
        for row in [rows[0]] + [rows[n + 1] for n in path]:
            k = len(self.got)
            if self.want is not None and k < len(self.want):
                self.got.append(row[[t for t, _ in self.want[k]]])
        self.inner.keep_path(seq, tree, path)


def swaps(reference_logits: np.ndarray, other: np.ndarray) -> list[float]:
    """How far each runner-up's gap to the best moved between two rows (both ways): what noise does to a tie."""
    moved = (reference_logits[0] - reference_logits[1:]) - (other[0] - other[1:])
    return moved.tolist() + (-moved).tolist()


def tail(xs: np.ndarray) -> dict[str, float]:
    return {f"{g}": round(float((xs > g).mean()), 6) if xs.size else 0.0 for g in GAPS}


def report(result: dict, path: Path) -> None:
    lines = ["# Batch-shape noise: the checker's measurement against the tree forwards it judges", "",
             f"Measured on {result['cpu']}, {result['date']}: {result['prompts']} prompts (HumanEval + ShareGPT), "
             f"{result['max_new_tokens']} greedy tokens each, trees {', '.join(result['shapes'])}; "
             f"{result['tree_swaps']} swaps from the verifier's tree rows, {result['checker_swaps']} from the "
             f"checker's one-token path. Check (SWAP_SAFETY {result['swap_safety']}): {result['ok']}.", "",
             "| gap | P(swap > gap), tree forwards | measured by the checker | the checker's model (bulk measured, "
             "tail fitted) | tree / model |", "|---|---|---|---|---|"]
    for g in GAPS:
        t, c, m = (result[k][f"{g}"] for k in ("tree_tail", "checker_tail", "checker_model"))
        lines.append(f"| {g} | {t} | {c} | {m} | {round(t / m, 2) if m else '-'} |")
    lines += ["", f"Largest |swap|: tree {result['tree_max']}, checker {result['checker_max']}; largest |logit "
                  f"delta| the checker measured (its noise): {result['noise_max']}.", "",
              "| prompt | tree | first divergence at | reference top-2 gap there |", "|---|---|---|---|"]
    lines += [f"| {d['prompt']} | {d['shape']} | {d['at']} | {d['gap']} |" for d in result["divergences"]]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.noise", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=8, help="prompts per dataset (HumanEval, ShareGPT)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/noise.md"))
    args = ap.parse_args(argv)

    import os

    from tandem.cloud import reference
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    from tandem.cloud.server import serve
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.llama_drafter import LlamaDrafter
    from tandem.orchestrator import models
    from tandem.orchestrator.datasets import humaneval, humaneval_messages, sharegpt

    threads = args.threads or max(1, os.cpu_count() or 1)
    engine = LlamaVerifierEngine(models.resolve(args.target, "target"), n_ctx=2048, n_threads=threads,
                                 max_sessions=4)
    recorder = RowRecorder(engine)
    server, port = serve(recorder, "127.0.0.1:0", max_sessions=2)
    drafter = LlamaDrafter(models.resolve(args.drafter, "drafter"), n_ctx=2048, n_threads=threads)
    chats = [humaneval_messages(p) for p in humaneval(args.limit)] + sharegpt(args.limit)
    tree_swaps, checker_swaps, gaps, divergences, noise_max = [], [], [], [], 0.0
    try:
        for i, chat in enumerate(chats):
            prompt = engine.model.tokenize(engine.model.chat_prompt(chat))
            ref = reference.greedy(engine, prompt, args.max_new_tokens)
            for shape in SHAPES:
                recorder.want, recorder.got = ref.top, []
                client = EdgeClient(drafter, f"127.0.0.1:{port}", TreeShape.parse(shape), stream=False)
                out = client.generate(prompt, max_new_tokens=args.max_new_tokens).result().tokens
                client.close()
                div = next((j for j, (a, b) in enumerate(zip(out, ref.tokens)) if a != b), len(out))
                for k in range(min(div + 1, len(recorder.got))):  # (the divergent position's row is the same one)
                    tree_swaps += swaps(np.array([v for _, v in ref.top[k]]), recorder.got[k])
                if div < len(out):
                    divergences.append({"prompt": i, "shape": shape, "at": div, "gap": round(ref.top2_gap[div], 4)})
            measured = reference.batch_shape_noise(engine, prompt, ref.tokens[:8])
            checker_swaps += measured.swaps.tolist()
            noise_max = max(noise_max, float(measured))
            gaps += ref.top2_gap
            _progress(f"prompt {i + 1}/{len(chats)}: {len(tree_swaps)} tree swaps, {len(checker_swaps)} checker "
                      f"swaps, {len(divergences)} divergences")
    finally:
        server.stop(None)
    tree, checker = np.array(tree_swaps), np.array(checker_swaps)
    model = reference.Noise(noise_max, checker_swaps)  # what classify uses: measured bulk, fitted tail
    checker_model = {f"{g}": round(model.swap_probability(g), 6) for g in GAPS}
    too_tight = [g for g in GAPS if (tree > g).sum() >= 20
                 and (tree > g).mean() > reference.SWAP_SAFETY * max(model.swap_probability(g), 1e-12)]
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "prompts": len(chats), "shapes": list(SHAPES),
              "max_new_tokens": args.max_new_tokens, "tree_swaps": int(tree.size), "checker_swaps": int(checker.size),
              "tree_tail": tail(tree), "checker_tail": tail(checker), "checker_model": checker_model,
              "tree_max": round(float(np.abs(tree).max()), 4) if tree.size else 0.0,
              "checker_max": round(float(np.abs(checker).max()), 4) if checker.size else 0.0,
              "noise_max": round(noise_max, 4), "swap_safety": reference.SWAP_SAFETY,
              "reference_gaps_below": {f"{g}": int((np.array(gaps) < g).sum()) for g in (0.1, 0.3, 0.6, 1.2)},
              "positions": len(gaps), "divergences": divergences, "too_tight_at": too_tight, "ok": not too_tight}
    return finish(result, args.json, report, args.report, result["ok"],
                  f"the tree forwards overturn gaps {too_tight} more than {reference.SWAP_SAFETY}x as often as the "
                  f"checker's measured noise says", "noise")


if __name__ == "__main__":
    sys.exit(main())
