"""The exploration schedule of the draft policy (``orchestrator.policy``): when it measures a mode other than its
favourite (a probe), and what a probe may cost the user.

A probe of a mode slower than the favourite loses tokens * (1/rate - 1/favourite rate). The schedule re-measures
the other modes one phase at a time, at intervals that double (``explore_every`` up to ``explore_max``) while
they keep losing, and only once the favourite has run long enough that the last probes' loss, their entries
included, is at most ``explore_budget`` of the time (``_charge_probe``; 1 s lost at 3 % waits 33 s). A probe
whose entry is priced, or of an unmeasured mode the last text's shadow chains predicted to lose, also pays that
from the budget before it runs (``_probe_affordable``). This request's own shadow chains skip a probe predicted to
lose (``_worth_probing``, ``gate_skips`` times in a row at most) and call one predicted to win at once
(``_predicts_win``). Which mode is the favourite is the policy's decision (``DraftPolicy._best_mode``); this
class keeps the schedule state and answers which probe, if any, is due.
"""

from __future__ import annotations

from .costmodel import Estimates
from .policy_config import PolicyConfig
from .pricing import ModePricing


class ExplorationSchedule(ModePricing):
    """The probe schedule's state and rules; ``DraftPolicy`` runs the phases and sets ``mode`` and ``_favourite``."""

    mode: str  # the phase being measured now (a probe when it is not the favourite)
    _favourite: str
    _entry_paid: bool  # the drafting mode in force has sent a tree in this request (its entry is paid)

    def __init__(self, config: PolicyConfig, estimates: Estimates, objective: str, modes: tuple[str, ...]):
        super().__init__(config, estimates, objective, modes)
        self._explore_every = config.explore_every  # phases between probes ...
        self._since_explore = 0  # ... and the favourite's phases since the last
        self._since_explore_ms = 0.0  # the favourite's time since the last probe ...
        self._explore_wait_ms = 0.0  # ... and how long the budget says it must be before the next
        self.explore_loss_ms = 0.0  # time probes lost against the favourite's rate (reported by benches)
        self._gated: dict[str, int] = {}  # probes of each mode skipped in a row on the shadow's prediction
        self._gate_lost: dict[str, float] = {}  # unmeasured modes the last text's chains predicted to lose, and at what
        self._probe_predicted: float | None = None  # what the model predicted of the probe running now
        self.skipped_probes = 0  # probes the shadow chains skipped as predicted losers, and probes they called
        self.called_probes = 0

    def _reset_schedule(self) -> None:
        """A new favourite: the other modes are looked at again after ``explore_every`` phases, no wait owed."""
        self._explore_every, self._explore_wait_ms = self.config.explore_every, 0.0

    def _back_off(self) -> None:
        """Another probe lost (or was skipped as a predicted loser): look at the other modes half as often."""
        self._explore_every = min(self.config.explore_max, 2 * self._explore_every)

    def _charge_probe(self, was_exploring: bool, ms: float, tokens: float) -> None:
        """A phase of ``ms`` and ``tokens`` (its entry included) closed: a probe's loss against the reference rate
        is owed to the budget; a favourite's phase pays it off."""
        ref = self._reference_rate()
        if was_exploring and ref > 0:  # what this probe cost the user against the reference mode, its entry too
            loss = max(0.0, ms - 1000 * tokens / ref)
            self.explore_loss_ms += loss
            # probes in a row (no favourite phase between them) add up: the wait pays for all of them
            carry = self._explore_wait_ms if self._since_explore_ms == 0 else 0.0
            self._explore_wait_ms, self._since_explore_ms = carry + loss / self.config.explore_budget, 0.0
        else:
            self._since_explore_ms += ms

    def _probe_due(self) -> str | None:
        """After a favourite's phase (or a probe): the mode to probe next, or None. One this request's own chains
        predict to win is called at once, whatever the wait; else, once ``explore_every`` phases and the budget's
        wait have passed, the least measured of the modes whose entry the budget pays, unless this request's chains
        predict every one to lose (a skipped probe counts as a lost one, without the loss)."""
        self._since_explore += 1
        others = [m for m in self.modes if m != self._favourite and not self._ruled_out(m)]
        called = [m for m in others if self._predicts_win(m)]
        if called:  # this request's own text says another mode wins now: measure it at once, whatever the wait
            self.req.called.add(called[0])
            self.called_probes += 1
            self._since_explore = 0
            return called[0]
        scheduled = self._since_explore >= self._explore_every and self._since_explore_ms >= self._explore_wait_ms
        due = [m for m in others if self._probe_affordable(m)] if scheduled else []  # (each prices an entry)
        if not due:
            return None
        self._since_explore = 0
        worth = [m for m in due if self._worth_probing(m)]
        if worth:
            mode = min(worth, key=lambda m: self.rates[m].measured_ms)  # the least measured
            self._gated[mode] = 0
            return mode
        self.skipped_probes += 1
        self._back_off()
        for m in due:
            self._gated[m] = self._gated.get(m, 0) + 1
        return None

    def _reference_rate(self) -> float:
        """The rate a probe is held against: the favourite's (latency), cloud-only decoding's (cloud cost: a mode
        slower than it is never taken)."""
        return self.rate_now(self._favourite) if self.objective == "latency" else self._cloud_only_rate()

    def _entry_due_ms(self, mode: str) -> float | None:
        """What entering ``mode`` now costs (``_entry_ms``, None: unpriced): nothing for cloud-only decoding, nor for
        the drafting mode in force once its trees flow in this request; any other drafting mode is priced on the
        drafter's backlog now. (The streamed mode on shared cores sends few trees, and its drafter fell 79 tokens
        behind: taken as caught up, lock-step rounds were entered from it at a code text's 42.5 tokens/s on a chat,
        lost 0.44 s entering and ran at 13; 2026-12-04.)"""
        if mode == "plain" or (mode == self.mode and self._entry_paid):
            return None
        return self._entry_ms(mode)

    def _start_probe(self, mode: str) -> None:
        """Measure ``mode`` now; what the model predicts of it (uncalibrated, from this request's chains) is kept,
        to calibrate the model by when the probe ends."""
        self.mode = mode
        enough = self.req.chains >= self.config.shadow_min
        self._probe_predicted = self._model_rate(mode, self.req.tries) if enough else None  # uncalibrated

    def _worth_probing(self, mode: str) -> bool:
        """Not a mode this request's shadow predicts clearly below the reference rate; but every mode skipped
        ``gate_skips`` times in a row (a mispredicting model must not lock a mode out)."""
        if self._ruled_out(mode):
            return False
        predicted, ref = self.predicted_rate(mode), self._reference_rate()
        if predicted is None or ref <= 0 or self._gated.get(mode, 0) >= self.config.gate_skips:
            return True
        return predicted >= self.config.probe_gate * ref

    def _probe_affordable(self, mode: str) -> bool:
        """A probe of ``mode`` pays what it is expected to lose from the exploration budget before it runs: the
        favourite's time since the last probe must cover, at ``explore_budget``, its entry (``_entry_due_ms``) and,
        for an unmeasured mode the last text's chains predicted to lose, its ``probe_tokens`` at that rate. On
        shared cores entering lock-step rounds on a cold 150-195-token prompt lost 0.9 s, and the probes the
        schedule then called ran the first request after the warm-up at 0.71-0.82x of cloud-only decoding; paying
        for their entry alone, they came on a short chat, entered cheaply and lost twice their entry there (0.5 s,
        the request at 0.82x, three runs; 2026-12-04). Where entries cost nothing and nothing was predicted (the
        drafter on its own cores, or caught up) nothing changes."""
        cost = (self._entry_due_ms(mode) or 0.0) + self._predicted_probe_loss_ms(mode)
        return cost <= self.config.explore_budget * self._since_explore_ms

    def _predicted_probe_loss_ms(self, mode: str) -> float:
        """What ``probe_tokens`` of unmeasured ``mode`` lose against the reference rate, at the rate the last
        text's chains predicted (``_gate_lost``); 0 for a measured mode, or one never predicted to lose."""
        last, ref = self._gate_lost.get(mode), self._reference_rate()
        if last is None or self.rates[mode].measured_ms or ref <= 0:
            return 0.0
        return self.config.probe_tokens * 1000 * max(0.0, 1 / max(last, 1e-3) - 1 / ref)

    def _first_probe_due(self, mode: str) -> bool:
        """Whether to measure unmeasured ``mode`` now: at once, unless this request's shadow chains predict it to
        lose (``_worth_probing``), or, with none on this text (shadow chains are off where the drafter slows the
        verifier), the last text's did, in which case its probe waits for the budget (``_probe_affordable``)."""
        predicted = self.predicted_rate(mode)
        if not self._worth_probing(mode):
            if predicted is not None:
                self._gate_lost[mode] = predicted
            return False
        if predicted is not None:  # this text says it may win
            self._gate_lost.pop(mode, None)
            return True
        return mode not in self._gate_lost or self._probe_affordable(mode)

    def _predicts_win(self, mode: str) -> bool:
        """Latency: this request's shadow predicts ``mode`` faster than the favourite by the hysteresis."""
        if (
            self.objective != "latency"
            or mode in self.req.called
            or not self.rates[self._favourite].measured_ms
            or self.req.rates.get(mode, (0, 0.0, 0.0))[0] >= self.config.probe_tokens  # the clock on this text
            or self._ruled_out(mode)
        ):
            return False
        predicted = self.predicted_rate(mode)
        return predicted is not None and predicted > self.rate_now(self._favourite) * (1 + self.config.hysteresis)
