"""Draft policy: which way of decoding is fastest (or cheapest) on this link, and which tree to draft in it.

A pure library the edge client runs (it implements ``edge.planner.Planner``); deterministic given the
observations it is fed. Two layers:

**Modes, chosen by measurement.** ``plain``: the verifier decodes alone and streams every token (cloud-only
decoding). ``draft``: the verifier still decodes alone, and the edge's trees, drafted in parallel, are rebased onto
its tokens and add accepted tokens on top (wins when drafter and verifier run on different hardware). ``rounds``:
the verifier waits for each tree, so every forward verifies one (fewest verifier forwards; and the fastest when
drafter and verifier share cores, since the two never compete). The
policy runs the modes in phases of ``phase_tokens`` committed tokens and keeps, per mode, a duration-weighted
average of the measured rate (committed tokens per second at the edge). It stays with the best mode and switches
only when another is better by ``hysteresis``; the other modes are re-measured one phase at a time, at intervals
that double (``explore_every`` up to ``explore_max``) while they keep losing.

Exploring costs the user time: a phase of a mode slower than the favourite loses
tokens * (1/rate - 1/favourite rate). The rules that bound that loss:

- Start safe. The latency objective measures ``plain`` (cloud-only decoding) first, so a new client's first
  tokens are never slower than cloud-only, and the drafter does not warm up on a prompt (``drafts``) unless a
  drafting mode is the favourite (on shared cores that warm-up slows the verifier's prefill).
- Cut clear losers. A probe below ``abort_ratio`` of the favourite's rate after ``probe_tokens`` ends at once;
  its rate so far is what it measured.
- Budget the next look. The next probe waits until the favourite has run long enough that the last probes' loss
  is at most ``explore_budget`` of the time (1 s lost at 3 % waits 33 s); probes in a row add up.
- Notice a change. A favourite whose last 2 * ``probe_tokens`` tokens fall below ``abort_ratio`` of another mode's
  last rate (the workload changed, code to chat say) ends its phase and takes that window's rate as its own (not
  blended with what it measured on the old workload). A drafting favourite's fall is the drafter's acceptance
  falling, which moves every drafting mode: their rates are scaled down by the same factor, while cloud-only
  decoding's does not depend on acceptance; so a collapse falls back to ``plain`` rather than onto another
  drafting mode measured on the old workload, and no drafting mode that has not run in this request runs in the
  rest of it (the cost model, built on the same chains, priced them too high already); the next request's
  probes find drafting again. A phase also ends with its request, so every request is judged from its own
  start.
- Judge a drafting mode on this request's text. Its rate depends on acceptance (code is drafted well, chat
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
- Count the streamed mode, do not model it. In ``draft`` the verifier decodes without pause, as in ``plain``,
  so the mode's speed-up over cloud-only decoding is the verifier time per token of the two; its trees' verdicts
  give that exactly on this request's text (``draft_saved``: cloud-only decoding's forward time for the tokens
  committed over the forwards' time, queue waits excluded). Before it runs here, this request's own chains
  (shadows, and the first choices of lock-step trees) are replayed as streamed cycles (``costmodel.stream_cycle``)
  at every chain depth, with this verifier's measured forwards and the rebase this link and drafter give each
  depth (``_draft_plan``); the best depth is its rate and the chain it drafts. Being a count on this text, not
  the model, it is not ruled out by a collapse: chat after code, lock-step rounds collapsed and the rule sent the
  rest of the chat to cloud-only decoding where a fixed streamed chain of 4 ran 1.2x of it (2026-12-03, EPYC).
- Charge a mode its own cost. In ``rounds``, a cold drafter's catch-up on the history that the verifier waited for
  is not charged to the mode (in steady state it overlaps the prefill).
- Learn from the idle drafter. In ``plain`` the drafter drafts *shadow* chains on the streamed text, never sent,
  and each is scored against the tokens that stream in after it: this request's own acceptance, at no cloud cost.
  With ``shadow_min`` of them, the cost model predicts each drafting mode's rate (times its ``calibration``, the
  measured / predicted rate of its past probes on this host): a probe predicted below ``probe_gate`` of the
  reference is skipped (counted as lost, ``gate_skips`` times in a row at most, so a mispredicting model cannot
  lock a mode out), and a mode predicted to beat the favourite by the hysteresis is probed at the next phase end,
  whatever the wait (once per request: code after chat is drafted within its first phases).
- Never work alongside a verifier it slows. A drafter on the verifier's cores, or on cores sharing their caches
  and memory bandwidth, makes every token the verifier decodes meanwhile dearer. One-token forwards are timed
  with the drafter idle and working (``interference``, median against median: a shared host's forwards jitter by
  +-15 %); above ``overlap_tolerance`` the drafter stops shadowing and proactive drafting stops, and no longer
  warms up on a prompt alongside the prefill, so none of them costs the user. A drafter on its own device measures
  ~1.0 and keeps all three. The shadows run before that was measured are charged to them, not to cloud-only
  decoding: a plain phase takes the tokens decoded beside them at the idle pace (``_plain_clock``). Until it is
  measured, the streamed mode's chains replayed (forwards as timed alone) are checked against its clock.
  Predictions use this request's shadow acceptance alone (the running estimate still remembers the last request's
  text, say code before this chat).

So where drafting always loses (drafter and verifier on shared cores) a client stays within a few percent of
cloud-only decoding even on short requests. Objective ``latency`` takes the
fastest mode; ``cloud_cost`` the one with the least verifier time per token on this request's text (``cost_now``;
rounds draft the cheapest chain priced as fast) among those at least as fast as ``plain`` (within ``hysteresis``).
A cost model mispredicting (as it did: it priced a verify by the model's line, while the verifier was also decoding
alone, and on shared cores the drafter slows the verifier) cannot make Tandem slower than cloud-only decoding for
more than an exploration phase.

**Tree shape, chosen by the cost model** (``orchestrator.costmodel``): the shape with the most verifier time saved
per millisecond of the edge's cycle (``draft``), or the most tokens per millisecond of a round (``rounds``).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from tandem.core.tree import TreeShape
from tandem.edge.planner import Round

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

MODES = ("draft", "plain", "rounds")
DECISIONS_KEPT = 1024  # latest decisions a policy keeps (a phase's end or a re-check each: ~5 a 96-token request)
OBJECTIVES = ("latency", "cloud_cost")


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


@dataclass
class _ModeRate:
    tokens_per_s: float = 0.0
    verifier_ms_per_token: float = 0.0
    measured_ms: float = 0.0  # phase time behind the estimate

    def add(self, tokens_per_s: float, verifier_ms_per_token: float, ms: float, weight: float) -> None:
        """A phase of ``ms`` measured these: moved towards them by ``weight`` (1.0: replaced)."""
        self.tokens_per_s += weight * (tokens_per_s - self.tokens_per_s)
        self.verifier_ms_per_token += weight * (verifier_ms_per_token - self.verifier_ms_per_token)
        self.measured_ms += ms


class DraftPolicy:
    def __init__(
        self,
        config: PolicyConfig = PolicyConfig(),
        estimates: Estimates | None = None,
        objective: str = "latency",
        modes: tuple[str, ...] | None = None,
    ):
        """``modes``: the modes it may use, in the order it measures them first (default: all; the latency
        objective starts safe, with cloud-only decoding, the cloud-cost one where it expects to end)."""
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if modes is not None and (not modes or len(set(modes)) != len(modes) or not set(modes) <= set(MODES)):
            raise ValueError(f"modes must be distinct names from {', '.join(MODES)}, got {modes!r}")
        self.config = config
        self.objective = objective
        self.est = estimates or Estimates()
        self.modes = modes or (("plain", "draft", "rounds") if objective == "latency" else ("rounds", "draft", "plain"))
        self.rates = {m: _ModeRate() for m in self.modes}
        self.mode = self.modes[0]  # the phase being measured now
        self._favourite = self.modes[0]
        self._explore_every = config.explore_every
        self._since_explore = 0
        # tokens, ms, verifier ms of the current phase, and the ms of its verdicts whose forward ran while the
        # drafter worked (a shadow chain: in ``plain`` not the mode's time, ``_plain_clock``)
        self._phase = [0, 0.0, 0.0, 0.0]
        self._recent: list[tuple[int, float, float, float]] = []  # ... and its verdicts (the same four)
        self._collapsed = False  # the phase ending now is the favourite's window that fell behind
        self._since_explore_ms = 0.0  # the favourite's time since the last probe ...
        self._explore_wait_ms = 0.0  # ... and how long the budget says it must be before the next
        self.explore_loss_ms = 0.0  # time probes lost against the favourite's rate (reported by benches)
        self.tokens_by_mode = dict.fromkeys(self.modes, 0)  # committed tokens per mode in force (reported)
        self._catch_up_credit_ms = 0.0  # a cold drafter's catch-up the verifier waited for (not the mode's rate)
        # (round ms, verify ms, mode, verified nodes) the model expects of the tree drafted last
        self._predicted: tuple[float, float, str, int] | None = None
        # per tree round: predicted and measured round ms, verify ms and verified nodes, and the mode it was priced in
        self.predictions: list[tuple[float, float, float, float, int, int, str]] = []
        self._request_chains = 0  # chains scored since this request began (shadows, and trees verified) ...
        # ... as (depth, leading nodes that were the target's tokens), rebased levels included: what the streamed
        # mode would have made of this text (``_draft_plan``)
        self._request_runs: list[tuple[int, int]] = []
        # this request's verdicts in ``draft``: tokens, verifier forward ms, trees
        self._draft_account: tuple[int, float, int] = (0, 0.0, 0)
        self._observed = 0  # observations so far (a plan, asked several times a verdict, is kept until the next)
        self._plans: dict[str, tuple[int, Plan | None]] = {}
        self._request_tries: list[list[int]] = []  # ... and their first choices at each depth: [tried, accepted]
        self._phase_tries: list[list[int]] = []  # the same, of the trees verified in the current phase
        self._phase_chains = 0
        self._phase_shapes: list[tuple[int, int, int]] = []  # (width, depth, nodes) of its lock-step trees
        self._phase_trees = 0  # verdicts on trees in this phase (none in ``draft``: it decoded as ``plain``)
        self._called: set[str] = set()  # modes probed in this request because its shadow predicted a win
        # per mode: [tokens, ms, verifier ms] of its phases in this request
        self._request_rates: dict[str, list[float]] = {}
        self._phase_foreign = False  # the phase ending now drafted the last request's shapes (ended by the re-check)
        self._request_ran: dict[str, int] = {}  # per mode: tokens it committed in this request, its phases all
        self._request_collapsed = False  # a drafting mode collapsed in this request
        self._rechecked = False  # this request's re-decision on its own chains was made
        self._streamed_since_shadow = config.shadow_gap  # tokens decoded alone since the last shadow was scored
        self._gated: dict[str, int] = {}  # probes of each mode skipped in a row on the shadow's prediction
        self.calibration: dict[str, float] = {}  # per mode: measured rate / the model's at the acceptance seen
        self._probe_predicted: float | None = None  # what the model predicted of the probe running now
        self.shadows = 0  # shadow chains scored (reported by benches) ...
        self.skipped_probes = 0  # ... probes they skipped as predicted losers, and probes they called
        self.called_probes = 0
        self._speculates = False  # the client drafts ahead while verdicts are in flight (seen: a free tree)
        # the latest decisions, at a phase's end or a request's re-check (benches keep each request's, to show why
        # a mode ran where it lost): what ran and what it measured, the rates the choice compared, what it chose
        self.decisions: deque[dict] = deque(maxlen=DECISIONS_KEPT)
        self.decisions_made = 0

    # -- Planner ------------------------------------------------------------------------------------------------------
    stream_first = True  # whatever the objective: never a later first token than cloud-only decoding

    @property
    def favourite(self) -> str:
        """The mode the policy settled on (``mode`` is the phase being measured now, possibly a probe)."""
        return self._favourite

    @property
    def drafts(self) -> bool:
        """Whether to warm the drafter up on a new prompt, alongside the verifier's prefill (else the first draft
        waits for the first token): not while cloud-only decoding is the favourite (on shared cores that catch-up
        slows the prefill for nothing; a probe's first draft catches up), nor unless the drafter's work is measured
        not to slow the verifier. On shared cores the cloud-cost client's first tokens came 1.4-1.6x later than
        cloud-only decoding's where it warmed up beside the prefill, with the slowdown measured and again, 1.6x,
        with it unmeasured (that client rarely decodes alone with the drafter idle, which the measure needs: 0 and
        5 such forwards before its first two requests, 2026-12-03)."""
        return self._favourite != "plain" and self.mode != "plain" and self.interference is not None and self.overlap_ok

    @property
    def stream(self) -> bool:
        return self.mode != "rounds"

    def shape(self, pending_tokens: int = 0) -> TreeShape | None:
        return self._shape_now(record=True)

    def peek(self, pending_tokens: int = 0) -> TreeShape | None:
        return self._shape_now(record=False)

    def _shape_now(self, record: bool) -> TreeShape | None:
        """Once this request's chains suffice, the chain their replay found best for the mode in force
        (``_draft_plan``, ``_rounds_plan``: the shape its rate was priced on); before, the cost model's shape."""
        if self.mode == "plain":
            return None
        e = self._request_est()
        plan = self._draft_plan() if self.mode == "draft" else self._rounds_plan()
        shape = plan[1] if plan is not None else self.best_shape(self.mode, est=e)
        if record and shape is not None:
            self._record_prediction(self.mode, shape, e)
        return shape

    def _request_est(self) -> Estimates:
        """The estimates at this request's own acceptance, from its first chain on (before any, the prior's), so
        the tree drafted is the one ``rate_now`` priced. (With the client-wide running acceptance, a chat after code
        drafted deeper trees than its acceptance calls for, losing at half of cloud-only's rate, while the rate it
        was judged by was that of the shallower best shape; and until its own chains sufficed, it drafted the
        code's 12-level chains, which failed at a token or two each and collapsed the mode, 2026-12-03.)"""
        return self._est_at(self._request_tries)

    def _est_at(self, tries: list[list[int]]) -> Estimates:
        """The estimates with the acceptance counted in ``tries`` in place of the client-wide running one."""
        return replace(self.est, alpha=self._alpha_of(tries))

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

    def shadow(self, pending_tokens: int = 0) -> TreeShape | None:
        """A chain for the idle drafter to draft on the streamed text and score against it, never sent: in
        ``plain`` (or ``draft`` while no chain pays), where the drafter would otherwise sit idle, while its work
        costs the verifier nothing."""
        c = self.config
        d = c.shadow_depth
        if (  # asked after every streamed token: the medians of overlap_ok last
            self.mode == "rounds"
            or not d
            or self.modes == ("plain",)
            or self._streamed_since_shadow < c.shadow_gap
            or len(self.est.solo_ms) < c.overlap_samples
            or not self.overlap_ok
        ):
            return None  # (the verifier's pace with the drafter idle comes first: what any slowdown is judged by)
        return TreeShape(1, d, d)

    def observe_shadow(self, depth: int, accepted: int, draft_ms: float) -> None:
        """A shadow chain of ``depth`` first choices, drafted in ``draft_ms``, matched the next ``accepted``
        streamed tokens: what a chain would have had accepted there, at no cloud cost. (Greedy, a chain node is
        accepted iff it is the target's token; sampling, a point-mass draft x is accepted with probability p(x),
        which is the chance that the sampled token is x.)"""
        self.shadows += 1
        self._observed += 1
        self._streamed_since_shadow = 0
        self._request_runs.append((depth, accepted))
        self._note_chain(0, depth, accepted, phase=False)
        c = self.config
        self.est.learn_alpha(0, depth, accepted, c.ewma, c.forget, c.alpha_prior)
        if depth and draft_ms > 0:
            self.est.learn_draft_level(1, draft_ms / depth, c.ewma)
        self._recheck()

    def _note_chain(self, base: int, depth: int, accepted: int, phase: bool) -> None:
        """This request's (and with ``phase``, this phase's) acceptance by depth: a chain below ``base`` rebased
        levels whose first ``accepted`` of ``depth`` first choices held; level base + d + 1 was tried iff the chain
        held up to base + d."""
        for tries in (self._request_tries, self._phase_tries) if phase else (self._request_tries,):
            for d in range(base, base + min(depth, accepted + 1)):
                while len(tries) <= d:
                    tries.append([0, 0])
                tries[d][0] += 1
                tries[d][1] += accepted > d - base
        self._request_chains += 1
        self._phase_chains += phase

    def _alpha_of(self, tries: list[list[int]]) -> list[float]:
        """Acceptance by depth from counts, each depth shrunk towards the text's pooled acceptance (all depths'
        hits over all their tries, itself with the prior as one pseudo-observation) by one pseudo-observation.
        Deep levels are tried least, so the prior sets them: a fixed 0.7 there priced code's deep chains (all
        held) too low and chat's (which fail) too high, the model's error then growing with the gap between the
        texts, which no one calibration factor absorbs (code's rounds ran 1.3-1.5x the model, chat's 0.6-0.9x)."""
        hits, tried_all = sum(h for _, h in tries), sum(t for t, _ in tries)
        pooled = (hits + self.config.alpha_prior) / (tried_all + 1)
        return [(hit + pooled) / (tried + 1) for tried, hit in tries]

    def _recheck(self) -> None:
        """Once per request, when its own chains first suffice (``shadow_min``): re-decide at once on the rates
        they predict, rather than run the last request's favourite to the end of its phase (code after chat)."""
        if self._rechecked or self._request_chains < self.config.shadow_min:
            return
        self._rechecked = True  # (chains scored by streamed tokens leave the count where it was: decide once)
        if self.mode != self._favourite:  # a probe running: its end decides
            return
        best = self._best_mode()
        self._decided("recheck", best)
        if best == self._favourite:
            return
        if self._phase[1] > 0:  # measures what ran (its trees were shaped on the last request's acceptance: it
            self._phase_foreign = True  # calibrates the model, it is not this text's clock), then decides (to the
            self._end_phase()  # same ``best``, or to a probe)
        else:
            self._favourite = self.mode = best
            self._explore_every, self._explore_wait_ms = self.config.explore_every, 0.0

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
        if t1 is None or len(self._request_runs) < self.config.shadow_min:
            return None
        hits, tried = sum(h for _, h in self._request_tries), sum(t for t, _ in self._request_tries)
        return t1, (hits + self.config.alpha_prior) / (tried + 1), max(self.est.verify_ms_at, default=1)

    def _replay_streamed(self) -> Plan | None:
        inputs = self._replay_inputs()
        if inputs is None:
            return None
        t1, hold, largest = inputs
        runs, depth, slowdown = self._request_runs, self.config.max_depth, self.interference or 1.0
        return streamed_plan(self.est, runs, t1, hold, largest, depth, slowdown)

    def _replay_lockstep(self) -> Plan | None:
        inputs = self._replay_inputs()
        if inputs is None:
            return None
        t1, hold, largest = inputs
        c, guessed = self.config, self._speculates and self.overlap_ok
        plans = lockstep_plans(self.est, self._request_runs, hold, largest, c.max_depth, guessed)
        if not plans:
            return None
        fastest = max(plans, key=lambda p: (p.value, -p.verifier_ms_per_token))
        if self.objective == "latency":
            return fastest
        # what ``rate_now`` will say of each chain: the calibrated model at this text's acceptance, at most its replay
        at, floor = self._est_at(self._request_tries), (self._reference_rate() or 1000 / t1) * (1 - c.hysteresis)
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
        tokens, ms, trees = self._draft_account
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
        tokens, _, trees = self._draft_account
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
        if self._request_chains < self.config.shadow_min:
            return None
        raw = self._model_rate(mode, self._request_tries)
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
        not worth it)."""
        if mode == "draft" and (counted := self._counted_draft_rate()) is not None:
            return counted
        if mode != "plain":
            tokens, ms, _ = self._request_rates.get(mode, (0, 0.0, 0.0))
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
            tokens, _, verify_ms = self._request_rates.get(mode, (0, 0.0, 0.0))
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
        if not self._request_collapsed or mode == "plain" or (mode == "draft" and self._draft_plan() is not None):
            return False  # (the streamed mode's plan is a count of this text's chains, not the model)
        return self._request_ran.get(mode, 0) < self.config.probe_tokens

    def _start_probe(self, mode: str) -> None:
        self.mode = mode
        enough = self._request_chains >= self.config.shadow_min
        self._probe_predicted = self._model_rate(mode, self._request_tries) if enough else None  # uncalibrated

    def _worth_probing(self, mode: str) -> bool:
        """Not a mode this request's shadow predicts clearly below the reference rate; but every mode skipped
        ``gate_skips`` times in a row (a mispredicting model must not lock a mode out)."""
        if self._ruled_out(mode):
            return False
        predicted, ref = self.predicted_rate(mode), self._reference_rate()
        if predicted is None or ref <= 0 or self._gated.get(mode, 0) >= self.config.gate_skips:
            return True
        return predicted >= self.config.probe_gate * ref

    def _predicts_win(self, mode: str) -> bool:
        """Latency: this request's shadow predicts ``mode`` faster than the favourite by the hysteresis."""
        if (
            self.objective != "latency"
            or mode in self._called
            or not self.rates[self._favourite].measured_ms
            or self._request_rates.get(mode, (0, 0.0, 0.0))[0] >= self.config.probe_tokens  # the clock on this text
            or self._ruled_out(mode)
        ):
            return False
        predicted = self.predicted_rate(mode)
        return predicted is not None and predicted > self.rate_now(self._favourite) * (1 + self.config.hysteresis)

    def mark(self) -> tuple[dict[str, int], int]:
        """Where the policy stands now (tokens committed per mode, decisions made), for ``log_since``."""
        return dict(self.tokens_by_mode), self.decisions_made

    def log_since(self, mark: tuple[dict[str, int], int]) -> dict:
        """Since ``mark`` (a request, for a bench to show why each mode ran where it did): the tokens each mode
        committed, and the decisions made (those still kept)."""
        modes_before, made_before = mark
        new = min(self.decisions_made - made_before, len(self.decisions))
        return {
            "tokens_by_mode": {m: n - modes_before.get(m, 0) for m, n in self.tokens_by_mode.items()},
            "decisions": list(self.decisions)[len(self.decisions) - new :] if new > 0 else [],
        }

    def prediction_report(self) -> dict:
        """The cost model against the clock: mean predicted and measured round and verify times of trees, and
        (``by_mode``) the same per mode priced, with the verified nodes predicted and measured (a tree rebased
        further than expected, or sent smaller, verifies fewer)."""

        def means(rows: list[tuple[float, float, float, float, int, int, str]]) -> dict:
            m = [sum(float(row[i]) for row in rows) / len(rows) for i in range(6)]
            return {
                "trees": len(rows),
                "round_ms_predicted": round(m[0], 1),
                "round_ms_measured": round(m[1], 1),
                "verify_ms_predicted": round(m[2], 1),
                "verify_ms_measured": round(m[3], 1),
                "nodes_predicted": round(m[4], 2),
                "nodes_measured": round(m[5], 2),
            }

        if not self.predictions:
            return {}
        report = means(self.predictions)
        for key in ("nodes_predicted", "nodes_measured"):  # (the overall keys stay as they were)
            del report[key]
        modes = sorted({row[6] for row in self.predictions})
        report["by_mode"] = {mode: means([row for row in self.predictions if row[6] == mode]) for mode in modes}
        return report

    def shadow_report(self) -> dict:
        """What the shadow chains measured and decided over the client's life."""
        slowdown = self.interference
        return {
            "interference": round(slowdown, 3) if slowdown is not None else None,
            "solo_forward_ms": round(t1, 1) if (t1 := self._solo_t1_ms()) is not None else None,
            "overlap_forward_ms": round(statistics.median(self.est.overlap_ms), 1) if self.est.overlap_ms else None,
            "shadows": self.shadows,
            "skipped_probes": self.skipped_probes,
            "called_probes": self.called_probes,
            "calibration": {m: round(c, 2) for m, c in self.calibration.items()},
        }

    def observe_catch_up(self, tokens: int, ms: float, waited: bool = False) -> None:
        """The drafter took ``ms`` to evaluate ``tokens`` committed tokens it had not seen (``waited``: while the
        verifier sat idle)."""
        if tokens >= 8:  # shorter catch-ups are dominated by a fixed per-call cost, not the per-token rate
            if waited and self.mode == "rounds":  # a cold drafter's one-off cost, not the mode's rate (one that
                self._catch_up_credit_ms += ms  # overlapped the prefill or a run decoded alone cost no wait)
            self.est.learn_catch_up(tokens, ms, self.config.ewma)

    def observe(self, r: Round) -> None:
        self._observed += 1
        self._learn(r)
        self.tokens_by_mode[self.mode] += r.tokens
        self._streamed_since_shadow += r.streamed
        if r.first:  # its gap includes the prompt prefill: not a rate of this mode
            if self._phase[0] >= self.config.probe_tokens:  # a new request: the last one's partial phase is a
                self._end_phase()  # measurement, and this request's rate is judged from its own start
            else:
                self._new_phase()
            self._catch_up_credit_ms = 0.0
            self._request_chains, self._request_tries, self._called = 0, [], set()
            self._request_runs, self._draft_account = [], (0, 0.0, 0)
            self._request_rates, self._request_collapsed, self._rechecked = {}, False, False
            self._request_ran = {}
            return
        if not r.streamed and not r.stale and r.depth:
            self._note_chain(r.rebased, r.depth, r.chain_accepted, phase=True)
            if not r.rebased:
                self._phase_shapes.append((max(1, r.width), r.depth, r.nodes))
            self._request_runs.append((r.rebased + r.depth, r.rebased + r.chain_accepted))
        elif r.stale:  # the tokens decoded alone left its first choices (exactly so at one rebased token)
            self._request_runs.append((1, 0))
        if self.mode == "draft":
            tokens, ms, trees = self._draft_account
            self._draft_account = (tokens + r.tokens, ms + r.compute_ms, trees + (not r.streamed))
        # in ``plain``, a tree is the mode before's, landing after the switch: its burst of tokens (a lock-step
        # chain of 12 commits 13 at once) is not cloud-only decoding's clock (a cost client's plain probe read 17.7
        # tokens/s with one, where the verifier decodes 7.1, and kept code in cloud-only decoding; 2026-12-03).
        # In ``rounds``, a token decoded alone is the mode before's run going on while the drafter catches up on
        # what it missed: a cost of entering the mode (at a switch, and on each new prompt), not its rate, and on
        # one host 3x slower than either mode's clock (the catch-up shares the verifier's cores; 68-190 ms a token
        # against 30), which cut lock-step probes after 8 such tokens. (That entry cost is priced nowhere yet.)
        if r.streamed == (self.mode == "plain") or self.mode == "draft":
            self._clock(r)
        if self._phase[0] >= self.config.phase_tokens or self._losing_phase():
            self._end_phase()
        elif not r.streamed:
            self._recheck()

    def _clock(self, r: Round) -> None:
        """Add a verdict to the phase's clock."""
        gap = r.gap_ms
        if self._catch_up_credit_ms and not r.streamed:
            credit = min(self._catch_up_credit_ms, gap)
            gap, self._catch_up_credit_ms = gap - credit, self._catch_up_credit_ms - credit
        overlapped = gap if r.overlapped else 0.0
        self._phase_trees += not r.streamed
        self._phase[0] += r.tokens
        self._phase[1] += gap
        self._phase[2] += r.verify_ms
        self._phase[3] += overlapped
        self._recent.append((r.tokens, gap, r.verify_ms, overlapped))

    def _reference_rate(self) -> float:
        """The rate a probe is held against: the favourite's (latency), cloud-only decoding's (cloud cost: a mode
        slower than it is never taken)."""
        mode = self._favourite if self.objective == "latency" else "plain"
        return self.rate_now(mode) if mode in self.rates else 0.0

    def _losing_phase(self) -> bool:
        """A probe clearly below its reference; or the favourite clearly below what another mode measured last
        (the workload changed, e.g. from code to chat: re-decide now, not at the end of the phase)."""
        if self.mode == "draft" and self.draft_speedup() is not None:  # counted on this text, not clocked
            counted = self.rate_now("draft")
            tokens, ms = self._phase[0], self._phase[1]
            unmeasured = self.draft_saved() is None and self.interference is None
            if unmeasured and tokens >= self.config.probe_tokens and ms > 0:
                # priced by its chains' replay, at forwards timed with no drafter beside them: a drafter that slows
                # them (shared cores) is not in it until measured, and the clock shows it (a cloud-cost client,
                # which had not streamed alone, ran a chat's streamed trees at 9 tokens/s for a whole phase
                # priced at 32, cloud-only decoding 23; 2026-12-03)
                counted = min(counted, 1000 * tokens / ms)
            if self.mode != self._favourite:
                return tokens >= self.config.probe_tokens and counted < self.config.abort_ratio * self._reference_rate()
            others = max((self.rate_now(m) for m in self.modes if m != "draft"), default=0.0)
            return counted < self.config.abort_ratio * others  # re-decide, not a collapse
        if self.mode != self._favourite:
            tokens, ms, _, overlapped = self._phase
            if tokens < self.config.probe_tokens or ms <= 0:
                return False
            if self.mode == "plain" and self.objective == "cloud_cost":  # its rate does not depend on the text,
                return True  # and each of its tokens costs a whole forward: a probe's probe_tokens measure it
            return 1000 * tokens / self._plain_clock(ms, overlapped) < self.config.abort_ratio * self._reference_rate()
        if self.objective == "latency":
            ref = max((r.tokens_per_s for m, r in self.rates.items() if m != self.mode and r.measured_ms), default=0.0)
        else:
            ref = self._reference_rate() if self.mode != "plain" else 0.0
        # the favourite is judged on its recent verdicts (2 * probe_tokens): a collapse after a good start shows
        window, t, m, v, o = 2 * self.config.probe_tokens, 0, 0.0, 0.0, 0.0
        for tokens, ms, verify_ms, overlapped in reversed(self._recent):
            t, m, v, o = t + tokens, m + ms, v + verify_ms, o + overlapped
            if t >= window:
                break
        if t < window or m <= 0 or 1000 * t / self._plain_clock(m, o) >= self.config.abort_ratio * ref:
            return False
        self._phase = [t, m, v, o]  # what it does now is what it measured
        self._collapsed = True
        return True

    # -- modes ----------------------------------------------------------------------------------------------------
    def _new_phase(self) -> None:
        """Forget the current phase: its clock and its trees' evidence."""
        self._phase, self._recent = [0, 0.0, 0.0, 0.0], []
        self._phase_tries, self._phase_chains, self._phase_shapes, self._phase_trees = [], 0, [], 0

    def _decided(self, kind: str, chose: str, **ran: object) -> None:
        self.decisions_made += 1
        self.decisions.append(
            {
                "kind": kind,
                "mode": self.mode,
                "favourite": self._favourite,
                "chose": chose,
                "request_chains": self._request_chains,
                **ran,
                "rates_now": {m: round(self.rate_now(m), 2) for m in self.modes},
                **(
                    {"costs_now": {m: round(self.cost_now(m), 1) for m in self.modes}}
                    if self.objective == "cloud_cost"
                    else {}
                ),
                "calibration": {m: round(c, 3) for m, c in self.calibration.items()},
                **self._draft_evidence(),
            }
        )

    def _draft_evidence(self) -> dict:
        """What the drafting modes' rates stood on (decision log): the streamed mode's trees' account, and each
        mode's plan from this request's chains (value, depth, verifier ms per token)."""
        evidence: dict = {}
        if "draft" in self.modes:
            saved = self.draft_saved()
            tokens, _, trees = self._draft_account
            evidence |= {"draft_saved": None if saved is None else round(saved, 3), "draft_account": [tokens, trees]}
        for mode, plan in (("draft", self._draft_plan), ("rounds", self._rounds_plan)):
            if mode in self.modes:
                p = plan()
                evidence[f"{mode}_plan"] = (
                    None
                    if p is None
                    else [round(p.value, 3), p.shape.d if p.shape else 0, round(p.verifier_ms_per_token, 1)]
                )
        return evidence

    def _plain_clock(self, ms: float, overlapped_ms: float) -> float:
        """A phase's time, as its mode's: in ``plain``, the time of tokens decoded while a shadow chain was being
        drafted is taken at the verifier's pace with the drafter idle (over the measured ``interference``). The
        shadow's cost is the shadow's: the gate stops them once measured, but a plain phase that ran them before
        priced cloud-only decoding at 13 tokens/s where it ran at 25, and drafting modes slower than cloud-only
        decoding won against it for whole requests (2026-12-03, drafter and verifier on the same two cores)."""
        return self._idle_clock(ms, overlapped_ms) if self.mode == "plain" else ms

    def _idle_clock(self, ms: float, overlapped_ms: float) -> float:
        """``ms`` of tokens decoded alone, ``overlapped_ms`` of it beside the drafter's work, at the verifier's
        pace with the drafter idle."""
        slowdown = self.interference
        if not overlapped_ms or slowdown is None or slowdown <= 1.0:
            return ms
        return ms - overlapped_ms * (1 - 1 / slowdown)

    def _end_phase(self) -> None:
        mode, tokens, collapsed = self.mode, int(self._phase[0]), self._collapsed
        ms = self._plain_clock(self._phase[1], self._phase[3])
        self._close_phase()
        if ms > 0:
            self._decided(
                "phase",
                self.mode,
                ran=mode,
                tokens=tokens,
                ms=round(ms, 1),
                measured=round(1000 * tokens / ms, 2),
                collapsed=collapsed,
            )

    def _close_phase(self) -> None:
        tokens, raw_ms, verify_ms, overlapped = self._phase
        ms = self._plain_clock(raw_ms, overlapped)
        collapsed, self._collapsed = self._collapsed, False
        # a phase before this request's re-check drafted the last request's shapes (its trees were shaped on that
        # text's acceptance): it calibrates the model and moves the client-wide rates, but it is not this text's
        # clock (the mode is priced by the model, at this text's acceptance, for the shape it will draft)
        foreign, self._phase_foreign = self._phase_foreign or not self._rechecked, False
        tries, chains, shapes, trees = self._phase_tries, self._phase_chains, self._phase_shapes, self._phase_trees
        self._new_phase()
        if ms <= 0:
            return
        self._request_ran[self.mode] = self._request_ran.get(self.mode, 0) + int(tokens)
        if not foreign:
            here = self._request_rates.setdefault(self.mode, [0, 0.0, 0.0])
            here[0], here[1], here[2] = here[0] + tokens, here[1] + ms, here[2] + verify_ms
        rate = self.rates[self.mode]
        before = rate.tokens_per_s
        w = 1.0 if not rate.measured_ms or collapsed else self.config.rate_memory
        rate.add(self._phase_rate(tokens, ms), verify_ms / tokens, ms, w)
        plan = self._draft_plan() if self.mode == "draft" and not trees else None
        if plan is not None and plan.shape is None and tokens >= self.config.probe_tokens:
            self._measured_plain(tokens, self._idle_clock(raw_ms, overlapped), verify_ms)
        if collapsed and self.mode != "plain":
            self._request_collapsed = True
            if not foreign:
                self._request_rates[self.mode] = [tokens, ms, verify_ms]  # (the window alone, as for the rate)
        if collapsed and self.mode != "plain" and before > 0:
            fall = min(1.0, rate.tokens_per_s / before)  # acceptance fell: every drafting mode falls with it
            for m, other in self.rates.items():
                if m not in (self.mode, "plain"):
                    other.tokens_per_s *= fall
                    if m in self._request_rates:
                        self._request_rates[m][1] /= max(fall, 1e-3)
        was_exploring = self.mode != self._favourite
        predicted, self._probe_predicted = self._probe_predicted, None
        if self.mode != "plain" and chains >= self.config.shadow_min:  # the model at the acceptance this phase's
            predicted = self._model_rate(self.mode, tries, shapes)  # own trees met (code and chat alike)
        elif not was_exploring:
            predicted = None  # (else a probe's prediction from the shadow chains before it)
        if predicted and self.mode != "plain":  # the model against the clock, for this mode
            ratio = min(10.0, max(0.1, 1000 * tokens / ms / predicted))
            old = self.calibration.get(self.mode)
            self.calibration[self.mode] = ratio if old is None else old + w * (ratio - old)  # a collapse: as it is
        ref = self._reference_rate()
        if was_exploring and ref > 0:  # what this probe cost the user against the reference mode
            loss = max(0.0, ms - 1000 * tokens / ref)
            self.explore_loss_ms += loss
            # probes in a row (no favourite phase between them) add up: the wait pays for all of them
            carry = self._explore_wait_ms if self._since_explore_ms == 0 else 0.0
            self._explore_wait_ms, self._since_explore_ms = carry + loss / self.config.explore_budget, 0.0
        else:
            self._since_explore_ms += ms
        unmeasured = [m for m in self.modes if not self.rates[m].measured_ms and self._worth_probing(m)]
        if unmeasured:
            self._start_probe(unmeasured[0])
            return
        best = self._best_mode()
        if best != self._favourite:
            self._favourite, self._explore_every = best, self.config.explore_every
            self._explore_wait_ms = 0.0
        elif was_exploring:  # the other mode lost again: look at it less often
            self._explore_every = min(self.config.explore_max, 2 * self._explore_every)
        self._since_explore += 1
        others = [m for m in self.modes if m != self._favourite and not self._ruled_out(m)]
        called = [m for m in others if self._predicts_win(m)]
        if called:  # this request's own text says another mode wins now: measure it at once, whatever the wait
            self._called.add(called[0])
            self.called_probes += 1
            self._since_explore = 0
            self._start_probe(called[0])
            return
        if others and self._since_explore >= self._explore_every and self._since_explore_ms >= self._explore_wait_ms:
            self._since_explore = 0
            worth = [m for m in others if self._worth_probing(m)]
            if worth:
                self._start_probe(min(worth, key=lambda m: self.rates[m].measured_ms))  # the least measured
                self._gated[self.mode] = 0
                return
            self.skipped_probes += 1  # predicted to lose: it counts as a lost probe, without the loss
            self._explore_every = min(self.config.explore_max, 2 * self._explore_every)
            for m in others:
                self._gated[m] = self._gated.get(m, 0) + 1
        self.mode = self._favourite

    def _measured_plain(self, tokens: float, ms: float, verify_ms: float) -> None:
        """A phase of the streamed mode that sent no tree, its chains saying none pays, was cloud-only decoding (the
        verifier decoded alone, the drafter drafted nothing to send): its clock is cloud-only decoding's too. The
        cloud-cost client measures cloud-only decoding in probes of 8 tokens, the first after a switch of mode;
        they read 20-24 tokens/s where it ran at 28-30 in such phases, and lock-step rounds at 22-26 passed for as
        fast (shared cores, 2026-12-03)."""
        plain = self.rates["plain"]
        plain.add(1000 * tokens / ms, verify_ms / tokens, ms, self.config.rate_memory if plain.measured_ms else 1.0)

    def _phase_rate(self, tokens: float, ms: float) -> float:
        """The rate a closing phase leaves its mode with, for the requests after this one: its clock; but for the
        streamed mode, once this text says what its trees save (``draft_speedup``), cloud-only decoding's rate
        times that. It is cloud-only decoding plus trees, and a clock of it with no tree worth sending is cloud-only
        decoding's under another name: phases of the two differ by +-8 %, and on shared cores such a phase (31
        tokens, one tree) read 27.8 tokens/s against plain's 26.3, won the next request on that noise and
        collapsed there (2026-12-03)."""
        counted = self._counted_draft_rate() if self.mode == "draft" else None
        return counted if counted is not None else 1000 * tokens / ms

    def _best_mode(self) -> str:
        h, fav = self.config.hysteresis, self._favourite
        now = {m: self.rate_now(m) for m in self.modes}
        if self.objective == "latency":
            best = max(self.modes, key=lambda m: now[m])
            return best if now[best] > now[fav] * (1 + h) else fav
        floor = self._reference_rate() * (1 - h)  # never slower than cloud-only decoding
        fast_enough = [m for m in self.modes if now[m] >= floor] or [fav]
        cost = {m: self.cost_now(m) for m in fast_enough}
        best = min(fast_enough, key=lambda m: cost[m])
        if fav in fast_enough and cost[fav] <= cost[best] * (1 + h):
            return fav
        return best

    # -- shapes ---------------------------------------------------------------------------------------------------
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

    def best_shape(self, mode: str, record: bool = False, est: Estimates | None = None) -> TreeShape | None:
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
        if record and best is not None:
            self._record_prediction(mode, best, e)
        return best

    def _record_prediction(self, mode: str, shape: TreeShape, e: Estimates) -> None:
        """What the model expects the round of the tree drafted now to take (``prediction_report``)."""
        r = 0 if mode == "rounds" else min(shape.d - 1, max(0, round(e.rebase)))
        nodes = max(1, round(shape.n * (shape.d - r) / shape.d))
        verify = e.verify_ms(1 + nodes)
        self._predicted = (verify + e.rtt_ms, verify, mode, nodes)

    def _learn(self, r: Round) -> None:
        if not r.streamed and self._predicted is not None and len(self.predictions) < 10000:
            round_ms, verify_ms, mode, nodes = self._predicted
            self.predictions.append((round_ms, r.round_ms, verify_ms, r.verify_ms, nodes, r.nodes, mode))
            self._predicted = None
        c = self.config
        self.est.learn_verdict(r, c.ewma, c.forget, c.alpha_prior)
        if not r.streamed and r.depth and not r.draft_ms and not r.stale:  # a tree that cost no drafting: drafted
            self._speculates = True  # while the last verdict was in flight
