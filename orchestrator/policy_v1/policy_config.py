"""The draft policy's knobs (``orchestrator.policy``), shared with its pricing (``orchestrator.pricing``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyConfig:
    max_depth: int = 12
    widths: tuple[int, ...] = (1, 2, 4)
    max_nodes: int = 48
    ewma: float = 0.2  # weight of a new observation
    alpha_prior: float = 0.7  # acceptance assumed at depths never observed
    forget: float = 0.05  # per tree, depths it did not reach drift back towards the prior
    phase_tokens: int = 32  # committed tokens per measured phase
    hysteresis: float = 0.05  # another mode must be this much better to take over
    explore_every: int = 4  # phases between re-measurements of the other modes ...
    explore_max: int = 64  # ... doubling up to this while they keep losing
    rate_memory: float = 0.5  # weight of the newest phase in a mode's rate (duration-weighted)
    probe_tokens: int = 8  # a probe of another mode may end after this many tokens ...
    probe_verdicts: int = 2  # ... over at least this many clocked verdicts (one lock-step tree commits up to 13)
    abort_ratio: float = 0.85  # ... when its rate so far is below this share of the favourite's
    explore_budget: float = 0.03  # the last probe's loss, as a share of the favourite's time before the next
    shadow_depth: int = 8  # in ``plain`` the idle drafter drafts chains this deep on the streamed text (0: never)
    shadow_gap: int = 2  # ... the next one this many streamed tokens after the last was scored
    overlap_samples: int = 8  # streamed forwards with the drafter working, and idle, before their ratio counts
    overlap_tolerance: float = 0.1  # verifier slowdown while the drafter works beyond which it must not overlap
    shadow_min: int = 4  # shadow chains of this request before their acceptance may skip or call a probe ...
    probe_gate: float = 0.9  # ... skip one predicted below this share of the reference rate (up to gate_skips
    gate_skips: int = 3  # times in a row), call one predicted above the favourite's by the hysteresis (once per
    #                      request and mode)
