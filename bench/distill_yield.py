"""How promptly online distillation hands the verifier its compute back, on the real pair: the drafter trains
(cloud/learning/distill.py, a LoRA step on a window of ``--window`` tokens) while the verifier (the target on the
llama.cpp engine, this process) is idle; at a moment uniform over a step, traffic arrives: the step is told to yield and
a prefill of ``--prompt-tokens`` starts at once, beside it.

Per trial: how long the step kept running after it was told (``yield_ms``: until the step was dropped), and that
prefill's time against the same prefill on an idle verifier just before (``prefill_ratio``). The goal (issue 43):
no verify forward delayed past the scheduler's batch window. Correctness: a dropped step changes nothing (the
adapter's weights after each trial whose step was dropped are those before it); exits 1 otherwise.

    python -m bench.distill_yield --limit 8 --json bench/out/distill_yield.json
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.output import cpu_name, finish


def _progress(msg: str) -> None:
    print(f"[bench.distill_yield] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from tandem.cloud.learning import distill
    ap = argparse.ArgumentParser(prog="python -m bench.distill_yield", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=8, help="trials (traffic arriving mid-step)")
    ap.add_argument("--window", type=int, default=512, help="tokens in a training window (OnlineConfig.max_tokens)")
    ap.add_argument("--head-rows", type=int, default=distill.HEAD_ROWS, help="judged rows per head product")
    ap.add_argument("--prompt-tokens", type=int, default=400, help="the arriving session's prompt")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/distill_yield.md"))
    args = ap.parse_args(argv)

    import torch

    from tandem.cloud.learning.distill import Distiller, Round, Window, load_drafter
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    from tandem.core import logs
    from tandem.orchestrator import models
    logs.configure()
    torch.set_num_threads(args.threads)
    distill.HEAD_ROWS = args.head_rows
    engine = LlamaVerifierEngine(models.resolve(args.target, "target"), n_ctx=2048, n_threads=args.threads,
                                 max_sessions=2)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(100, 20000, args.prompt_tokens).tolist()
    _progress("loading the drafter in torch")
    d = Distiller(load_drafter(models.resolve(args.drafter, "drafter"), device="cpu"))

    def window() -> Window:
        """A window of the teacher's shape (half its rows judged, top-16 each); timing does not read its values."""
        rows = np.arange(args.window // 2, args.window - 1)
        top_lp = np.sort(rng.normal(-3, 1, (len(rows), 16)).astype(np.float32))[:, ::-1].copy()
        return Window(rng.integers(100, 20000, args.window).tolist(), rows,
                      rng.integers(100, 20000, (len(rows), 16)), top_lp)

    def prefill_ms() -> float:
        seq = engine.new_sequence()
        try:
            t0 = time.perf_counter()
            engine.prefill(seq, prompt)
            return (time.perf_counter() - t0) * 1000
        finally:
            engine.release(seq)

    prefill_ms()  # (warm)
    t0 = time.perf_counter()
    assert d.step(window())
    step_s = time.perf_counter() - t0
    _progress(f"one step alone: {step_s:.2f} s; {args.limit} trials")
    trials, failures = [], []
    for i in range(args.limit):
        idle = prefill_ms()
        before = {k: v.clone() for k, v in d.state()["lora"].items()}
        told = threading.Event()
        rnd = Round([window() for _ in range(2)], 1, 1e9, seed=i)
        trainer = threading.Thread(target=rnd.run, args=(d, told.is_set))
        trainer.start()
        time.sleep(rng.uniform(0.0, step_s))
        told.set()
        t_told = time.perf_counter()
        during = prefill_ms()  # (beside the step until it yields)
        trainer.join()
        dropped = bool(rnd.report.preempted_at_s)
        row = {"trial": i + 1, "prefill_ms_idle": round(idle, 1), "prefill_ms_during": round(during, 1),
               "prefill_ratio": round(during / idle, 4), "steps_finished_before": rnd.report.steps,
               "yield_ms": round((rnd.report.preempted_at_s[-1] - t_told) * 1000, 1) if dropped else None}
        if dropped and rnd.report.steps == 0:
            after = d.state()["lora"]
            if not all(torch.equal(v, after[k]) for k, v in before.items()):
                failures.append(f"trial {i + 1}: the dropped step changed the adapter")
        trials.append(row)
        _progress(f"trial {i + 1}: yielded after {row['yield_ms']} ms; prefill {row['prefill_ratio']:.3f}x idle")

    yields = np.array([t["yield_ms"] for t in trials if t["yield_ms"] is not None])
    ratios = np.array([t["prefill_ratio"] for t in trials])
    result = {"bench": "distill_yield", "machine": cpu_name(), "date": time.strftime("%Y-%m-%d"),
              "threads": args.threads, "window_tokens": args.window, "head_rows": args.head_rows,
              "prompt_tokens": args.prompt_tokens, "step_s_alone": round(step_s, 2),
              "batch_window_ms": 2.0,  # (cloud.scheduler.Scheduler's default window_ms, the goal's bound)
              "yield_ms_median": round(float(np.median(yields)), 1) if len(yields) else None,
              "yield_ms_p90": round(float(np.percentile(yields, 90)), 1) if len(yields) else None,
              "yield_ms_max": round(float(yields.max()), 1) if len(yields) else None,
              "prefill_ratio_median": round(float(np.median(ratios)), 4),
              "prefill_ratio_max": round(float(ratios.max()), 4),
              "trials": trials, "state_unchanged_ok": not failures, "failures": failures}
    return finish(result, args.json, _report, args.report, not failures, "; ".join(failures), "bench.distill_yield")


def _report(result: dict, path: Path) -> None:
    lines = ["# Online distillation: how promptly a training step yields to traffic", "",
             f"**Measured** {result['date']} on {result['machine']}, {result['threads']} threads: LoRA steps on "
             f"windows of {result['window_tokens']} tokens (the head {result['head_rows']} rows at a time), "
             f"{result['step_s_alone']} s a step alone; traffic arriving uniformly over a step, a "
             f"{result['prompt_tokens']}-token prefill starting at once beside it. The goal: within the scheduler's "
             f"batch window ({result['batch_window_ms']} ms).", "",
             f"Yield: median {result['yield_ms_median']} ms, p90 {result['yield_ms_p90']} ms, max "
             f"{result['yield_ms_max']} ms. Prefill beside the yielding step against idle: median "
             f"{result['prefill_ratio_median']}x, max {result['prefill_ratio_max']}x. A dropped step changed nothing: "
             f"{result['state_unchanged_ok']}.", "",
             "| trial | yield ms | prefill idle ms | prefill beside ms | ratio |", "|---|---|---|---|---|"]
    for t in result["trials"]:
        lines.append(f"| {t['trial']} | {t['yield_ms']} | {t['prefill_ms_idle']} | {t['prefill_ms_during']} | "
                     f"{t['prefill_ratio']} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
