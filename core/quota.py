"""Per-key limits: work at once and tokens per minute, for the REST gateway (generations, prompt + completion
tokens) and the gRPC verifier (sessions, prefill tokens) alike.

Tokens are metered with a token bucket per key (capacity = one minute's budget, refilled continuously). Work is
admitted while the bucket covers what it reserves (its cost, capped at one minute's budget, so that no request is
refused forever), and then the bucket is charged the whole cost: a request larger than the budget runs once and
leaves the bucket in debt, and the key waits until the debt is refilled. ``Lease.charge`` adds cost found after
admission (a prompt tokenized once the quota was taken); ``Lease.release`` settles the reservation against what
was used, both ways: unused tokens come back, tokens beyond the reservation are charged. A limit that refuses says
which it was (``QuotaExceeded.limit``) and when to retry. ``KeyLimits()``: no limits.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KeyLimits:
    concurrency: int = 0  # work at once per key (generations, sessions); 0: unlimited
    tokens_per_minute: int = 0  # metered tokens per key and minute; 0: unlimited


@dataclass(frozen=True)
class Units:
    """How refusals name things: whose limit, what runs, what is metered, and the settings that raise them."""

    who: str = "this API key"
    running: str = "generations"
    metered: str = "tokens"
    concurrency_setting: str = "--key-concurrency"
    tokens_setting: str = "--key-tokens-per-minute"


class QuotaExceeded(Exception):
    def __init__(self, message: str, retry_after_s: int, limit: str):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.limit = limit  # "concurrency" | "tokens_per_minute"


@dataclass
class _Account:
    running: int = 0
    tokens: float = 0.0  # bucket level; below zero: debt
    at: float = field(default_factory=time.monotonic)


class Quotas:
    def __init__(self, limits: KeyLimits = KeyLimits(), clock=time.monotonic, units: Units = Units()):
        self.limits, self._clock, self.units = limits, clock, units
        self._accounts: dict[str, _Account] = {}
        self._lock = threading.Lock()

    def acquire(self, key: str, tokens: int, slot: bool = True) -> "Lease":
        """Admit one unit of work reserving ``tokens`` for ``key``, or raise ``QuotaExceeded``. ``slot`` False:
        metered only, not counted against the concurrency limit (a tokenization)."""
        lim, u = self.limits, self.units
        with self._lock:
            a = self._accounts.get(key)
            if a is None:
                a = self._accounts[key] = _Account(tokens=float(lim.tokens_per_minute), at=self._clock())
            if slot and lim.concurrency and a.running >= lim.concurrency:
                raise QuotaExceeded(
                    f"{u.who} already runs {a.running} {u.running}, its limit "
                    f"({u.concurrency_setting}); retry when one ends",
                    1,
                    "concurrency",
                )
            self._take(a, tokens)
            a.running += slot
            return Lease(self, key, tokens, slot)

    def _take(self, a: _Account, tokens: int) -> None:
        """Charge ``tokens`` if the bucket covers them (capped at its capacity), else refuse (lock held)."""
        lim, u = self.limits, self.units
        if not lim.tokens_per_minute or tokens <= 0:
            return
        rate = lim.tokens_per_minute / 60.0
        now = self._clock()
        a.tokens = min(float(lim.tokens_per_minute), a.tokens + (now - a.at) * rate)
        a.at = now
        need = min(tokens, lim.tokens_per_minute)
        if a.tokens < need:
            raise QuotaExceeded(
                f"{u.who}'s budget of {lim.tokens_per_minute} {u.metered} per minute "
                f"({u.tokens_setting}) does not cover {need} more now; retry later"
                + (" or ask for fewer max_tokens" if u.running == "generations" else ""),
                max(1, math.ceil((need - a.tokens) / rate)),
                "tokens_per_minute",
            )
        a.tokens -= tokens

    def _charge(self, key: str, tokens: int) -> None:
        with self._lock:
            self._take(self._accounts[key], tokens)

    def _release(self, key: str, reserved: int, used: int, slot: bool) -> None:
        with self._lock:
            a = self._accounts[key]
            a.running -= slot
            if self.limits.tokens_per_minute:  # unused tokens back, tokens beyond the reservation charged
                a.tokens = min(float(self.limits.tokens_per_minute), a.tokens + reserved - used)


class Lease:
    def __init__(self, quotas: Quotas, key: str, reserved: int, slot: bool = True):
        self._quotas, self._key, self._reserved, self._open, self._slot = quotas, key, reserved, True, slot

    @property
    def reserved(self) -> int:
        return self._reserved

    def charge(self, tokens: int) -> None:
        """Charge ``tokens`` more now (raises ``QuotaExceeded`` when the bucket does not cover them; the lease
        then still holds what it had)."""
        if self._open and tokens > 0:
            self._quotas._charge(self._key, tokens)
            self._reserved += tokens

    def release(self, used_tokens: int) -> None:
        """End the work: it used ``used_tokens`` of everything metered, charged or reserved."""
        if self._open:
            self._open = False
            self._quotas._release(self._key, self._reserved, used_tokens, self._slot)
