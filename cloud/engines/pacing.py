"""Simulated verifier regimes: real logits, forward wall time paced to a cost curve.

A cost curve (JSON, deploy/cost-curves/) maps the tokens in one verify forward to milliseconds. ``PacedEngine``
wraps a real engine: every forward computes real logits, then waits until its wall time reaches the curve's time
for its token count (times ``scale``). Pacing can only slow a forward down, so to show a GPU regime on a CPU the
whole run is slowed by the same factor ``scale`` (the link and the drafter too, see ``bench.network
--verifier-cost``): ratios between methods are then those of the simulated regime. Results are labelled as
simulated wherever they are reported.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, cast

from .engine import ChunkedPrefillEngine, PrefillChunk, TreeJob, VerifierEngine


@dataclass(frozen=True)
class CostCurve:
    name: str
    tokens: tuple[int, ...]
    ms: tuple[float, ...]
    label: str = "measured"  # "measured" here, or "public" (from cited measurements)
    source: str = ""

    @classmethod
    def load(cls, path: str | Path) -> "CostCurve":
        d = json.loads(Path(path).read_text())
        pts = sorted(zip(d["tokens"], d["ms"]))
        if not pts or any(n < 1 or ms <= 0 for n, ms in pts):
            raise ValueError(f"{path}: a cost curve needs token counts >= 1 with positive times")
        return cls(d.get("name", Path(path).stem), tuple(n for n, _ in pts), tuple(ms for _, ms in pts),
                   d.get("label", "measured"), d.get("source", ""))

    def __call__(self, tokens: int) -> float:
        """Milliseconds for a forward of ``tokens`` tokens: linear between points, the last slope beyond."""
        xs, ys = self.tokens, self.ms
        if tokens <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if tokens <= x1:
                return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        if len(xs) == 1:
            return ys[0]
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (tokens - xs[-1])


class PacedEngine:
    """A ``VerifierEngine`` whose forwards take the curve's time (x ``scale``), never less than their real time:
    verify forwards by their tokens, a prompt computed whole (``prefill``) as forwards of the engine's batch size,
    prompt chunks inside verify forwards (``forward_mixed``) as part of theirs. Cache operations pass through."""

    def __init__(self, inner: VerifierEngine, curve: CostCurve, scale: float = 1.0):
        self.inner, self.curve, self.scale = inner, curve, scale
        self.late_ms = 0.0  # total time forwards took beyond the curve (the simulation's error)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward_tree(self, seq, root_token, tree):
        return self.forward_batch([TreeJob(seq, root_token, tree)])[0]

    def prefill(self, seq, tokens: Sequence[int], *args, **kwargs):
        batch = max(1, self.inner.max_batch_tokens)
        chunks = [min(batch, len(tokens) - lo) for lo in range(0, len(tokens), batch)]
        t0 = time.perf_counter()
        out = self.inner.prefill(seq, tokens, *args, **kwargs)
        reused = out or 0  # (what a prefix cache gave costs nothing)
        target = sum(self.curve(n) for n in chunks) * self.scale / 1000 * (1 - reused / max(1, len(tokens)))
        elapsed = time.perf_counter() - t0
        if elapsed < target:
            time.sleep(target - elapsed)
        return out

    def forward_batch(self, jobs: Sequence[TreeJob]):
        return self._paced(lambda: self.inner.forward_batch(jobs), sum(j.n_tokens for j in jobs))

    def forward_mixed(self, jobs: Sequence[TreeJob], chunks: Sequence[PrefillChunk]):
        inner = cast(ChunkedPrefillEngine, self.inner)  # (called only where the inner engine has it)
        return self._paced(lambda: inner.forward_mixed(jobs, chunks),
                           sum(j.n_tokens for j in jobs) + sum(len(c.tokens) for c in chunks))

    def _paced(self, forward, tokens: int):
        t0 = time.perf_counter()
        out = forward()
        target = self.curve(tokens) * self.scale / 1000
        elapsed = time.perf_counter() - t0
        if elapsed < target:
            time.sleep(target - elapsed)
        else:
            self.late_ms += (elapsed - target) * 1000
        return out
