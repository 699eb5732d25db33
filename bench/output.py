"""What every bench module does with its result: JSON on stdout (and at ``--json``), the Markdown report, and the
exit status that says whether its correctness check held."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from tandem.core.tree import TreeShape
from tandem.edge.planner import Round
from tandem.edge.policy import DraftPolicy
from tandem.edge.policy.closed_form import late


def cpu_name(default: str = "unknown CPU") -> str:
    """This machine's CPU model, as /proc/cpuinfo names it: every measured figure is labelled with it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), default)
    except OSError:
        return default


def finish(result: dict, json_path: Path | None, report: Callable[[dict, Path], None], report_path: Path,
           ok: bool, failure: str, tag: str) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report(result, report_path)
    print(f"[{tag}] report: {report_path}", file=sys.stderr, flush=True)
    if not ok:
        print(f"[{tag}] FAIL: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def policy_mark(policy) -> tuple[dict[str, int], int]:
    """Where a draft policy's logs stand now: the tokens each mode committed, and the decisions made."""
    return dict(policy.tokens_by_mode), policy.decisions_made


def policy_log_since(policy, mark: tuple[dict[str, int], int]) -> dict:
    """Since ``mark``: the tokens each mode committed, and the decisions made (those the policy still keeps)."""
    before, made = mark
    new = min(policy.decisions_made - made, len(policy.decisions))
    return {"tokens_by_mode": {m: n - before.get(m, 0) for m, n in policy.tokens_by_mode.items()},
            "decisions": list(policy.decisions)[len(policy.decisions) - new:] if new > 0 else []}


class ProbedPolicy(DraftPolicy):
    """The draft policy, recording for each tree it asks for the round and verify ms its closed form predicted and
    what the clock then measured (``prediction_report``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.predictions: list[tuple[float, float, float, float, str]] = []
        self._predicted: tuple[float, float, str] | None = None

    def shape(self, pending_tokens: int = 0) -> TreeShape | None:
        shape = super().shape(pending_tokens)
        if shape is not None:
            p = self.timing.physics()
            skipped = min(shape.d - 1, late(p, shape.k, shape.d)) if self.mode == "draft" else 0
            verify = p.verify_ms(1 + shape.k * (shape.d - skipped))
            self._predicted = (p.rtt_ms + verify, verify, self.mode)
        return shape

    def observe(self, r: Round) -> None:
        if not r.streamed:  # a tree's verdict
            if self._predicted is not None and len(self.predictions) < 10000:
                round_ms, verify_ms, mode = self._predicted
                self.predictions.append((round_ms, r.round_ms, verify_ms, r.verify_ms, mode))
            self._predicted = None
        super().observe(r)


def prediction_report(policy) -> dict:
    """The model against the clock: mean predicted and measured round and verify ms of the trees it sent (a
    ``ProbedPolicy``'s; none for another)."""
    rows = getattr(policy, "predictions", [])
    if not rows:
        return {}
    keys = ("round_ms_predicted", "round_ms_measured", "verify_ms_predicted", "verify_ms_measured")
    return {"trees": len(rows), **{k: round(sum(float(r[i]) for r in rows) / len(rows), 1) for i, k in enumerate(keys)}}


def policy_summary(policy) -> dict:
    """A draft policy's end-of-run state for a bench's JSON: its mode, each mode's rate as it last priced it, the
    model against the clock, and what its shadow chains saw."""
    slowdown, rates = policy.timing.slowdown, policy.last_decision().get("predicted_tokens_per_s", {})
    return {"favourite": policy.mode, "rates": {m: round(r, 2) for m, r in rates.items()},
            "prediction": prediction_report(policy),
            "interference": round(slowdown, 3) if slowdown is not None else None, "shadows": policy.shadows}


def pyplot():
    """matplotlib's pyplot on the file-only backend, or None where matplotlib is not installed (plots are extras)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
