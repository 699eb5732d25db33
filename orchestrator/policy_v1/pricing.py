"""Pricing: what each way of decoding is worth on this request's text, in tokens per second at the edge
(``rate_now``) and verifier milliseconds per token (``cost_now``): the numbers the draft policy
(``orchestrator.policy``) compares when it picks a mode, and the chain it drafts in each.

It keeps what this request has shown (``RequestEvidence``: its chains, their acceptance by depth, what each mode
measured here) beside the client-wide estimates (``costmodel.Estimates``), the modes' measured rates over the
client's life (``ModeRate``) and the cost model's calibration on this host.

**A drafting mode is judged on this request's text.** Its rate depends on acceptance (code is drafted well, chat
poorly), so a rate measured on the last request says little of this one. Every drafting phase calibrates the
cost model (measured rate / the model's at the acceptance that phase's own trees met); a mode's rate for this
request (``rate_now``) is the calibrated model at this request's acceptance (its trees and shadow chains), once
it has ``shadow_min`` chains, and the measured rate before. The policy re-decides at that point, not at the end
of the last request's favourite's phase, and from then on drafts the shape best at that acceptance (the one it
priced). A collapse calibrates the model by its window alone, as it takes the window's rate. What a mode
measured in this request (``probe_tokens`` or more) is its rate for the rest of it: the clock on this text
beats any model of it. Not a phase that closed before this request's re-check: it drafted the last request's
shapes (the code's deep chains, on a chat), so it calibrates the model but is not this text's clock; a lock-step
chain is then priced by the model, at most its replay on this request's chains. Acceptance by depth is counted
on the text's chains, each depth shrunk towards the text's pooled acceptance (deep levels are seldom tried: a
fixed prior there priced code too low and chat too high). Cloud-only decoding's rate does not depend on the
text: as measured, at most a token per one-token forward (tokens arriving in a burst read faster).

**The streamed mode is counted, not modelled.** In ``draft`` the verifier decodes without pause, as in ``plain``,
so the mode's speed-up over cloud-only decoding is the verifier time per token of the two; its trees' verdicts
give that exactly on this request's text (``draft_saved``: cloud-only decoding's forward time for the tokens
committed over the forwards' time, queue waits excluded). Before it runs here, this request's own chains
(shadows, and the first choices of lock-step trees) are replayed as streamed cycles (``costmodel.stream_cycle``)
at every chain depth, with this verifier's measured forwards and the rebase this link and drafter give each
depth (``_draft_plan``); the best depth is its rate and the chain it drafts. Being a count on this text, not
the model, it is not ruled out by a collapse: chat after code, lock-step rounds collapsed and the rule sent the
rest of the chat to cloud-only decoding where a fixed streamed chain of 4 ran 1.2x of it (2026-12-03, EPYC).

**Entering a drafting mode costs a catch-up** (``_entry_ms``). Before its first tree can go, the drafter evaluates
what it has not seen (a new prompt, cold where it was not warmed up on it, and the tokens streamed since) and
drafts that tree, while the verifier decodes alone beside it; where the drafter slows the verifier s-fold it makes
1/s of its tokens meanwhile. The loss is priced as that work (catch-up ms a token times the tokens, plus the
tree) times what measured entries lost per ms of it (``entry_ratio``: 0.4-0.6 on one host, 0.5-0.9 on shared
cores, about 0 with the drafter on its own cores).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Callable

from tandem.core.tree import TreeShape

from .costmodel import (
    Estimates,
    Plan,
    expected_tokens,
    hit_chance,
    lockstep_plans,
    pipelined_value,
    round_ms,
    streamed_plan,
)
from .policy_config import PolicyConfig


@dataclass
class ModeRate:
    tokens_per_s: float = 0.0
    verifier_ms_per_token: float = 0.0
    measured_ms: float = 0.0  # phase time behind the estimate

    def add(self, tokens_per_s: float, verifier_ms_per_token: float, ms: float, weight: float) -> None:
        """A phase of ``ms`` measured these: moved towards them by ``weight`` (1.0: replaced)."""
        self.tokens_per_s += weight * (tokens_per_s - self.tokens_per_s)
        self.verifier_ms_per_token += weight * (verifier_ms_per_token - self.verifier_ms_per_token)
        self.measured_ms += ms


@dataclass
class RequestEvidence:
    """What the current request has shown; a new request starts a new one."""

    chains: int = 0  # chains scored (shadows, and trees verified)
    # their first choices at each depth: [tried, accepted]
    tries: list[list[int]] = field(default_factory=list)
    # the same chains as (depth, leading nodes that were the target's tokens), rebased levels included: what the
    # streamed mode would have made of this text (``ModePricing._draft_plan``)
    runs: list[tuple[int, int]] = field(default_factory=list)
    draft_account: tuple[int, float, int] = (0, 0.0, 0)  # verdicts in ``draft``: tokens, verifier forward ms, trees
    rates: dict[str, list[float]] = field(default_factory=dict)  # per mode: [tokens, ms, verifier ms] of its phases
    ran: dict[str, int] = field(default_factory=dict)  # per mode: tokens it committed, its phases all
    collapsed: bool = False  # a drafting mode collapsed
    rechecked: bool = False  # the re-decision on this request's own chains was made
    called: set[str] = field(default_factory=set)  # modes probed because its shadow chains predicted a win


def count_chain(tries: list[list[int]], base: int, depth: int, accepted: int) -> None:
    """Count into ``tries`` (per depth: [tried, accepted]) a chain below ``base`` rebased levels whose first
    ``accepted`` of ``depth`` first choices held: level base + d + 1 was tried iff the chain held up to base + d."""
    for d in range(base, base + min(depth, accepted + 1)):
        while len(tries) <= d:
            tries.append([0, 0])
        tries[d][0] += 1
        tries[d][1] += accepted > d - base


def pooled_acceptance(tries: list[list[int]], prior: float) -> float:
    """All depths' hits over all their tries, with the prior as one pseudo-observation."""
    hits, tried = sum(h for _, h in tries), sum(t for t, _ in tries)
    return (hits + prior) / (tried + 1)


def alpha_by_depth(tries: list[list[int]], prior: float) -> list[float]:
    """Acceptance by depth from counts, each depth shrunk towards the text's pooled acceptance by one
    pseudo-observation. Deep levels are tried least, so the prior sets them: a fixed 0.7 there priced code's deep
    chains (all held) too low and chat's (which fail) too high, the model's error then growing with the gap between
    the texts, which no one calibration factor absorbs (code's rounds ran 1.3-1.5x the model, chat's 0.6-0.9x)."""
    pooled = pooled_acceptance(tries, prior)
    return [(hit + pooled) / (tried + 1) for tried, hit in tries]


class ModePricing:
    """The prices of the modes (``plain``, ``draft``, ``rounds``: see ``orchestrator.policy``) for the current
    request. Its state is the evidence; ``DraftPolicy`` feeds it and decides on what it says."""

    def __init__(self, config: PolicyConfig, estimates: Estimates, objective: str, modes: tuple[str, ...]):
        self.config = config
        self.objective = objective
        self.est = estimates
        self.modes = modes
        self.rates = {m: ModeRate() for m in modes}  # measured, duration-weighted over the client's phases
        self.calibration: dict[str, float] = {}  # per mode: measured rate / the model's at the acceptance seen
        self.req = RequestEvidence()
        self._speculates = False  # the client drafts ahead while verdicts are in flight (seen: a free tree)
        self._observed = 0  # observations so far (a plan, asked several times a verdict, is kept until the next)
        self._plans: dict[str, tuple[int, Plan | None]] = {}
        # entering a drafting mode (``_entry_ms``): committed tokens the drafter had not evaluated at the last
        # verdict, what entries lost against cloud-only decoding (running), and that over the drafter's work
        self._pending = 0
        self.entry_loss_ms: float | None = None
        self.entry_ratio: float | None = None

    def _entry_ms(self, mode: str = "rounds") -> float | None:
        """What entering drafting ``mode`` now would lose: the drafter's work before its first tree can go (its
        catch-up on the tokens it has not evaluated, ``Round.pending``: a new prompt's whole length unless it warmed
        up on it, at its measured ms a token; then that tree's drafting), times what an entry lost per ms of that
        work (``entry_ratio``). Before any entry, where the drafter is measured to slow the verifier s-fold,
        1 - 1/s (the verifier makes 1/s of its tokens meanwhile); unmeasured, the last entries' loss as it was.
        A flat price misled: a 313 ms entry on a 13-token catch-up priced a cold 150-token prompt's, which lost
        620, and a client stayed in lock-step rounds at 0.90x of cloud-only decoding (shared cores, 2026-12-04)."""
        ratio = self.entry_ratio
        if ratio is None and not self.overlap_ok and (slowdown := self.interference):
            ratio = 1 - 1 / slowdown
        if ratio is None or not self.est.catch_up_n:
            return self.entry_loss_ms
        shape = self.best_shape(mode, est=self._request_est())
        first_tree_ms = shape.d * self.est.draft_level_ms(shape.k) if shape is not None else 0.0
        return ratio * self._entry_work_ms(self._pending, first_tree_ms)

    def _entry_work_ms(self, pending: int, first_tree_ms: float) -> float:
        """The drafter's work on entering a drafting mode: catching up on ``pending`` tokens, then its first tree."""
        return self.est.catch_up_ms_per_token * pending + first_tree_ms

    def _cloud_only_rate(self) -> float:
        """Cloud-only decoding's rate now (0 where it is not a mode)."""
        return self.rate_now("plain") if "plain" in self.rates else 0.0

    @property
    def interference(self) -> float | None:
        """How much slower the verifier decodes while the drafter works (1.0: not at all; a drafter on the
        verifier's cores, or on cores sharing their caches and memory, slows it); None before enough samples."""
        e, n = self.est, self.config.overlap_samples
        if len(e.solo_ms) < n or len(e.overlap_ms) < n:
            return None
        solo = statistics.median(e.solo_ms)  # medians: a shared host's forwards jitter by +-15 %
        return statistics.median(e.overlap_ms) / solo if solo > 0 else None

    @property
    def overlap_ok(self) -> bool:
        """Whether the drafter may work while the verifier does (proactive drafting, shadow chains): not where
        that measurably slows the verifier. Unmeasured counts as free (a client on its own device)."""
        slowdown = self.interference
        return slowdown is None or slowdown <= 1 + self.config.overlap_tolerance

    def _request_est(self) -> Estimates:
        """The estimates at this request's own acceptance, from its first chain on (before any, the prior's), so
        the tree drafted is the one ``rate_now`` priced. (With the client-wide running acceptance, a chat after code
        drafted deeper trees than its acceptance calls for, losing at half of cloud-only's rate, while the rate it
        was judged by was that of the shallower best shape; and until its own chains sufficed, it drafted the
        code's 12-level chains, which failed at a token or two each and collapsed the mode, 2026-12-03.)"""
        return self._est_at(self.req.tries)

    def _est_at(self, tries: list[list[int]]) -> Estimates:
        """The estimates with the acceptance counted in ``tries`` in place of the client-wide running one."""
        return replace(self.est, alpha=alpha_by_depth(tries, self.config.alpha_prior))

    def _t1_ms(self) -> float | None:
        """Cloud-only decoding's verifier time per token: the median one-token forward with the drafter idle."""
        solo = self._solo_t1_ms()
        return solo if solo is not None else self.est.verify_ms_at.get(1)

    def _solo_t1_ms(self) -> float | None:
        """The same from forwards timed with the drafter idle only, else None: what bounds cloud-only decoding's
        rate and cost. Every one-token forward's mean is no bound: a cloud-cost client, which streams alone only to
        probe, had only forwards the drafter slowed, 110 ms where they take 33 on shared cores; it capped cloud-only
        decoding at 9 tokens/s against the 22 it measured and took lock-step rounds at 10-17 for as fast
        (2026-12-03)."""
        solo = self.est.solo_ms
        return statistics.median(solo) if solo else None

    def _draft_plan(self) -> Plan | None:
        """The streamed mode on this request's text: the request's own chains (shadows and trees) replayed as
        streamed cycles at every depth (``costmodel.streamed_plan``); None before ``shadow_min`` chains. A count of
        what happened on this text, not a model of acceptance by depth (which priced chat's streamed trees below
        cloud-only decoding, where a fixed chain of 4 ran 1.2x of it)."""
        return self._kept_plan("draft", self._replay_streamed)

    def _rounds_plan(self) -> Plan | None:
        """Lock-step rounds on this request's text: (tokens/s, the chain that makes it, its verifier ms per token),
        from the same chains replayed as lock-step rounds (``lockstep_cycle``: drafting, round trip, forward; for a
        proactive client a guess that held hides the drafting) at every depth whose forward is at most one token
        past the largest measured; None before ``shadow_min`` chains. It picks the chain drafted (which the
        calibrated model then prices: the round's timing has more to it than the replay knows, a drafter's
        catch-up, a guess's timing): from acceptance by depth the model had chosen trees of 10-14 nodes on chat at
        wan (2026-12-03), where a fixed chain of 3 ran at cloud-only decoding's rate for 0.63x of its verifier time.

        The objective picks the depth: ``latency`` the fastest replay; ``cloud_cost`` the least verifier time per
        token among the depths the calibrated model prices at least as fast as cloud-only decoding (within the
        hysteresis; the fastest if none is): a deeper chain costs fewer forwards per token while its acceptance
        holds, and more drafting per round."""
        return self._kept_plan("rounds", self._replay_lockstep)

    def _kept_plan(self, mode: str, replay: Callable[[], Plan | None]) -> Plan | None:
        """A plan of ``mode``, replayed once per observation (it is asked several times a verdict)."""
        kept = self._plans.get(mode)
        if kept is None or kept[0] != self._observed:
            kept = self._plans[mode] = (self._observed, replay())
        return kept[1]

    def _replay_inputs(self) -> tuple[float, float, int] | None:
        """(t1 ms, the text's acceptance of a first choice, the largest forward measured), or None before
        ``shadow_min`` chains of this request."""
        t1 = self._t1_ms()
        if t1 is None or len(self.req.runs) < self.config.shadow_min:
            return None
        return t1, pooled_acceptance(self.req.tries, self.config.alpha_prior), max(self.est.verify_ms_at, default=1)

    def _replay_streamed(self) -> Plan | None:
        inputs = self._replay_inputs()
        if inputs is None:
            return None
        t1, hold, largest = inputs
        runs, depth, slowdown = self.req.runs, self.config.max_depth, self.interference or 1.0
        return streamed_plan(self.est, runs, t1, hold, largest, depth, slowdown)

    def _replay_lockstep(self) -> Plan | None:
        inputs = self._replay_inputs()
        if inputs is None:
            return None
        t1, hold, largest = inputs
        c, guessed = self.config, self._speculates and self.overlap_ok
        plans = lockstep_plans(self.est, self.req.runs, hold, largest, c.max_depth, guessed)
        if not plans:
            return None
        fastest = max(plans, key=lambda p: (p.value, -p.verifier_ms_per_token))
        if self.objective == "latency":
            return fastest
        # what ``rate_now`` will say of each chain: the calibrated model at this text's acceptance, at most its replay
        at, floor = self._est_at(self.req.tries), (self._cloud_only_rate() or 1000 / t1) * (1 - c.hysteresis)
        calibration = self.calibration.get("rounds", 1.0)

        def priced(p: Plan) -> float:
            assert p.shape is not None
            k, d = p.shape.k, p.shape.d
            return min(calibration * self._round_rate(at, k, d, d), p.value)

        fast_enough = [p for p in plans if priced(p) >= floor]
        return min(fast_enough, key=lambda p: p.verifier_ms_per_token) if fast_enough else fastest

    def draft_saved(self) -> float | None:
        """What the streamed mode's own trees saved on this request's text, once it verified 2 * ``shadow_min``
        of them: cloud-only decoding's verifier time for the tokens it committed over the time it took. In both
        modes the verifier decodes without pause, so this is the ratio of their rates, on this text, free of the
        wall clock's noise (a tree commits a burst of tokens, then none: a 16-token window of chat read anywhere
        from 0.8x to 2x of cloud-only decoding); None before."""
        tokens, ms, trees = self.req.draft_account
        t1 = self._t1_ms()
        if trees < 2 * self.config.shadow_min or ms <= 0 or t1 is None:
            return None
        return tokens * t1 / ms

    def draft_speedup(self) -> float | None:
        """The streamed mode's speed-up over cloud-only decoding on this request's text: what its trees saved
        (``draft_saved``), else what its chains say they would (``_draft_plan``); None before either."""
        saved = self.draft_saved()
        if saved is not None:
            return saved
        tokens, _, trees = self.req.draft_account
        if tokens >= self.config.phase_tokens:  # it ran a phase here and verified too few trees to count (all
            return None  # dead, or its drafter full): its clock says what it does
        plan = self._draft_plan()
        return plan[0] if plan is not None else None

    def _counted_draft_rate(self) -> float | None:
        """The streamed mode's rate on this text: cloud-only decoding's times ``draft_speedup``; None before either."""
        plain, speedup = self._plain_rate(), self.draft_speedup()
        return None if plain is None or speedup is None else plain * speedup

    def _plain_rate(self) -> float | None:
        """Cloud-only decoding's rate, as measured but at most a token per one-token forward: tokens that arrive in
        a burst (decoded during the prefill or a drafter's catch-up) read 8.4-15 tokens/s where the forward takes
        140 ms (7.1). Every rate built on it (``draft`` is this times its speed-up) takes the cap too: uncapped, it
        priced the streamed mode up to 18 % high (2026-12-03). None before a phase of it."""
        plain = self.rates.get("plain")
        if plain is None or not plain.measured_ms:
            return None
        t1 = self._solo_t1_ms()
        return min(plain.tokens_per_s, 1000 / t1) if t1 else plain.tokens_per_s

    def predicted_rate(self, mode: str) -> float | None:
        """Tokens/s expected of ``mode`` now, with acceptance measured on this request's own text by its shadow
        chains; None without ``shadow_min`` of them (or without a measured rate of ``plain`` to build on for
        ``draft``). ``draft``: cloud-only decoding's rate times the speed-up its chains replayed give
        (``_draft_plan``); ``rounds``: the cost model's, calibrated, of the chain drafted (``_rounds_plan``), but
        no more than that chain's replay on this text's chains: one calibration factor cannot hold for every
        shape and text (code's deep chains ran 1.1-1.3x the model, and that factor priced chat's chains of 3-4 at
        11 tokens/s against the 7.8 their replay gave; they ran at 4.2-8.3, 2026-12-03 EPYC)."""
        if mode == "draft":
            plain, plan = self._plain_rate(), self._draft_plan()
            return None if plain is None or plan is None else plain * plan[0]
        if self.req.chains < self.config.shadow_min:
            return None
        raw = self._model_rate(mode, self.req.tries)
        if raw is None or mode == "plain":
            return raw
        priced = raw * self.calibration.get(mode, 1.0)  # what the model missed on this host so far
        plan = self._rounds_plan() if mode == "rounds" else None
        return min(priced, plan.value) if plan is not None else priced

    def _model_rate(
        self, mode: str, tries: list[list[int]], shapes: list[tuple[int, int, int]] | None = None
    ) -> float | None:
        """The cost model's rate of ``mode`` at the acceptance counted in ``tries`` (uncalibrated): of the best
        shape there, or for ``rounds`` of the trees in ``shapes`` (what a phase ran, to calibrate the model by)."""
        plain_rate = self._plain_rate()
        if mode == "plain":
            return plain_rate
        c = self.config
        # acceptance by depth on this request's text alone (the client's running estimate still remembers the last
        # request's, e.g. code before this chat)
        e = self._est_at(tries)
        if mode == "rounds" and shapes:
            tokens = sum(expected_tokens(e.alpha, k, d, c.alpha_prior) for k, d, _ in shapes)
            return 1000 * tokens / sum(self._round_ms(e, k, d, n) for k, d, n in shapes)
        plan = self._rounds_plan() if mode == "rounds" else None
        shape = plan[1] if plan is not None else self.best_shape(mode, est=e)  # the shape drafted is the one priced
        if mode == "rounds":
            if shape is None:
                return None
            raw = self._round_rate(e, shape.k, shape.d, shape.n)
        elif plain_rate is None:
            return None
        else:  # the verifier streams as in plain (slowed by a working drafter), and each tree saves ``value``
            # verifier milliseconds per millisecond of the cycle: (1 + value) times the tokens
            value = pipelined_value(e, shape.k, shape.d, shape.n, c.alpha_prior) if shape is not None else 0.0
            raw = plain_rate * (1 + max(0.0, value)) / (self.interference or 1.0)
        return raw

    def rate_now(self, mode: str) -> float:
        """A mode's rate for this request. ``plain`` (cloud-only decoding) does not depend on the text: as
        measured. A drafting mode's does, through acceptance:

        - what it measured in this request, once it ran ``probe_tokens`` here (the clock on this text beats any
          model of it);
        - none (0) after a drafting mode collapsed in this request, for one that has not run here: the collapse
          is this text's acceptance falling, which the model, built on the same chains, priced too high already;
        - else the model's rate at this request's acceptance times its calibration (what the clock gave against
          the model, on every phase of that mode), once this request has ``shadow_min`` chains;
        - else as measured (on an earlier request), but no more than the uncalibrated model says of this request
          (a chat after code: the pipelined mode's code rate, 2x cloud-only decoding's, was held against the chat
          while its phases had been too short to calibrate the model). An uncalibrated model may lower a rate, not
          raise it: it calls probes, but a mode becomes the favourite on the clock.

        So the rate ``rounds`` measured on code is not held against a chat, and the reverse. ``draft`` is the
        exception: cloud-only decoding's rate times ``draft_speedup`` (what its trees saved on this text, or what
        its chains say they would), ahead of its clock and ruled out by no collapse (the verifier never waits for
        a streamed tree, so a probe of it costs at most the verify time of the trees its account then shows were
        not worth it). But where the drafter is measured to slow the verifier (not ``overlap_ok``), no more than
        its clock: the count takes the verifier's forwards alone, and beside a working drafter on the same cores
        the verifier also loses time between them. There the count priced the mode at 1.4-1.65x cloud-only
        decoding, request after request, where it ran at 0.9-1.0x (one host, 2026-12-03)."""
        if mode == "draft" and (counted := self._counted_draft_rate()) is not None:
            clock = self.rates["draft"]
            if not self.overlap_ok and clock.measured_ms:  # the drafter slows the verifier: no more than its clock
                return min(counted, clock.tokens_per_s)
            return counted
        if mode != "plain":
            tokens, ms, _ = self.req.rates.get(mode, (0, 0.0, 0.0))
            if tokens >= self.config.probe_tokens and ms > 0:
                return 1000 * tokens / ms
            if self._ruled_out(mode):
                return 0.0
            predicted = self.predicted_rate(mode)
            if predicted is not None and (mode == "draft" or mode in self.calibration):
                return predicted
        if mode == "plain":
            return self._plain_rate() or 0.0
        rate = self.rates[mode]
        measured = rate.tokens_per_s if rate.measured_ms else 0.0
        return measured if predicted is None else min(measured, predicted)

    def cost_now(self, mode: str) -> float:
        """A mode's verifier milliseconds per committed token for this request (what ``cloud_cost`` minimises).
        Like a drafting mode's rate, it depends on the text (code's chains hold, chat's fail), so it is not the
        client's running average, which remembers the last request: the cloud-cost policy kept streaming trees on
        code, at 0.55-0.64x of cloud-only decoding's verifier time, because its rounds were last measured on a
        chat (2026-12-03, EPYC), where a fixed lock-step chain of 3 cost 0.42x. So:

        - ``plain``: its one-token forward (or as measured, if more: its text does not matter);
        - ``draft``: that forward over ``draft_speedup`` (the verifier decodes without pause, so its time per token
          is the edge's);
        - ``rounds``: what its rounds cost here once they ran ``probe_tokens``, else its plan's (each replayed
          round one forward of its chain);
        - else as measured on earlier requests."""
        t1 = self._t1_ms()
        if mode == "plain":  # a forward a token: a phase read below it had tokens arrive in a burst (decoded in
            measured, solo = self.rates[mode].verifier_ms_per_token, self._solo_t1_ms()  # the prefill or a catch-up;
            return max(measured, solo) if solo is not None else measured  # read at 65 ms a token, it took cloud-only
            #                                                               decoding for the cheapest)
        if mode == "draft" and t1 is not None:
            speedup = self.draft_speedup()
            if speedup:
                return t1 / speedup
        if mode == "rounds":
            tokens, _, verify_ms = self.req.rates.get(mode, (0, 0.0, 0.0))
            if tokens >= self.config.probe_tokens:
                return verify_ms / tokens
            plan = self._rounds_plan()
            if plan is not None:
                return plan.verifier_ms_per_token
        return self.rates[mode].verifier_ms_per_token

    def _ruled_out(self, mode: str) -> bool:
        """A drafting mode not to run again in this request: a drafting mode collapsed here, and this one has not
        run here since. (A chat after code: once the favourite collapsed, the model still priced the other
        drafting mode above cloud-only decoding, on calibration from the code, and each probe of it lost again.)"""
        if not self.req.collapsed or mode == "plain" or (mode == "draft" and self._draft_plan() is not None):
            return False  # (the streamed mode's plan is a count of this text's chains, not the model)
        return self.req.ran.get(mode, 0) < self.config.probe_tokens

    def _round_ms(self, e: Estimates, width: int, depth: int, nodes: int) -> float:
        """A lock-step round as this client runs it: with its guessed trees, once it showed it speculates (a tree
        drafted while a verdict was in flight) and while the drafter may work alongside the verifier. (Without:
        code's rounds beat the model by a third, hits hiding the drafting, and that calibration carried into the
        chat after it, whose trees rarely guess right.)"""
        hit = hit_chance(e, depth, self.config.alpha_prior) if self._speculates and self.overlap_ok else 0.0
        return round_ms(e, width, depth, nodes, hit)

    def _round_rate(self, e: Estimates, width: int, depth: int, nodes: int) -> float:
        """The model's tokens/s of lock-step rounds of a tree (width, depth, nodes) at the estimates ``e``."""
        return (
            1000
            * expected_tokens(e.alpha, width, depth, self.config.alpha_prior)
            / self._round_ms(e, width, depth, nodes)
        )

    def best_shape(self, mode: str, est: Estimates | None = None) -> TreeShape | None:
        """The cost model's best shape for ``mode`` at the estimates ``est`` (default: the client-wide ones): the
        most tokens per millisecond of a round (``rounds``), the most verifier time saved per millisecond of the
        edge's cycle (``draft``; None where no tree saves any)."""
        c, e = self.config, est or self.est
        best, best_value = None, 0.0
        for width in c.widths:
            for depth in range(1, c.max_depth + 1):
                nodes = min(c.max_nodes, width * depth)
                if nodes < depth:
                    break
                if mode == "rounds":
                    value = self._round_rate(e, width, depth, nodes)
                else:
                    value = pipelined_value(e, width, depth, nodes, c.alpha_prior)
                if value > best_value * (1 + 1e-9):
                    best, best_value = TreeShape(width, nodes, depth), value
        if mode != "rounds" and best_value <= 0:
            best = None
        return best
