"""A virtual clock: callbacks at simulated times, in order (ties in the order they were scheduled)."""
from __future__ import annotations

import heapq
import itertools
from typing import Callable


class Sim:
    def __init__(self):
        self.now = 0.0  # seconds
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._ids = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (max(t, self.now), next(self._ids), fn))

    def after(self, seconds: float, fn: Callable[[], None]) -> None:
        self.at(self.now + seconds, fn)

    def run(self, until: float = float("inf")) -> None:
        while self._queue and self._queue[0][0] <= until:
            self.now, _, fn = heapq.heappop(self._queue)
            fn()
        self.now = max(self.now, min(until, self.now if not self._queue else until))


class Link:
    """One direction of a network path (a ``bench.linkproxy.LinkProfile``): each message takes the one-way delay
    plus jitter, a lost one a retransmission timeout more, and none overtakes the one before it (a TCP stream keeps
    order)."""

    def __init__(self, sim: Sim, profile, rng):
        self.sim, self.p, self.rng = sim, profile, rng
        self._last = 0.0

    def send(self, fn: Callable[[], None]) -> None:
        p = self.p
        delay = p.one_way_ms + (self.rng.uniform(-p.jitter_ms, p.jitter_ms) if p.jitter_ms else 0.0)
        if p.loss and self.rng.random() < p.loss:
            delay += p.rto_ms
        self._last = max(self._last, self.sim.now + max(0.0, delay) / 1000)
        self.sim.at(self._last, fn)
