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
that double (``explore_every`` up to ``explore_max``) while they keep losing (the schedule:
``orchestrator.exploration``).

Exploring costs the user time: a phase of a mode slower than the favourite loses
tokens * (1/rate - 1/favourite rate). The rules that bound that loss:

- Start safe. The latency objective measures ``plain`` (cloud-only decoding) first, so a new client's first
  tokens are never slower than cloud-only, and the drafter does not warm up on a prompt (``drafts``) unless a
  drafting mode is the favourite (on shared cores that warm-up slows the verifier's prefill).
- Cut clear losers. A probe below ``abort_ratio`` of the favourite's rate after ``probe_tokens`` ends at once;
  its rate so far is what it measured.
- Budget the next look. The next probe waits until the favourite has run long enough that the last probes' loss
  is at most ``explore_budget`` of the time (1 s lost at 3 % waits 33 s); probes in a row add up. A probe whose
  entry is priced (``_entry_ms``) also waits until that time pays for its entry (``_probe_affordable``), and an
  unmeasured mode the last text's shadow chains predicted to lose is not probed blind on a new text before that
  time also pays for the loss they predicted.
- Notice a change. A favourite whose last 2 * ``probe_tokens`` tokens fall below ``abort_ratio`` of another mode's
  last rate (the workload changed, code to chat say) ends its phase and takes that window's rate as its own (not
  blended with what it measured on the old workload). A drafting favourite's fall is the drafter's acceptance
  falling, which moves every drafting mode: their rates are scaled down by the same factor, while cloud-only
  decoding's does not depend on acceptance; so a collapse falls back to ``plain`` rather than onto another
  drafting mode measured on the old workload, and no drafting mode that has not run in this request runs in the
  rest of it (the cost model, built on the same chains, priced them too high already); the next request's
  probes find drafting again. A phase also ends with its request, so every request is judged from its own
  start.
- Price each mode on this request's text (``orchestrator.pricing``): a drafting mode's rate depends on
  acceptance, so it is the calibrated cost model at this request's acceptance, or what the mode measured here, not
  what it measured on the last request; the streamed mode is counted on its own trees and chains, not modelled.
  The policy re-decides once this request's chains suffice (``shadow_min``), not at the end of the last request's
  favourite's phase, and drafts the shape best at that acceptance (the one it priced).
- Charge a mode its own cost. In ``rounds``, a cold drafter's catch-up on the history that the verifier waited for
  is not charged to the mode (in steady state it overlaps the prefill).
- Price an entry. Entering a drafting mode, the drafter catches up on what it has not seen (a new prompt, the
  tokens streamed since) while the verifier decodes alone beside it. Where that run is slower than cloud-only
  decoding (shared cores) the loss is measured on entries into ``rounds`` (``entry_loss_ms``), charged to the
  probe that paid it, and priced into a drafting mode's rate over the rest of a request (``_entering_rate``); the
  mode is chosen again, entry priced, at each request's start. The price scales with what the drafter has to
  catch up on (a cold prompt's whole length): ms lost per ms of its catch-up (``entry_ratio``), measured, or
  before any entry, where the drafter is measured to slow the verifier s-fold, 1 - 1/s.
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

from tandem.core.tree import TreeShape
from tandem.edge.planner import Round

from .costmodel import Estimates, moved
from .exploration import ExplorationSchedule
from .policy_config import PolicyConfig
from .pricing import RequestEvidence, count_chain

MODES = ("draft", "plain", "rounds")
CATCH_UP_MIN = 8  # a catch-up shorter than this is dominated by a fixed per-call cost, not the per-token rate
DECISIONS_KEPT = 1024  # latest decisions a policy keeps (a phase's end or a re-check each: ~5 a 96-token request)
OBJECTIVES = ("latency", "cloud_cost")


class DraftPolicy(ExplorationSchedule):
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
        default = ("plain", "draft", "rounds") if objective == "latency" else ("rounds", "draft", "plain")
        super().__init__(config, estimates or Estimates(), objective, modes or default)
        self.mode = self.modes[0]  # the phase being measured now
        self._favourite = self.modes[0]
        # tokens, ms, verifier ms of the current phase, and the ms of its verdicts whose forward ran while the
        # drafter worked (a shadow chain: in ``plain`` not the mode's time, ``_plain_clock``)
        self._phase = [0, 0.0, 0.0, 0.0]
        self._recent: list[tuple[int, float, float, float]] = []  # ... and its verdicts (the same four)
        self._phase_tries: list[list[int]] = []  # first choices of its trees at each depth: [tried, accepted]
        self._phase_chains = 0
        self._phase_shapes: list[tuple[int, int, int]] = []  # (width, depth, nodes) of its lock-step trees
        self._phase_trees = 0  # verdicts on trees in this phase (none in ``draft``: it decoded as ``plain``)
        self._phase_foreign = False  # the phase ending now drafted the last request's shapes (ended by the re-check)
        self._collapsed = False  # the phase ending now is the favourite's window that fell behind
        self.tokens_by_mode = dict.fromkeys(self.modes, 0)  # committed tokens per mode in force (reported)
        self._catch_up_credit_ms = 0.0  # a cold drafter's catch-up the verifier waited for (not the mode's rate)
        # entering a drafting mode: tokens and ms decoded alone in this ``rounds`` phase while the drafter caught up
        # and drafted its first tree (and that tree's drafting ms), what such an entry lost against cloud-only
        # decoding (running), and whether the drafter is caught up (a drafting mode's tree came back since the
        # request began or cloud-only decoding last ran)
        self._phase_entry = [0, 0.0, 0.0]
        self._phase_pending = 0  # tokens the drafter had not evaluated when this phase began (its entry's catch-up)
        self._entry_paid = False
        self._request_tokens = 0  # tokens committed in this request so far ...
        self._tokens_per_request: float | None = None  # ... and in a request, running
        # (round ms, verify ms, mode, verified nodes) the model expects of the tree drafted last
        self._predicted: tuple[float, float, str, int] | None = None
        # per tree round: predicted and measured round ms, verify ms and verified nodes, and the mode it was priced in
        self.predictions: list[tuple[float, float, float, float, int, int, str]] = []
        self._streamed_since_shadow = config.shadow_gap  # tokens decoded alone since the last shadow was scored
        self.shadows = 0  # shadow chains scored (reported by benches)
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
        self.req.runs.append((depth, accepted))
        self._note_chain(0, depth, accepted, phase=False)
        c = self.config
        self.est.learn_alpha(0, depth, accepted, c.ewma, c.forget, c.alpha_prior)
        if depth and draft_ms > 0:
            self.est.learn_draft_level(1, draft_ms / depth, c.ewma)
        self._recheck()

    def _note_chain(self, base: int, depth: int, accepted: int, phase: bool) -> None:
        """A chain scored on this request's text (with ``phase``, a tree of this phase): ``count_chain``."""
        count_chain(self.req.tries, base, depth, accepted)
        if phase:
            count_chain(self._phase_tries, base, depth, accepted)
        self.req.chains += 1
        self._phase_chains += phase

    def _recheck(self) -> None:
        """Once per request, when its own chains first suffice (``shadow_min``): re-decide at once on the rates
        they predict, rather than run the last request's favourite to the end of its phase (code after chat)."""
        if self.req.rechecked or self.req.chains < self.config.shadow_min:
            return
        self.req.rechecked = True  # (chains scored by streamed tokens leave the count where it was: decide once)
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
            self._reset_schedule()

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
        """What the shadow chains measured and decided over the client's life, and what an entry into lock-step
        rounds loses (``entry_loss_ms``)."""
        slowdown = self.interference
        return {
            "interference": round(slowdown, 3) if slowdown is not None else None,
            "solo_forward_ms": round(t1, 1) if (t1 := self._solo_t1_ms()) is not None else None,
            "overlap_forward_ms": round(statistics.median(self.est.overlap_ms), 1) if self.est.overlap_ms else None,
            "shadows": self.shadows,
            "skipped_probes": self.skipped_probes,
            "called_probes": self.called_probes,
            "calibration": {m: round(c, 2) for m, c in self.calibration.items()},
            "entry_loss_ms": round(self.entry_loss_ms, 1) if self.entry_loss_ms is not None else None,
            "entry_ratio": round(self.entry_ratio, 3) if self.entry_ratio is not None else None,
        }

    def observe_catch_up(self, tokens: int, ms: float, waited: bool = False) -> None:
        """The drafter took ``ms`` to evaluate ``tokens`` committed tokens it had not seen (``waited``: while the
        verifier sat idle)."""
        if tokens >= CATCH_UP_MIN:
            if waited and self.mode == "rounds":  # a cold drafter's one-off cost, not the mode's rate (one that
                self._catch_up_credit_ms += ms  # overlapped the prefill or a run decoded alone cost no wait)
            self.est.learn_catch_up(tokens, ms, self.config.ewma)

    def observe(self, r: Round) -> None:
        self._observed += 1
        self._pending = r.pending
        self._learn(r)
        self.tokens_by_mode[self.mode] += r.tokens
        self._streamed_since_shadow += r.streamed
        self._request_tokens += r.tokens
        if r.first:  # its gap includes the prompt prefill: not a rate of this mode
            self._new_request(r.tokens)
            return
        if not r.streamed and not r.stale and r.depth:
            self._note_chain(r.rebased, r.depth, r.chain_accepted, phase=True)
            if not r.rebased:
                self._phase_shapes.append((max(1, r.width), r.depth, r.nodes))
            self.req.runs.append((r.rebased + r.depth, r.rebased + r.chain_accepted))
        elif r.stale:  # the tokens decoded alone left its first choices (exactly so at one rebased token)
            self.req.runs.append((1, 0))
        if self.mode == "draft":
            tokens, ms, trees = self.req.draft_account
            self.req.draft_account = (tokens + r.tokens, ms + r.compute_ms, trees + (not r.streamed))
        # in ``plain``, a tree is the mode before's, landing after the switch: its burst of tokens (a lock-step
        # chain of 12 commits 13 at once) is not cloud-only decoding's clock (a cost client's plain probe read 17.7
        # tokens/s with one, where the verifier decodes 7.1, and kept code in cloud-only decoding; 2026-12-03).
        # In ``rounds``, a token decoded alone is the mode before's run going on while the drafter catches up on
        # what it missed: a cost of entering the mode (at a switch, and on each new prompt), not its rate, and on
        # one host 3x slower than either mode's clock (the catch-up shares the verifier's cores; 68-190 ms a token
        # against 30), which cut lock-step probes after 8 such tokens. It is priced as an entry (``_entering_rate``).
        if (r.streamed == (self.mode == "plain") or self.mode == "draft") and not self._drafters_time(r):
            self._clock(r)
        elif self.mode == "rounds" and r.streamed:
            self._phase_entry[0] += r.tokens
            self._phase_entry[1] += r.gap_ms
        if self.mode == "rounds" and not r.streamed and self._phase_entry[0] and self._phase_trees == 1:
            self._phase_entry[2] = r.draft_ms  # (the entry's first tree)
        self._entry_paid = self.mode != "plain" and (self._entry_paid or not r.streamed)
        if self._phase[0] >= self.config.phase_tokens or self._losing_phase():
            self._end_phase()
        elif not r.streamed:
            self._recheck()

    def _new_request(self, first_tokens: int) -> None:
        """A new request's first verdict: the last one's partial phase is a measurement (once ``_measured``), and
        this request's rates are judged from its own start. Entering a drafting mode costs again (the drafter catches
        up on the new prompt), so the mode is chosen anew on this request's evidence, with that entry priced: not on
        the last request's, whose text set its drafting modes' rates (on shared cores a client entered its first
        request in lock-step rounds at the 47 tokens/s of the one tree that closed the warm-up, and ran it at 0.81x
        of cloud-only decoding; 2026-12-03)."""
        ended = self._request_tokens - first_tokens
        if ended > 0:
            self._tokens_per_request = moved(self._tokens_per_request, ended, self.config.rate_memory)
        self._request_tokens, self._entry_paid = first_tokens, False
        if self._measured():
            self._end_phase()  # (a probe it starts runs; else the favourite is chosen again below)
        else:  # too short to say anything: a probe cut here is dropped, not carried into another text
            self._new_phase()
            self.mode = self._favourite
        self._catch_up_credit_ms = 0.0
        self.req = RequestEvidence()
        if self.mode != self._favourite:  # (a probe runs)
            return
        # the first token streamed in cloud-only decoding: a drafting favourite the drafter must first catch up for
        # is entered as any switch is, and must beat cloud-only decoding by the hysteresis, its entry priced. With
        # the favourite as the incumbent, lock-step rounds entering at 36-37 tokens/s (entry priced at 0.4 s) held
        # against cloud-only's 37.7 inside the 5 % band; the entry lost 0.56 s and the request ran at 0.78x of
        # cloud-only decoding (shared cores, 2026-12-04).
        cold = "plain" in self.modes and self._pending >= CATCH_UP_MIN
        incumbent = "plain" if cold else self._favourite
        best = self._best_mode(incumbent)
        if best != self._favourite:
            self._favourite = self.mode = best
            self._reset_schedule()
        self._decided("request", best, pending=self._pending, incumbent=incumbent)

    def _entering_rate(self, mode: str) -> float:
        """``mode``'s rate over the rest of this request, counting what entering it costs: a drafting mode, unless
        the drafter is caught up, loses ``_entry_ms`` first. The drafter catches up on what it has not seen (a
        new prompt, the tokens streamed since) while the verifier decodes alone beside it; on shared cores that run
        is 2-6x slower than cloud-only decoding, and it is paid again on every prompt: a client whose rounds read
        42 tokens/s against 33 started requests in them and lost them at 0.81x (2026-12-03). Measured on entries
        into ``rounds`` (whose trees alone are its clock) and charged to both drafting modes (the same catch-up),
        over the requests' running length less the tokens already committed (at least a phase)."""
        rate = self.rate_now(mode)
        entry_ms = self._entry_due_ms(mode)
        if not entry_ms or rate <= 0:
            return rate
        left = max(float(self.config.phase_tokens), (self._tokens_per_request or 0.0) - self._request_tokens)
        return left / (left / rate + entry_ms / 1000)

    def _drafters_time(self, r: Round) -> bool:
        """A token cloud-only decoding made while the drafter worked beside it (the last mode's tree or catch-up
        finishing, a shadow chain) before that slowdown is measured: its time is the drafter's, which
        ``_plain_clock`` takes out only once measured, so it is not on the clock (a probe runs until
        ``probe_tokens`` tokens made with the drafter idle). A cloud-cost client's 8-token probes of cloud-only
        decoding, each the first tokens after a drafting mode, read 22.7 tokens/s where its phases ran at 32-34;
        lock-step rounds at 28 passed for as fast and ran a request at 0.72x of cloud-only (shared cores,
        2026-12-03)."""
        return self.mode == "plain" and r.streamed and r.overlapped and self.interference is None

    def _measured(self) -> bool:
        """The phase's clock is a measurement: ``probe_tokens`` tokens over ``probe_verdicts`` verdicts. One lock-step
        tree commits up to 13 tokens, and the rate of a lucky one (47 tokens/s, where the mode ran at 30) became
        the mode's first measured rate."""
        return self._phase[0] >= self.config.probe_tokens and len(self._recent) >= self.config.probe_verdicts

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

    def _losing_phase(self) -> bool:
        """A probe clearly below its reference; or the favourite clearly below what another mode measured last
        (the workload changed, e.g. from code to chat: re-decide now, not at the end of the phase)."""
        if self.mode == "draft" and self.draft_speedup() is not None:  # counted on this text, not clocked
            counted = self.rate_now("draft")
            tokens, ms = self._phase[0], self._phase[1]
            unmeasured = self.draft_saved() is None and self.interference is None
            if (unmeasured or not self.overlap_ok) and self._measured() and ms > 0:
                # priced by its chains' replay, at forwards timed with no drafter beside them: a drafter that slows
                # them (shared cores) is not in it until measured, and the clock shows it (a cloud-cost client,
                # which had not streamed alone, ran a chat's streamed trees at 9 tokens/s for a whole phase
                # priced at 32, cloud-only decoding 23; 2026-12-03); once measured to slow them, the count still
                # misses the time lost between forwards (``rate_now``)
                counted = min(counted, 1000 * tokens / ms)
            if self.mode != self._favourite:
                return self._measured() and counted < self.config.abort_ratio * self._reference_rate()
            others = max((self.rate_now(m) for m in self.modes if m != "draft"), default=0.0)
            return counted < self.config.abort_ratio * others  # re-decide, not a collapse
        if self.mode != self._favourite:
            tokens, ms, _, overlapped = self._phase
            if not self._measured() or ms <= 0:
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
        self._phase, self._recent, self._phase_entry = [0, 0.0, 0.0, 0.0], [], [0, 0.0, 0.0]
        self._phase_pending = self._pending
        self._phase_tries, self._phase_chains, self._phase_shapes, self._phase_trees = [], 0, [], 0

    def _decided(self, kind: str, chose: str, **ran: object) -> None:
        self.decisions_made += 1
        self.decisions.append(
            {
                "kind": kind,
                "mode": self.mode,
                "favourite": self._favourite,
                "chose": chose,
                "request_chains": self.req.chains,
                **ran,
                "rates_now": {m: round(self.rate_now(m), 2) for m in self.modes},
                **(
                    {"costs_now": {m: round(self.cost_now(m), 1) for m in self.modes}}
                    if self.objective == "cloud_cost"
                    else {}
                ),
                "calibration": {m: round(c, 3) for m, c in self.calibration.items()},
                "entry_loss_ms": round(self.entry_loss_ms, 1) if self.entry_loss_ms is not None else None,
                "entry_ms": round(e, 1) if (e := self._entry_ms()) is not None else None,
                **self._draft_evidence(),
            }
        )

    def _draft_evidence(self) -> dict:
        """What the drafting modes' rates stood on (decision log): the streamed mode's trees' account, and each
        mode's plan from this request's chains (value, depth, verifier ms per token)."""
        evidence: dict = {}
        if "draft" in self.modes:
            saved = self.draft_saved()
            tokens, _, trees = self.req.draft_account
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
        # its entry: tokens decoded alone while the drafter caught up, their ms, what it had to catch up on, and
        # the ms it drafted its first tree in
        entry = [
            self._phase_entry[0],
            round(self._phase_entry[1], 1),
            self._phase_pending,
            round(self._phase_entry[2], 1),
        ]
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
                **(
                    {"entry": entry, "catch_up_ms_per_token": round(self.est.catch_up_ms_per_token, 2)}
                    if entry[0]
                    else {}
                ),
            )

    def _close_phase(self) -> None:
        tokens, raw_ms, verify_ms, overlapped = self._phase
        ms = self._plain_clock(raw_ms, overlapped)
        collapsed, self._collapsed = self._collapsed, False
        # a phase before this request's re-check drafted the last request's shapes (its trees were shaped on that
        # text's acceptance): it calibrates the model and moves the client-wide rates, but it is not this text's
        # clock (the mode is priced by the model, at this text's acceptance, for the shape it will draft)
        foreign, self._phase_foreign = self._phase_foreign or not self.req.rechecked, False
        tries, chains, shapes, trees = self._phase_tries, self._phase_chains, self._phase_shapes, self._phase_trees
        entry_tokens, entry_ms, entry_tree_ms = self._phase_entry
        entry_pending = self._phase_pending
        self._new_phase()
        if ms <= 0:
            return
        self.req.ran[self.mode] = self.req.ran.get(self.mode, 0) + int(tokens)
        if not foreign:
            here = self.req.rates.setdefault(self.mode, [0, 0.0, 0.0])
            here[0], here[1], here[2] = here[0] + tokens, here[1] + ms, here[2] + verify_ms
        rate = self.rates[self.mode]
        before = rate.tokens_per_s
        w = 1.0 if not rate.measured_ms or collapsed else self.config.rate_memory
        rate.add(self._phase_rate(tokens, ms), verify_ms / tokens, ms, w)
        plan = self._draft_plan() if self.mode == "draft" and not trees else None
        if plan is not None and plan.shape is None and tokens >= self.config.probe_tokens:
            self._measured_plain(tokens, self._idle_clock(raw_ms, overlapped), verify_ms)
        if self.mode == "rounds" and entry_tokens and (plain := self._plain_rate()):
            lost = max(0.0, entry_ms - 1000 * entry_tokens / plain)
            self.entry_loss_ms = moved(self.entry_loss_ms, lost, self.config.rate_memory)
            if self.est.catch_up_n and (work := self._entry_work_ms(entry_pending, entry_tree_ms)) > 0:
                self.entry_ratio = moved(self.entry_ratio, min(2.0, lost / work), self.config.rate_memory)
        if collapsed and self.mode != "plain":
            self.req.collapsed = True
            if not foreign:
                self.req.rates[self.mode] = [tokens, ms, verify_ms]  # (the window alone, as for the rate)
        if collapsed and self.mode != "plain" and before > 0:
            fall = min(1.0, rate.tokens_per_s / before)  # acceptance fell: every drafting mode falls with it
            for m, other in self.rates.items():
                if m not in (self.mode, "plain"):
                    other.tokens_per_s *= fall
                    if m in self.req.rates:
                        self.req.rates[m][1] /= max(fall, 1e-3)
        was_exploring = self.mode != self._favourite
        predicted, self._probe_predicted = self._probe_predicted, None
        if self.mode != "plain" and chains >= self.config.shadow_min:  # the model at the acceptance this phase's
            predicted = self._model_rate(self.mode, tries, shapes)  # own trees met (code and chat alike)
        elif not was_exploring:
            predicted = None  # (else a probe's prediction from the shadow chains before it)
        if predicted and self.mode != "plain":  # the model against the clock, for this mode
            ratio = min(10.0, max(0.1, 1000 * tokens / ms / predicted))
            self.calibration[self.mode] = moved(self.calibration.get(self.mode), ratio, w)  # a collapse: as it is
        self._charge_probe(was_exploring, ms + entry_ms, tokens + entry_tokens)
        unmeasured = [m for m in self.modes if not self.rates[m].measured_ms and self._first_probe_due(m)]
        if unmeasured:
            self._start_probe(unmeasured[0])
            return
        best = self._best_mode()
        if best != self._favourite:
            self._favourite = best
            self._reset_schedule()
        elif was_exploring:  # the other mode lost again: look at it less often
            self._back_off()
        probe = self._probe_due()
        if probe is not None:
            self._start_probe(probe)
        else:
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
        if counted is None:
            return 1000 * tokens / ms
        return counted if self.overlap_ok else min(counted, 1000 * tokens / ms)  # (see ``rate_now``)

    def _best_mode(self, incumbent: str | None = None) -> str:
        """The mode to run, each priced over the rest of the request with its entry; a challenger must beat the
        ``incumbent`` (default: the favourite) by the hysteresis."""
        h, fav = self.config.hysteresis, incumbent or self._favourite
        now = {m: self._entering_rate(m) for m in self.modes}
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
