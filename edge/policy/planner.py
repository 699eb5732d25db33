"""The draft policy: at each request's start and every ``decide_tokens`` committed tokens, price every mode and tree
in closed form (``closed_form``) on what this client measured (``evidence``), and run the best. One rule overrides
the prices: a drafting mode whose last ``guard_tokens`` ran below ``guard_ratio`` of cloud-only decoding's predicted
rate by the clock is left for cloud-only decoding for the rest of the request. In cloud-only decoding the idle
drafter drafts *shadow* chains on the streamed text, never sent, scored against the tokens that follow: the text's
acceptance at no cloud cost. Each decision is one debug line (``tandem.policy``) with every mode's predicted rate and
its inputs. Pure: no clock, no I/O; its inputs are the verdicts and timings the round loop feeds it."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

from tandem.core.tree import TreeShape
from tandem.edge.planner import Round

from . import closed_form as cf
from .evidence import CATCH_UP_MIN, Acceptance, Timing, prior_of

log = logging.getLogger("tandem.policy")
# cloud-only decoding; trees beside the verifier's own run; lock-step rounds; chains the verifier's host drafts
MODES = ("plain", "draft", "rounds", "host")
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


class DraftPolicy:
    stream_first = True  # whatever the mode: the first token never waits for a tree

    def __init__(
        self, config: PolicyConfig = PolicyConfig(), objective: str = "latency", modes: tuple[str, ...] = MODES
    ):
        """``modes``: the drafting modes it may choose (cloud-only decoding is always there to fall back to)."""
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if not set(modes) <= set(MODES):
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {modes!r}")
        self.config, self.objective, self.modes = config, objective, {"plain", *modes}
        self.timing = Timing(ewma=config.ewma, samples=config.overlap_samples)
        self.priors: OrderedDict = OrderedDict()  # partition -> its Prior
        self.mode = "plain"  # the mode in force ...
        self.plan: cf.Option | None = None  # ... and its option (what it drafts)
        self.tokens_by_mode = dict.fromkeys(MODES, 0)
        self.decisions: deque[dict] = deque(maxlen=1024)  # the last decisions' log lines
        self.decisions_made = self.shadows = 0
        self._shadow_gap = config.shadow_gap
        self._prior, self._text = prior_of(self.priors, ""), Acceptance(config.chain_memory)
        self._tokens = self._since = self._pending = 0
        self._banned = False  # the guard sent this request to cloud-only decoding
        self._clock: deque[tuple[int, float]] = deque(maxlen=64)  # the drafting mode's verdicts: tokens, ms

    def new_request(self, partition: str = "") -> None:
        """A request of ``partition`` begins: the last one's acceptance and length join its partition's prior."""
        self._prior.learn(self._text, self._tokens, self.config.prior_weight)
        self._prior, self._text = prior_of(self.priors, partition), Acceptance(self.config.chain_memory)
        self._tokens = self._since = 0
        self._banned = False

    @property
    def stream(self) -> bool:
        return self.mode != "rounds"

    @property
    def host(self) -> bool:
        """The verifier's host drafts (the edge's drafter rests)."""
        return self.mode == "host"

    @property
    def overlap_ok(self) -> bool:
        slowdown = self.timing.slowdown
        return slowdown is None or slowdown <= 1 + self.config.overlap_tolerance

    @property
    def drafts(self) -> bool:
        """Warm the drafter up on a prompt beside the prefill: in a drafting mode, once measured not to slow it."""
        return self.mode not in ("plain", "host") and self.timing.slowdown is not None and self.overlap_ok

    def shape(self, pending_tokens: int = 0) -> TreeShape | None:
        return self.plan.shape if self.mode not in ("plain", "host") and self.plan is not None else None

    peek = shape

    def shadow(self, pending_tokens: int = 0) -> TreeShape | None:
        c = self.config  # (the verifier's pace with the drafter idle comes first: any slowdown is judged by it)
        ready = len(self.timing.solo) >= c.overlap_samples and self.overlap_ok and self._shadow_gap >= c.shadow_gap
        on = self.mode == "plain" and c.shadow_depth and ready
        return TreeShape(1, c.shadow_depth, c.shadow_depth) if on else None

    def observe_shadow(self, depth: int, accepted: int, draft_ms: float) -> None:
        self.shadows += 1
        self._shadow_gap = 0
        self._text.count(depth, accepted)
        if depth and draft_ms > 0:
            self.timing.learn_level(1, draft_ms / depth)
        if self._text.chains == self.config.recheck_chains:
            self._decide("recheck")

    def observe_catch_up(self, tokens: int, ms: float, waited: bool = False) -> None:
        self.timing.learn_catch_up(tokens, ms)

    def observe_price(self, marginal_ms: float, sessions: int, token_budget: int) -> None:
        self.timing.observe_price(marginal_ms, sessions, token_budget)

    def observe_host(self, level_ms: float | None, drafted: int, accepted: int) -> None:
        """The verifier's host drafter: its pace (None: no host for this session), and a chain of ``drafted`` it
        drafted of which the target took ``accepted`` (this text's acceptance, where the host's drafter is the
        edge's model)."""
        self.timing.observe_host(level_ms)
        if drafted:
            self._text.count(drafted, accepted)

    def observe(self, r: Round) -> None:
        self.timing.observe(r)
        self._pending, self._shadow_gap = r.pending, self._shadow_gap + r.streamed
        self.tokens_by_mode[self.mode] += r.tokens
        self._tokens, self._since = self._tokens + r.tokens, self._since + r.tokens
        if self.mode != "plain" and not r.first and not (self.mode == "rounds" and r.streamed):
            self._clock.append((r.tokens, r.gap_ms))  # (lock-step's streamed tokens: its entry, not its pace)
        chains = self._text.chains
        if not r.streamed and r.tried_levels:  # a tree's first choices from its root, rebased levels included
            self._text.count(r.tried_levels, r.held_levels)
        recheck = chains < self.config.recheck_chains <= self._text.chains  # its own text's first say
        if r.first or recheck or self._since >= self.config.decide_tokens:
            self._decide("request" if r.first else "recheck" if recheck else "window")
        elif self._guard_trips():
            self._banned = True
            self._decide("guard")

    def _guard_trips(self) -> bool:
        tokens, ms, verdicts = 0, 0.0, 0
        for t, m in reversed(self._clock):
            tokens, ms, verdicts = tokens + t, ms + m, verdicts + 1
            if tokens >= self.config.guard_tokens:
                break
        if self.mode == "plain" or tokens < self.config.guard_tokens or verdicts < 2 or ms <= 0:
            return False
        return 1000 * tokens / ms < self.config.guard_ratio * cf.plain(self.timing.physics()).rate

    def _decide(self, kind: str) -> None:
        c, p = self.config, self.timing.physics()
        self._since, prior = 0, self._prior.alpha
        alpha = self._text.alpha(c.alpha_prior if prior is None else prior, c.shrink, c.max_depth + 1)
        found = [
            o
            for o in cf.options(p, alpha, c.widths, c.max_depth)
            if o.mode in self.modes
            and (o.shape is None or not self.timing.token_budget or o.shape.n + 1 <= self.timing.token_budget)
        ]
        found = found[:1] if self._banned else found
        if self.objective == "cloud_cost" and self._text.chains < c.recheck_chains:
            # "not slower than cloud-only" must hold on this text's own chains: a lock-step round the text cannot
            # feed is slower, while a streamed one keeps the verifier decoding meanwhile
            found = [o for o in found if o.mode != "rounds"]
        cold = self.mode == "plain" or self._pending >= CATCH_UP_MIN  # the drafter must first catch up
        incumbent = "plain" if kind == "request" and self._pending >= CATCH_UP_MIN else self.mode
        left = max(c.decide_tokens, (self._prior.request_tokens or c.request_tokens) - self._tokens)

        def entry_ms(o: cf.Option) -> float:
            if not cold or o.shape is None or o.mode == "host":  # (the host catches up on its own)
                return 0.0
            return self._pending * self.timing.catch_up_ms + o.shape.d * self.timing.level_ms(o.shape.k)

        def rate(o: cf.Option) -> float:
            return cf.entered(o, found[0], entry_ms(o), left, p.slowdown)

        chosen, best = cf.choose(found, incumbent, self.objective, c.hysteresis, rate)
        self._log(kind, chosen, best, rate, entry_ms, alpha, left)
        if chosen.mode != self.mode:
            self._clock.clear()
        self.mode, self.plan = chosen.mode, chosen

    def last_decision(self) -> dict:
        """The last decision in brief, for a generation's statistics (the full line is in ``decisions``)."""
        if not self.decisions:
            return {}
        d = self.decisions[-1]
        rates = {m: v["rate"] for m, v in d["modes"].items()}
        return dict(mode=d["chose"], shape=d["shape"], rtt_ms=d["inputs"]["rtt_ms"], predicted_tokens_per_s=rates)

    def _log(self, kind, chosen, best, rate, entry_ms, alpha, left) -> None:
        """One line: each mode's best option priced, and every input behind the prices."""
        t, r3 = self.timing, lambda x: round(x, 3)
        modes = {m: {"rate": r3(rate(o)), "cost_ms": r3(o.cost_ms), "shape": o.shape and str(o.shape),
                     "entry_ms": r3(entry_ms(o))} for m, o in best.items()}  # fmt: skip
        inputs = {"t1_ms": r3(t.verify(1)), "rtt_ms": r3(t.rtt_ms), "level_ms": r3(t.level_ms(1)),
                  "turn_ms": r3(t.turn_ms), "catch_up_ms": r3(t.catch_up_ms), "slowdown": t.slowdown and r3(t.slowdown),
                  "pending": self._pending, "left": round(left), "chains": self._text.chains,
                  "proactive": t.proactive, "alpha": [r3(a) for a in alpha[:8]]}  # fmt: skip
        line = {"kind": kind, "tokens": self._tokens, "was": self.mode, "chose": chosen.mode, "modes": modes,
                "inputs": inputs, "shape": chosen.shape and str(chosen.shape)}  # fmt: skip
        self.decisions.append(line)
        self.decisions_made += 1
        log.debug("decision %s", json.dumps(line))
