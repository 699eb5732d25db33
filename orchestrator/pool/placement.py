"""Session -> replica placement: cache-aware, else least loaded, on open; sticky after; capacity enforced. Pure
and deterministic.

The orchestrator owns this map (docs/design.md, "Cloud pool": best-effort routers are not used for it). A
replica's load is the number of sessions placed on it; ties go to the lowest replica name, so placement is
reproducible.

Cache-aware routing (as SGLang's router does): each replica keeps the histories of finished sessions in its prefix
cache (cloud/caches/prefix_cache.py), so the next turn of a conversation prefills only its new message *on the replica
that served the last turn*. Placement keeps an approximate record of what each replica holds: the prompts it
opened there, in a ``PrefixCache`` of the replica's own size (a turn's prompt is a prefix of what the replica
stores when the turn ends, so the next turn's prompt matches it). A new session goes to the replica whose record
shares the longest prefix with its prompt, when that prefix is at least ``min_prefix_share`` of the prompt (a
later turn, not a new conversation sharing a system prompt) and ``min_prefix_tokens`` longer than what the least
loaded replica's record shares; unless that replica carries more than
``balance_slack`` sessions above the least loaded one: locality never piles sessions onto one replica. The record
can be stale (the replica evicted the entry, or was restarted): that costs a prefill, never a wrong token.
Records are partitioned as the replicas' caches are (core.tenancy): a prompt is only routed by prefixes its own
partition opened, so where a session lands (and how fast its prefill is) says nothing of another tenant's prompts.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from tandem.cloud.caches.prefix_cache import PrefixCache


class NoCapacity(Exception):
    """Every live replica is at its session limit."""


class NoReplica(NoCapacity):
    """No replica is alive at all: unavailable, not full."""


@dataclass
class Placement:
    capacity: dict[str, int]  # replica name -> most sessions it takes
    sessions: dict[str, str] = field(default_factory=dict)  # session id -> replica name
    dead: set[str] = field(default_factory=set)
    remember: int = 8  # prompts recorded per replica (the llama.cpp engine keeps 8 cached prefixes); 0: no routing
    min_prefix_tokens: int = 32  # a shorter shared prefix is not worth leaving the least loaded replica
    min_prefix_share: float = 0.5  # ... and neither is one under this share of the prompt (a new conversation's)
    balance_slack: int = 2  # most sessions a cache hit may carry above the least loaded replica
    prefix_routed: int = 0  # sessions placed by their prefix, not by load

    def __post_init__(self):
        self._records = {r: self._record() for r in self.capacity}
        self._load = Counter(self.sessions.values())  # kept with ``sessions``: placing is O(replicas), not O(sessions)

    def _record(self) -> PrefixCache:
        return PrefixCache(range(self.remember), budget_tokens=1 << 40, min_tokens=self.min_prefix_tokens)

    def load(self, replica: str) -> int:
        return self._load[replica]

    def place(self, session: str, prompt: Sequence[int] = (), partition: str = "") -> str:
        """Sticky: an already placed session stays where it is (while its replica lives). A new one goes where
        its ``prompt``'s longest prefix of its ``partition`` is cached (within ``balance_slack``), else to the
        least loaded."""
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
        if prompt and self.remember:
            floor = self.load(best) + self.balance_slack
            hits = [(self._records[r].peek(prompt, partition), r) for r in live if self.load(r) <= floor]
            n, warm = min(hits, key=lambda h: (-h[0], self.load(h[1]), h[1]))  # longest, then least loaded
            if warm != best and n >= self.min_prefix_share * len(prompt) and \
                    n - self._records[best].peek(prompt, partition) >= self.min_prefix_tokens:
                best = warm
                self.prefix_routed += 1
        if current is not None:
            self._load[current] -= 1
        self.sessions[session] = best
        self._load[best] += 1
        return best

    def opened(self, replica: str, prompt: Sequence[int], partition: str = "") -> None:
        """A session of ``partition`` opened on ``replica`` with ``prompt``: the replica will hold it (and the
        session's answer) in its prefix cache when the session ends. Recorded after the open, so a refused prompt
        is never recorded."""
        if self.remember and replica in self._records and replica not in self.dead:
            self._records[replica].store(prompt, partition)

    def release(self, session: str) -> None:
        replica = self.sessions.pop(session, None)
        if replica is not None:
            self._load[replica] -= 1

    def add(self, replica: str, capacity: int) -> None:
        """A new (replacement) replica joins."""
        self.capacity[replica] = capacity
        self._records[replica] = self._record()

    def live_capacity(self) -> int:
        return sum(c for r, c in self.capacity.items() if r not in self.dead)

    def mark_dead(self, replica: str) -> list[str]:
        """Forget a lost replica; returns the sessions that were on it (they must be re-opened elsewhere)."""
        self.dead.add(replica)
        self._records.pop(replica, None)  # its cache died with it
        lost = [s for s, r in self.sessions.items() if r == replica]
        for s in lost:
            del self.sessions[s]
        self._load.pop(replica, None)
        return lost
