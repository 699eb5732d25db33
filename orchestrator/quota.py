"""Per-key limits of the REST gateway: concurrent generations and tokens per minute, answered with 429 +
Retry-After when exceeded.

Tokens are metered with a token bucket per key (capacity = one minute's budget, refilled continuously): a request
reserves its ``max_tokens`` up front and gives back what it did not generate when it ends, so a key cannot start
more work than its budget covers. Defaults (``KeyLimits()``): no limits; ``tandem serve --key-concurrency``,
``--key-tokens-per-minute`` (``TANDEM_KEY_CONCURRENCY``, ``TANDEM_KEY_TOKENS_PER_MINUTE``) set them for every key.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KeyLimits:
    concurrency: int = 0  # generations at once per key; 0: unlimited
    tokens_per_minute: int = 0  # completion tokens per key and minute; 0: unlimited


class QuotaExceeded(Exception):
    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class _Account:
    running: int = 0
    tokens: float = 0.0  # bucket level
    at: float = field(default_factory=time.monotonic)


class Quotas:
    def __init__(self, limits: KeyLimits = KeyLimits(), clock=time.monotonic):
        self.limits, self._clock = limits, clock
        self._accounts: dict[str, _Account] = {}
        self._lock = threading.Lock()

    def acquire(self, key: str, max_tokens: int) -> "Lease":
        """Reserve one generation of up to ``max_tokens`` for ``key``, or raise ``QuotaExceeded``."""
        lim = self.limits
        with self._lock:
            a = self._accounts.get(key)
            if a is None:
                a = self._accounts[key] = _Account(tokens=float(lim.tokens_per_minute), at=self._clock())
            if lim.concurrency and a.running >= lim.concurrency:
                raise QuotaExceeded(f"this API key already runs {a.running} generations, its limit; retry when one "
                                    f"ends", 1)
            if lim.tokens_per_minute:
                rate = lim.tokens_per_minute / 60.0
                now = self._clock()
                a.tokens = min(float(lim.tokens_per_minute), a.tokens + (now - a.at) * rate)
                a.at = now
                need = min(max_tokens, lim.tokens_per_minute)
                if a.tokens < need:
                    raise QuotaExceeded(f"this API key's budget of {lim.tokens_per_minute} tokens per minute does "
                                        f"not cover {need} more now; retry later or ask for fewer max_tokens",
                                        max(1, math.ceil((need - a.tokens) / rate)))
                a.tokens -= need
            else:
                need = 0
            a.running += 1
            return Lease(self, key, need)

    def _release(self, key: str, reserved: int, used: int) -> None:
        with self._lock:
            a = self._accounts[key]
            a.running -= 1
            if self.limits.tokens_per_minute:
                a.tokens = min(float(self.limits.tokens_per_minute), a.tokens + max(0, reserved - used))


class Lease:
    def __init__(self, quotas: Quotas, key: str, reserved: int):
        self._quotas, self._key, self._reserved, self._open = quotas, key, reserved, True

    def release(self, used_tokens: int) -> None:
        if self._open:
            self._open = False
            self._quotas._release(self._key, self._reserved, used_tokens)
