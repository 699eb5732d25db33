"""The cost model of drafting: what a tree, a lock-step round and a streamed tree cost and commit, from
online estimates of this link, this drafter and this verifier (``Estimates``, which learns them from the verdicts
the policy is fed: ``learn_verdict``). Pure functions over ``Estimates``; the draft policy
(``orchestrator.policy``) chooses modes by measurement and shapes by these.

**Tree shape, chosen by a cost model**, from online estimates (exponential moving averages): verify time by
token count, drafter time per level by width, round-trip time, acceptance ``alpha[d]`` of the drafter's first
choice at depth d given its parent was accepted, and ``rebase``: tokens the verifier decodes alone between the
edge's newest token and the tree's arrival. For width k the chance that depth d is reached and accepted is
prod_{i<=d} a_i(k), a_i(k) = 1 - (1 - alpha_i)^k (k tries: an approximation). In ``draft`` mode a tree of depth D
arriving r tokens late survives with prod_{i<=r} a_i(k) and then adds E = sum_{d=r+1..D} prod_{r<i<=d} a_i(k)
tokens, for an extra verify(1 + nodes) - verify(1) of verifier time; its value is the verifier time it saves,
E * verify(1) - extra, per millisecond of the edge's cycle (drafting + round trip + verify). In ``rounds`` mode a
round takes draft + verify + RTT and commits 1 + sum_{d<=D} prod_{i<=d} a_i(k): the shape maximising tokens per
millisecond. A proactive client (seen: a tree that cost no drafting) drafts the next tree while a verdict flies, on
the guess that every first choice and the bonus hold, h = prod_{d<=D+1} alpha_d; a held guess leaves only the
drafting of its D + 1 levels that outlasted the flight (verify + RTT), so a round takes
(1 - h) * draft + h * max(0, draft(D + 1) - flight) + flight. (Unmodelled, code's held guesses made its rounds a
third faster than the model, and the calibration that taught carried into the chat after it.)

**Plans, counted on a text's chains.** The streamed and lock-step modes are also priced by replaying a request's
own chains (``runs``: each chain's depth and how many of its leading first choices were the target's tokens) as
cycles of either mode at every depth (``streamed_plan``, ``lockstep_plans``): a count of what happened on this
text, not a model of acceptance by depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, NamedTuple

from tandem.core.tree import TreeShape
from tandem.edge.planner import Round

OVERLAP_WINDOW = 16  # one-token forwards kept per kind (drafter idle / working) for the interference estimate


def moved(old: float | None, new: float, weight: float) -> float:
    """A running estimate after one more observation: ``new`` if there was none, else moved towards it by
    ``weight`` (1.0: replaced)."""
    return new if old is None else old + weight * (new - old)


@dataclass
class Estimates:
    rtt_ms: float = 20.0
    rtt_n: int = 0  # round trips observed
    catch_up_ms_per_token: float = 2.0  # drafter evaluating committed tokens it has not seen (batched)
    catch_up_n: int = 0
    rebase: float = 1.0  # tokens decoded alone between the edge's newest token and a tree's arrival
    # priors of the cost lines, used until measurements exist
    draft_base_ms: float = 10.0
    draft_node_ms: float = 10.0
    verify_base_ms: float = 20.0
    verify_token_ms: float = 5.0
    alpha: list[float] = field(default_factory=list)  # index d-1
    alpha_n: list[int] = field(default_factory=list)  # observations behind each alpha
    # measurements: EWMA of verify time per exact token count, and of draft time per level per tree width
    verify_ms_at: dict[int, float] = field(default_factory=dict)
    draft_level_ms_at: dict[int, float] = field(default_factory=dict)
    # the latest one-token forwards of the verifier decoding alone, with the drafter idle and working meanwhile
    solo_ms: list[float] = field(default_factory=list)
    overlap_ms: list[float] = field(default_factory=list)

    def verify_ms(self, tokens: int) -> float:
        """Measured time at this token count, else a least-squares line through the measured points (with the
        prior slope when only one point exists), else the prior line."""
        pts = self.verify_ms_at
        if tokens in pts:
            return pts[tokens]
        if len(pts) >= 2:
            n = len(pts)
            mx, my = sum(pts) / n, sum(pts.values()) / n
            sxx = sum((x - mx) ** 2 for x in pts)
            slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts.items()) / sxx)
            return max(0.0, my + slope * (tokens - mx))
        if len(pts) == 1:
            ((x, y),) = pts.items()
            return max(0.0, y + self.verify_token_ms * (tokens - x))
        return self.verify_base_ms + self.verify_token_ms * tokens

    def draft_level_ms(self, width: int) -> float:
        """Measured time per drafted level at this width, else scaled from the nearest measured width along the
        prior line, else the prior."""
        prior = self.draft_base_ms + self.draft_node_ms * width
        if width in self.draft_level_ms_at:
            return self.draft_level_ms_at[width]
        if self.draft_level_ms_at:
            w = min(self.draft_level_ms_at, key=lambda x: (abs(x - width), x))
            return self.draft_level_ms_at[w] * prior / (self.draft_base_ms + self.draft_node_ms * w)
        return prior

    def learn_verdict(self, r: Round, ewma: float, forget: float, prior: float) -> None:
        """What a verdict shows of this verifier, link and drafter: the forward's time at its token count (its
        compute, not its queue wait: a streamed tree waits out a token's forward), a one-token forward's with the
        drafter idle or working, and of a tree's round its round trip, its rebase, the drafting per level and the
        acceptance of its first choices. ``ewma``: the weight of a new observation."""
        tokens = 1 + r.nodes
        self.verify_ms_at[tokens] = moved(self.verify_ms_at.get(tokens), r.compute_ms, ewma)
        if r.streamed:
            if not r.first and r.forward_tokens == 1:  # a one-token forward, drafter working or idle meanwhile
                window = self.overlap_ms if r.overlapped else self.solo_ms
                window.append(r.verify_ms)
                del window[:-OVERLAP_WINDOW]
            return
        # a running mean (the prior counting as one sample) until the EWMA weight takes over
        self.rtt_n += 1
        self.rtt_ms += max(ewma, 1.0 / (self.rtt_n + 1)) * (max(0.0, r.round_ms - r.verify_ms) - self.rtt_ms)
        self.rebase += ewma * (r.rebased - self.rebase)  # stale trees too: how far the verifier had gone alone
        if r.depth and r.draft_ms > 0:  # 0 = the tree was drafted while waiting (proactive): no cost seen
            self.learn_draft_level(max(1, r.width), r.draft_ms / max(1, r.depth + r.rebased), ewma)
        if not r.stale:
            self.learn_alpha(r.rebased, r.depth, r.chain_accepted, ewma, forget, prior)

    def learn_draft_level(self, width: int, per_level_ms: float, ewma: float) -> None:
        self.draft_level_ms_at[width] = moved(self.draft_level_ms_at.get(width), per_level_ms, ewma)

    def learn_catch_up(self, tokens: int, ms: float, ewma: float) -> None:
        """The drafter evaluated ``tokens`` committed tokens it had not seen in ``ms``."""
        self.catch_up_n += 1  # the first measurement replaces the prior (a guess that can be far off)
        self.catch_up_ms_per_token += max(ewma, 1.0 / self.catch_up_n) * (ms / tokens - self.catch_up_ms_per_token)

    def learn_alpha(self, base: int, depth: int, chain_accepted: int, ewma: float, forget: float, prior: float) -> None:
        """A chain below ``base`` rebased levels, ``depth`` verified levels, of which the first ``chain_accepted``
        first-ranked children were accepted: the first-ranked child at depth d was tried iff the chain survived to
        d - 1. Depths it did not reach drift back towards ``prior`` by ``forget`` (old evidence fades)."""
        tried = min(depth, chain_accepted + 1)
        self.alpha_n.extend([0] * (len(self.alpha) - len(self.alpha_n)))  # estimates given as a prior: no counts
        for d in range(base + 1, base + tried + 1):
            while len(self.alpha) < d:
                self.alpha.append(self.alpha[-1] if self.alpha else prior)
                self.alpha_n.append(0)
            hit = 1.0 if chain_accepted >= d - base else 0.0
            self.alpha_n[d - 1] += 1
            self.alpha[d - 1] += max(ewma, 1.0 / (self.alpha_n[d - 1] + 1)) * (hit - self.alpha[d - 1])
        for d in range(base + tried, len(self.alpha)):
            self.alpha[d] += forget * (prior - self.alpha[d])

    def a(self, d: int, width: int, prior: float) -> float:
        """Chance that some of ``width`` candidates at depth d (1-based) is accepted, given its parent was."""
        alpha = self.alpha[d - 1] if d <= len(self.alpha) else (self.alpha[-1] if self.alpha else prior)
        return 1.0 - (1.0 - alpha) ** width


def expected_tokens(alpha: list[float], width: int, depth: int, prior: float) -> float:
    """Committed tokens of one round of a tree (width, depth): 1 + sum_d prod_{i<=d} a_i. Depths never observed
    take the deepest observed estimate (acceptance varies slowly with depth), or the prior before any."""
    est = Estimates(alpha=list(alpha))
    total, reach = 1.0, 1.0
    for d in range(1, depth + 1):
        reach *= est.a(d, width, prior)
        total += reach
    return total


def hit_chance(est: Estimates, depth: int, prior: float) -> float:
    """Chance that a proactive client's guess of a chain's verdict holds: every first choice accepted, and the
    bonus token its next first choice, prod_{d <= depth + 1} alpha_d."""
    chance = 1.0
    for d in range(1, depth + 2):
        chance *= est.a(d, 1, prior)
    return chance


def round_ms(est: Estimates, width: int, depth: int, nodes: int, hit: float = 0.0) -> float:
    """A lock-step round (``rounds`` mode): draft, verify, round trip. ``hit``: the chance that the tree was drafted
    while the last verdict was in flight (a proactive client whose guess held): then its depth + 1 levels took
    only what outlasted that flight."""
    draft = depth * est.draft_level_ms(width) if depth else 0.0
    flight = est.verify_ms(1 + nodes) + est.rtt_ms
    hidden = max(0.0, (depth + 1) * est.draft_level_ms(width) - flight) if depth else 0.0
    return (1 - hit) * draft + hit * hidden + flight


def pipelined_value(est: Estimates, width: int, depth: int, nodes: int, prior: float) -> float:
    """``draft`` mode: verifier milliseconds a tree saves per millisecond of the edge's cycle (see the module
    docstring); <= 0 when it does not pay."""
    r = min(depth - 1, max(0, round(est.rebase)))
    survive = 1.0
    for d in range(1, r + 1):
        survive *= est.a(d, width, prior)
    gain, reach = 0.0, 1.0
    for d in range(r + 1, depth + 1):
        reach *= est.a(d, width, prior)
        gain += reach
    verified = max(1, round(nodes * (depth - r) / depth))
    t1 = est.verify_ms(1)
    saved = survive * (gain * t1 - (est.verify_ms(1 + verified) - t1))
    cycle = depth * est.draft_level_ms(width) + est.rtt_ms + est.verify_ms(1 + verified)
    return saved / cycle


def stream_cycle(est: Estimates, matched: int, depth: int, rebase: int, t1_ms: float) -> tuple[int, float]:
    """One cycle of the streamed ``draft`` mode, for a greedy chain of ``depth`` whose first ``matched`` nodes are
    the target's tokens, arriving when the verifier has decoded ``rebase`` tokens alone since the chain's base:
    (tokens committed, verifier ms). The rebased tokens take ``t1_ms`` each (cloud-only decoding's token); the chain
    survives iff ``matched >= rebase`` with nodes left below, and then one forward of its 1 + depth - rebase
    remaining tokens commits the accepted ones and the bonus; else the verifier decodes one more token alone (a
    stale tree costs nothing extra)."""
    left = depth - rebase
    if matched >= rebase and left > 0:
        return rebase + 1 + min(matched - rebase, left), rebase * t1_ms + est.verify_ms(1 + left)
    return rebase + 1, (rebase + 1) * t1_ms


def stream_speedup(cycles: list[tuple[float, float]], t1_ms: float) -> float:
    """Cloud-only decoding's verifier time for the tokens of ``cycles`` over theirs: the streamed mode's speed-up
    on that text (the verifier decodes without pause in both, so its time per token sets the edge's rate)."""
    tokens, ms = sum(t for t, _ in cycles), sum(m for _, m in cycles)
    return tokens * t1_ms / ms if ms > 0 else 1.0


def lockstep_cycle(est: Estimates, matched: int, depth: int, guessed: bool) -> tuple[float, float]:
    """One lock-step round of a greedy chain of ``depth`` whose first ``matched`` nodes are the target's tokens:
    (tokens committed, ms of the round). It commits the held nodes and the bonus; it takes the drafting of its
    levels, the round trip and the verify forward, except for a proactive client (``guessed``) whose guess held
    (every node and the drafter's next first choice, ``matched > depth``): then its ``depth + 1`` levels were
    drafted during the last verdict's flight and only what outlasted it counts (``round_ms`` with hit = 1)."""
    hit = 1.0 if guessed and matched > depth else 0.0
    return 1 + min(matched, depth), round_ms(est, 1, depth, depth, hit)


def replayed_cycle(
    run: tuple[int, int], depth: int, hold: float, cycle: Callable[[int], tuple[float, float]]
) -> tuple[float, float]:
    """The ``cycle`` (a function of how many first choices held) of a recorded chain ``run`` = (its depth, leading
    nodes that were the target's tokens) replayed as a chain of ``depth``, whose round may look one level past it
    (a proactive guess). A run that failed within its depth says how far any chain there holds. One that held to
    its end says nothing of the levels below it: they are taken to hold with probability ``hold`` each (the
    text's acceptance), in expectation over how far (a shorter replay would price a deeper chain at the cost of
    the shallower one, a longer one would credit it with acceptance never seen)."""
    own, matched = run
    horizon = depth + 1
    if matched < own or own >= horizon:
        return cycle(min(matched, horizon))
    tokens = ms = 0.0
    reach = 1.0  # chance the run holds own + k levels
    for k in range(horizon - own + 1):
        p = reach * (1.0 - hold) if k < horizon - own else reach
        t, m = cycle(own + k)
        tokens, ms, reach = tokens + p * t, ms + p * m, reach * hold
    return tokens, ms


class Plan(NamedTuple):
    """A drafting mode on a text, from its chains replayed: ``value`` (the streamed mode: its speed-up over
    cloud-only decoding; lock-step rounds: tokens/s, uncalibrated), the chain it drafts (None: none pays), and the
    verifier milliseconds per committed token it costs."""

    value: float
    shape: TreeShape | None
    verifier_ms_per_token: float


def streamed_plan(
    est: Estimates,
    runs: list[tuple[int, int]],
    t1_ms: float,
    hold: float,
    largest: int,
    max_depth: int,
    slowdown: float = 1.0,
) -> Plan:
    """The streamed mode on the text of ``runs``: the chain depth whose streamed cycles (``stream_cycle``) save
    the most verifier time, with this verifier's measured forwards (``t1_ms``: its one-token forward with the
    drafter idle; ``slowdown``: how much slower while it works); (1.0, None, t1) where no chain pays.

    A chain of depth d drafted on the newest token arrives a round trip and d + 1 drafted levels (the bonus's
    catch-up, then the chain) after the verifier began its next token, and waits for the forward in progress: it
    is rebased by ceil((rtt + (d + 1) * level) / t1) tokens, at least 1. Only chains whose forward is at most one
    token larger than the ``largest`` measured are priced: a forward's cost is extrapolated no further than that
    (on the Xeon curve a line through 1 and 4 tokens priced 8 at 357 ms, not 442, and chat drafted chains of 8
    that lost), so the chains drafted grow a level at a time, each size measured. ``hold``: the text's acceptance
    of a first choice, for the levels below a chain that held to its end (``replayed_cycle``)."""
    t1_working = t1_ms * slowdown  # the tokens decoded alone meanwhile, with the drafter busy
    best = Plan(1.0, None, t1_ms)
    for d in range(1, max_depth + 1):
        rebase = max(1, math.ceil((est.rtt_ms + (d + 1) * est.draft_level_ms(1)) / t1_working - 1e-9))
        if 1 + d - rebase > largest + 1:
            continue
        cycles = [
            replayed_cycle(run, d, hold, partial(stream_cycle, est, depth=d, rebase=rebase, t1_ms=t1_working))
            for run in runs
        ]
        speedup = stream_speedup(cycles, t1_ms)
        if speedup > best.value * (1 + 1e-9):
            best = Plan(speedup, TreeShape(1, d, d), t1_ms / speedup)
    return best


def lockstep_plans(
    est: Estimates, runs: list[tuple[int, int]], hold: float, largest: int, max_depth: int, guessed: bool
) -> list[Plan]:
    """Lock-step rounds on the text of ``runs``, one plan per chain depth whose forward is at most one token past
    the ``largest`` measured: the replayed rounds' (``lockstep_cycle``) tokens/s and verifier ms per token (each
    round one forward of its chain and base token). ``guessed``: a proactive client, whose held guesses hide the
    drafting."""
    plans = []
    for d in range(1, min(max_depth, largest) + 1):
        cycles = [replayed_cycle(run, d, hold, partial(lockstep_cycle, est, depth=d, guessed=guessed)) for run in runs]
        tokens, ms = sum(t for t, _ in cycles), sum(m for _, m in cycles)
        if ms > 0 and tokens > 0:
            plans.append(Plan(1000 * tokens / ms, TreeShape(1, d, d), len(cycles) * est.verify_ms(1 + d) / tokens))
    return plans
