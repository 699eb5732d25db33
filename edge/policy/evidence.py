"""What the draft policy learns, kept apart by whose it is. ``Timing`` is the machine's (verifier, link, drafter).
``Acceptance`` is one request's text, shrunk towards its partition's ``Prior`` (earlier requests of the same caller),
so a pooled gateway client never carries one caller's text into another's request."""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from tandem.edge.planner import Round

from .closed_form import Physics

CATCH_UP_MIN = 8  # a shorter catch-up is dominated by a fixed per-call cost, not the per-token rate
PARTITIONS_KEPT = 1024  # callers whose priors a pooled client remembers (least recently seen go first)
LEVEL_PRIOR_MS = 15.0  # a drafter's time per level of a chain, assumed until measured


def moved(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


class VerifierCurve:
    """t_v(n): each measured size's running mean; between measured sizes the least-squares line through them; past
    the largest, the verifier's own fitted cost per token where it publishes one (``published_ms``: it has seen
    forwards of many sizes, other sessions' included), else that line's slope but at least t_v(1) / 3 a token (a
    GPU's flat curve is learnt as measured: trees grow a step at a time instead of being priced on a line never seen
    there)."""

    def __init__(self, t1_prior_ms: float = 25.0):
        self.t1_prior_ms = t1_prior_ms
        self.at: dict[int, float] = {}

    def observe(self, tokens: int, ms: float, weight: float) -> None:
        self.at[tokens] = moved(self.at.get(tokens), ms, weight)

    def _line(self) -> tuple[float, float]:
        pts = self.at
        t1 = pts.get(1, min(pts.values(), default=self.t1_prior_ms))
        if len(pts) < 2:  # one size seen: the line through it, at t_v(1) / 3 a token
            return t1 - t1 / 3 * next(iter(pts), 1), t1 / 3
        mx, my = sum(pts) / len(pts), sum(pts.values()) / len(pts)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts.items()) / sum((x - mx) ** 2 for x in pts))
        return my - slope * mx, slope

    def __call__(self, tokens: int, published_ms: float = 0.0) -> float:
        if tokens in self.at:
            return self.at[tokens]
        fixed, slope = self._line()
        largest = max(self.at, default=1)
        if tokens <= largest:
            return max(1e-3, fixed + slope * tokens)
        t1 = self.at.get(1, fixed + slope)
        step = published_ms if published_ms > 0 else max(slope, t1 / 3)
        return max(1e-3, fixed + slope * largest) + step * (tokens - largest)


@dataclass
class Timing:
    ewma: float = 0.2
    rtt_ms: float = 20.0  # prior until a tree's round is seen
    rtt_n: int = 0
    level_ms_at: dict[int, float] = field(default_factory=dict)  # drafter ms per level, by tree width
    catch_up_ms: float = 2.0  # drafter ms per committed token it had not seen
    turn_ms: float = 0.0  # the edge's time from a lock-step verdict to its next tree's drafting
    proactive: bool = False  # a tree came back that cost no drafting: drafted while a verdict flew
    samples: int = 8  # one-token forwards per window before the slowdown is measured
    solo: deque = field(default_factory=lambda: deque(maxlen=16))  # one-token forwards, drafter idle ...
    overlap: deque = field(default_factory=lambda: deque(maxlen=16))  # ... and working
    verify: VerifierCurve = field(default_factory=VerifierCurve)
    price_ms: float = 0.0  # the verifier's price of a token in its next forward (0: not published)
    sessions: int = 1  # the sessions that shared its last forward
    token_budget: int = 0  # the most tokens a tree should hold (0: any)
    host_level_ms: float = 0.0  # the verifier host's drafter, ms per level as it publishes it (0: unmeasured) ...
    host_offered: bool = False  # ... where the verifier has one

    def observe(self, r: Round) -> None:
        if not r.overlapped:  # the forward's own time (the drafter's toll on it is ``slowdown``)
            self.verify.observe(r.forward_tokens, r.compute_ms, self.ewma)
        if r.streamed:
            if not r.first and r.forward_tokens == 1:
                (self.overlap if r.overlapped else self.solo).append(r.verify_ms)
            return
        self.rtt_n += 1  # a running mean until the EWMA weight takes over (the prior counts as one round)
        self.rtt_ms += max(self.ewma, 1 / (self.rtt_n + 1)) * (max(0.0, r.round_ms - r.verify_ms) - self.rtt_ms)
        if r.depth and r.draft_ms > 0:
            self.learn_level(max(1, r.width), r.draft_ms / (r.depth + r.rebased))
        elif r.depth and not r.stale:
            self.proactive = True
        if not r.rebased and not r.stale and not r.first and r.draft_ms > 0:  # a lock-step round: verdict to verdict
            self.turn_ms = moved(self.turn_ms, max(0.0, r.gap_ms - r.round_ms - r.draft_ms), self.ewma)

    def learn_level(self, width: int, ms: float) -> None:
        self.level_ms_at[width] = moved(self.level_ms_at.get(width), ms, self.ewma)

    def learn_catch_up(self, tokens: int, ms: float) -> None:
        if tokens >= CATCH_UP_MIN:
            self.catch_up_ms = moved(self.catch_up_ms, ms / tokens, self.ewma)

    def level_ms(self, width: int) -> float:
        """Measured at this width, else the nearest measured width's scaled by width (a level evaluates k nodes;
        a batch of k costs less than k ones: half a level per extra node), else a prior of 15 ms a level."""
        w = min(self.level_ms_at, key=lambda x: (abs(x - width), x), default=None)
        if w is None or w == width:
            return self.level_ms_at.get(width, LEVEL_PRIOR_MS * (1 + 0.5 * (width - 1)))
        return self.level_ms_at[w] * (1 + 0.5 * (width - 1)) / (1 + 0.5 * (w - 1))

    @property
    def slowdown(self) -> float | None:
        """Median one-token forward, the drafter working over it idle (None until each seen ``samples`` times)."""
        if min(len(self.solo), len(self.overlap)) < self.samples:
            return None
        return statistics.median(self.overlap) / statistics.median(self.solo)

    def observe_host(self, level_ms: float | None) -> None:
        """The verifier has a host drafter for this session, which drafts a level in ``level_ms`` (0: not measured
        yet; the edge's own prior of a level stands in until it is); None: none for this session (the verifier has
        none, or every seat of its host is taken)."""
        self.host_offered = level_ms is not None
        if level_ms:
            self.host_level_ms = level_ms

    def observe_price(self, marginal_ms: float, sessions: int, token_budget: int) -> None:
        self.price_ms, self.sessions, self.token_budget = marginal_ms, max(1, sessions), token_budget

    def verify_ms(self, tokens: int) -> float:
        """t_v(n) as this session should price it: its measured forward, and, when the verifier publishes its
        price under load, each token past the root charged the delay it puts on the other sessions of the forward
        too (what the forward becomes if every session drafts alike: docs/drafting.md, "The price of a draft
        token"). Alone on the verifier this is the measured curve."""
        own = self.verify(tokens, self.price_ms)
        return own + self.price_ms * (self.sessions - 1) * max(0, tokens - 1)

    def physics(self) -> Physics:
        slowdown = max(1.0, self.slowdown or 1.0)
        host = (self.host_level_ms or LEVEL_PRIOR_MS) if self.host_offered else 0.0
        return Physics(self.verify_ms, self.level_ms, self.rtt_ms, slowdown, self.proactive, self.turn_ms, host)


@dataclass
class Acceptance:
    """One text's first choices by depth: tried, and held (the target's token), each earlier chain's counts worth
    ``memory`` times the next one's (a text changes as it goes: a chat's opening is drafted well, its body not)."""

    memory: float = 0.9
    tries: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)
    chains: int = 0

    def count(self, depth: int, held: int) -> None:
        """A chain of ``depth`` levels verified, the first ``held`` of them the target's tokens: level d + 1 was
        tried iff the chain held to d."""
        tried = min(depth, held + 1)
        pad = [0.0] * max(0, tried - len(self.tries))  # (the two lists are always as long)
        self.tries = [t * self.memory + (d < tried) for d, t in enumerate(self.tries + pad)]
        self.hits = [h * self.memory + (d < min(tried, held)) for d, h in enumerate(self.hits + pad)]
        self.chains += 1

    def alpha(self, prior: float, shrink: float, depth: int) -> list[float]:
        """Acceptance at depths 1..``depth``, shrunk twice by ``shrink`` pseudo-tries: each depth towards this
        text's pooled acceptance (deep levels are seldom tried: the text's own level sets them, not a fixed
        number), and the pooled acceptance towards ``prior`` (the partition's, from its earlier texts)."""
        pool = (sum(self.hits) + shrink * prior) / (sum(self.tries) + shrink)
        counts = list(zip(self.tries, self.hits)) + [(0, 0)] * max(0, depth - len(self.tries))
        return [(held + shrink * pool) / (tried + shrink) for tried, held in counts[:depth]]


@dataclass
class Prior:
    """A partition's pooled acceptance and request length, over its finished requests."""

    alpha: float | None = None
    request_tokens: float | None = None

    def learn(self, text: Acceptance, tokens: int, weight: float) -> None:
        if sum(text.tries):
            self.alpha = moved(self.alpha, sum(text.hits) / sum(text.tries), weight)
        if tokens:
            self.request_tokens = moved(self.request_tokens, tokens, weight)


def prior_of(priors: OrderedDict[str, Prior], partition: str) -> Prior:
    """``partition``'s prior, the least recently used forgotten past ``PARTITIONS_KEPT``."""
    priors[partition] = priors.pop(partition) if partition in priors else Prior()
    while len(priors) > PARTITIONS_KEPT:
        priors.popitem(last=False)
    return priors[partition]
