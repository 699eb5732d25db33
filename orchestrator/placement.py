"""Session -> replica placement: least loaded on open, sticky after, capacity enforced. Pure and deterministic.

The orchestrator owns this map (DESIGN.md: best-effort routers are not used for it). A replica's load is the
number of sessions placed on it; ties go to the lowest replica name, so placement is reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class NoCapacity(Exception):
    """Every live replica is at its session limit."""


class NoReplica(NoCapacity):
    """No replica is alive at all: unavailable, not full."""


@dataclass
class Placement:
    capacity: dict[str, int]  # replica name -> most sessions it takes
    sessions: dict[str, str] = field(default_factory=dict)  # session id -> replica name
    dead: set[str] = field(default_factory=set)

    def load(self, replica: str) -> int:
        return sum(1 for r in self.sessions.values() if r == replica)

    def place(self, session: str) -> str:
        """Sticky: an already placed session stays where it is (while its replica lives)."""
        current = self.sessions.get(session)
        if current is not None and current not in self.dead:
            return current
        live = [r for r in sorted(self.capacity) if r not in self.dead and self.load(r) < self.capacity[r]]
        if not live:
            alive = [r for r in self.capacity if r not in self.dead]
            if not alive:
                raise NoReplica("no live verifier replica (replacements are starting); retry shortly")
            raise NoCapacity(f"all {len(alive)} live verifier replicas are full "
                             f"({sum(self.capacity[r] for r in alive)} sessions); retry later")
        best = min(live, key=lambda r: (self.load(r), r))
        self.sessions[session] = best
        return best

    def release(self, session: str) -> None:
        self.sessions.pop(session, None)

    def add(self, replica: str, capacity: int) -> None:
        """A new (replacement) replica joins."""
        self.capacity[replica] = capacity

    def live_capacity(self) -> int:
        return sum(c for r, c in self.capacity.items() if r not in self.dead)

    def mark_dead(self, replica: str) -> list[str]:
        """Forget a lost replica; returns the sessions that were on it (they must be re-opened elsewhere)."""
        self.dead.add(replica)
        lost = [s for s, r in self.sessions.items() if r == replica]
        for s in lost:
            del self.sessions[s]
        return lost
