"""What each way of decoding is worth, in closed form (Leviathan et al.; SmartSpec; vLLM's auto-tuner).

Inputs (``Physics``): the verifier's forward time t_v(n) for n tokens, the drafter's time per level of a tree of
width k, the round trip, the verifier's slowdown s while the drafter works beside it (>= 1), and acceptance by depth
alpha_d (the chance the drafter's first choice at depth d is the target's token, given the path above it held).
With k candidates a level holds with a_d(k) = 1 - (1 - alpha_d)^k, and a tree of depth D commits
E(D) = 1 + sum_{d<=D} prod_{i<=d} a_i(k) tokens per verify forward (the bonus included).

- ``plain`` (cloud-only decoding): one token per forward, streamed: 1000 / t_v(1) tokens/s, t_v(1) ms a token.
- ``rounds`` (lock-step): a round drafts D levels, crosses the link and verifies 1 + kD tokens: E(D) tokens in
  turn + D * level + RTT + t_v(1 + kD) (turn: the edge's own time from a verdict to the next drafting). Drafting
  the next tree while a verdict flies (proactive) hides it when the guess holds (every first choice and the bonus,
  h = prod_{d<=D+1} alpha_d): then only the part of D + 1 levels that outlasts the flight counts.
- ``draft`` (streamed): the verifier never waits; a tree drafted on its newest token lands r tokens later,
  r = ceil((turn + RTT + (D + 1) * level) / (s * t_v(1))), survives the r tokens decoded alone meanwhile with
  S = prod_{d<=r} a_d(k), and its remaining D - r levels commit 1 + sum_{d=r+1..D} prod_{r<i<=d} a_i(k) tokens
  in one forward. Per cycle: tokens r + S * E' + (1 - S), verifier time s * t_v(1) * r + S * t_v(1 + k(D - r)) +
  (1 - S) * s * t_v(1); its rate is their ratio (the verifier's pace is the edge's).
- ``host`` (the verifier's host drafts, cloud.host_drafting): after each verdict the host drafts a chain of D at
  h ms a level (its published pace, waiting for a free drafter included) and the verifier verifies it, with no link
  between them: E(D) tokens in D * h + t_v(1 + D). Nothing of the edge's own drafting or link counts: the mode of a
  device that cannot draft, drafts slowly or is far away. (The host picks its own depth as it goes; the price
  assumes the best one.)

Entering a drafting mode the drafter first catches up on what it has not seen (``entered``): that time passes at
cloud-only decoding's pace slowed s-fold, and is paid once, over the tokens left in the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from tandem.core.tree import TreeShape


@dataclass(frozen=True)
class Physics:
    verify_ms: Callable[[int], float]  # t_v(n): one verify forward of n tokens
    level_ms: Callable[[int], float]  # the drafter's time per level of a tree of this width
    rtt_ms: float
    slowdown: float = 1.0  # the verifier's forwards while the drafter works, over its forwards alone (>= 1)
    proactive: bool = False  # the next tree is drafted while a verdict flies
    turn_ms: float = 0.0  # the edge's own time from a verdict to its next tree's drafting (commit, catch-up)
    host_level_ms: float = 0.0  # the verifier host's drafter, ms per level (0: the verifier has none)


@dataclass(frozen=True)
class Option:
    mode: str
    shape: TreeShape | None  # what it drafts (None: nothing)
    rate: float  # committed tokens per second at the edge
    cost_ms: float  # verifier milliseconds per committed token


def holds(alpha: Sequence[float], d: int, width: int) -> float:
    """a_d(k): some of ``width`` candidates at depth ``d`` (1-based) is the target's token, the path above given."""
    a = alpha[min(d, len(alpha)) - 1]
    return 1.0 - (1.0 - a) ** width


def expected_tokens(alpha: Sequence[float], width: int, depth: int, start: int = 0) -> float:
    """1 + sum_{d=start+1..depth} prod_{start<i<=d} a_i(k): tokens one forward commits below level ``start``."""
    total, reach = 1.0, 1.0
    for d in range(start + 1, depth + 1):
        reach *= holds(alpha, d, width)
        total += reach
    return total


def plain(p: Physics) -> Option:
    t1 = p.verify_ms(1)
    return Option("plain", None, 1000.0 / t1, t1)


def lockstep(p: Physics, alpha: Sequence[float], width: int, depth: int) -> Option:
    tokens = expected_tokens(alpha, width, depth)
    forward = p.verify_ms(1 + width * depth)
    flight, draft = forward + p.rtt_ms, p.turn_ms + depth * p.level_ms(width)
    if p.proactive:
        hit = math.prod(holds(alpha, d, 1) for d in range(1, depth + 2))
        hidden = max(0.0, (depth + 1) * p.level_ms(width) - flight)
        draft = (1 - hit) * draft + hit * hidden
    return Option(
        "rounds", TreeShape(width, width * depth, depth), 1000.0 * tokens / (draft + flight), forward / tokens
    )


def hosted(p: Physics, alpha: Sequence[float], depth: int) -> Option:
    tokens = expected_tokens(alpha, 1, depth)
    forward = p.verify_ms(1 + depth)
    return Option(
        "host", TreeShape(1, depth, depth), 1000.0 * tokens / (depth * p.host_level_ms + forward), forward / tokens
    )


def late(p: Physics, width: int, depth: int) -> int:
    """r: the tokens the verifier decodes alone, the drafter working beside it, before a streamed tree lands."""
    edge = p.turn_ms + p.rtt_ms + (depth + 1) * p.level_ms(width)
    return max(1, math.ceil(edge / (p.slowdown * p.verify_ms(1)) - 1e-9))


def streamed(p: Physics, alpha: Sequence[float], width: int, depth: int) -> Option | None:
    """None when the tree lands after the verifier has decoded past all of it."""
    alone, late_ = p.slowdown * p.verify_ms(1), late(p, width, depth)  # a token decoded alone beside the drafter
    if late_ >= depth:
        return None
    survive = math.prod(holds(alpha, d, width) for d in range(1, late_ + 1))
    forward = p.verify_ms(1 + width * (depth - late_))
    tokens = late_ + survive * expected_tokens(alpha, width, depth, late_) + (1 - survive)
    ms = late_ * alone + survive * forward + (1 - survive) * alone
    return Option("draft", TreeShape(width, width * depth, depth), 1000.0 * tokens / ms, ms / tokens)


def entered(option: Option, cloud_only: Option, entry_ms: float, left_tokens: float, slowdown: float) -> float:
    """``option``'s rate over the ``left_tokens`` of a request that must first spend ``entry_ms`` catching the
    drafter up, tokens arriving meanwhile at cloud-only decoding's pace slowed ``slowdown``-fold."""
    if option.mode == "plain" or entry_ms <= 0 or left_tokens <= 0:
        return option.rate
    during = cloud_only.rate / slowdown * entry_ms / 1000.0  # tokens committed while catching up
    if during >= left_tokens:
        return cloud_only.rate / slowdown
    return left_tokens / (entry_ms / 1000.0 + (left_tokens - during) / option.rate)


def options(p: Physics, alpha: Sequence[float], widths: Sequence[int], max_depth: int) -> list[Option]:
    """Cloud-only decoding, then every tree of both drafting modes up to ``max_depth`` levels of each width, and
    the host's chains where the verifier has a host drafter."""
    trees = [(w, d) for w in widths for d in range(1, max_depth + 1)]
    drafting = [o for w, d in trees for o in (lockstep(p, alpha, w, d), streamed(p, alpha, w, d)) if o is not None]
    host = [hosted(p, alpha, d) for d in range(1, max_depth + 1)] if p.host_level_ms > 0 else []
    return [plain(p), *drafting, *host]


def choose(
    candidates: Sequence[Option], current: str, objective: str, hysteresis: float, rate: Callable[[Option], float]
) -> tuple[Option, dict[str, Option]]:
    """The fastest of ``candidates`` (cloud-only decoding among them) by ``rate`` (an entry priced in) or, under
    ``cloud_cost``, the cheapest of those predicted no slower than cloud-only decoding; a mode other than ``current``
    (cloud-only decoding, when ``current`` is out of the running) must win by the hysteresis. Returns it and each
    mode's best by the same measure."""
    if objective == "cloud_cost":
        floor = rate(next(o for o in candidates if o.mode == "plain"))
        candidates = [o for o in candidates if o.mode == "plain" or rate(o) >= floor]

    def score(o: Option) -> float:
        return rate(o) if objective == "latency" else -o.cost_ms

    best: dict[str, Option] = {}
    for o in candidates:
        if o.mode not in best or score(o) > score(best[o.mode]):
            best[o.mode] = o
    top = max(best.values(), key=score)
    held = best.get(current, best["plain"])
    if score(top) <= score(held) + hysteresis * abs(score(held)):
        return held, best
    return top, best
