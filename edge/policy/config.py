"""The draft policy's settings."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("plain", "draft", "rounds")  # cloud-only decoding; trees beside the verifier's own run; lock-step rounds
OBJECTIVES = ("latency", "cloud_cost")


@dataclass(frozen=True)
class PolicyConfig:
    max_depth: int = 12  # deepest chain or tree drafted
    widths: tuple[int, ...] = (1, 2)  # candidates per level of the trees priced (1: chains)
    hysteresis: float = 0.05  # another mode must be this much better (faster, or cheaper) to take over
    decide_tokens: int = 32  # committed tokens between decisions within a request (and one at its start) ...
    recheck_chains: int = 4  # ... and one when this many of the request's own chains were scored
    guard_tokens: int = 16  # a drafting mode's clock over at least this many tokens ...
    guard_ratio: float = 0.85  # ... below this share of cloud-only decoding's predicted rate: cloud-only instead
    alpha_prior: float = 0.7  # acceptance of a first choice assumed before any chain was scored
    shrink: float = 2.0  # pseudo-tries of the client's prior behind each depth's acceptance on a request
    chain_memory: float = 0.9  # weight of a request's earlier chains against its next one
    prior_weight: float = 0.3  # weight of a finished request in its partition's prior (acceptance, length)
    request_tokens: float = 128.0  # a request's length assumed before one finished (prices an entry)
    ewma: float = 0.2  # weight of a new observation of a link, drafter or verifier time
    shadow_depth: int = 8  # cloud-only decoding: the idle drafter drafts chains this deep on the streamed text ...
    shadow_gap: int = 2  # ... one this many streamed tokens after the last was scored (0 depth: never)
    overlap_samples: int = 8  # one-token forwards, drafter working and idle, before their ratio counts
    overlap_tolerance: float = 0.1  # verifier slowdown with the drafter working past which they must not overlap
