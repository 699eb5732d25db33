"""Which finished sequences' KV a verifier engine keeps, so the next turn of a conversation does not prefill its
whole history again.

A chat's turn n + 1 starts with turn n's prompt and answer: with the cache, its prefill costs the new user message,
not the conversation (``bench.multiturn``). Pure bookkeeping, no engine calls: the engine
(cloud/engines/llama_engine.py) owns a few spare KV sequence ids ("slots"); when a session ends, ``store`` says which
slot to copy its committed tokens into (and which old entries to drop first), and at a new session's prefill ``lookup``
names the slot holding the longest common prefix of its prompt, which the engine copies into the session instead of
computing it.

Entries belong to a partition (``core.tenancy``): a lookup only ever finds entries of its own partition, so a hit
never tells one tenant what another's conversation held. Eviction is least-recently-used across partitions,
bounded by slots and by ``budget_tokens`` (KV cells the engine reserved for the cache). An entry that is a prefix
of a newer one of its partition is replaced by it (the newer one serves every prompt the older did, and more); a
sequence that is a prefix of an entry adds nothing and is not stored.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

from tandem.core.tenancy import SHARED
from tandem.core.tree import common_prefix


@dataclass
class _Entry:
    slot: int
    tokens: tuple[int, ...]
    used: int  # logical clock of the last store or hit
    partition: str = SHARED


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0  # prompt tokens copied from the cache instead of prefilled
    stored: int = 0
    evicted: int = 0


@dataclass
class PrefixCache:
    slots: Sequence[int]  # KV sequence ids reserved for cached prefixes
    budget_tokens: int  # most cached tokens in all (the KV cells reserved for them)
    min_tokens: int = 32  # shorter prefixes are not worth a slot (or a copy)
    stats: PrefixStats = field(default_factory=PrefixStats)

    def __post_init__(self):
        self._entries: list[_Entry] = []
        self._clock = 0
        self._lock = threading.Lock()

    def lookup(self, tokens: Sequence[int], partition: str = SHARED) -> tuple[int | None, int]:
        """(slot, n): the entry of ``partition`` sharing the longest prefix with ``tokens`` and that prefix's length,
        or (None, 0) when none shares ``min_tokens``."""
        with self._lock:
            self.stats.lookups += 1
            best, best_n = None, 0
            for e in self._entries:
                if e.partition != partition:
                    continue
                n = common_prefix(e.tokens, tokens)
                if n > best_n:
                    best, best_n = e, n
            if best is None or best_n < self.min_tokens:
                return None, 0
            self._clock += 1
            best.used = self._clock
            self.stats.hits += 1
            self.stats.reused_tokens += best_n
            return best.slot, best_n

    def peek(self, tokens: Sequence[int], partition: str = SHARED) -> int:
        """The longest prefix of ``tokens`` an entry of ``partition`` holds (0 below ``min_tokens``), without
        counting a lookup or touching recency: for a router asking every replica's record before choosing one."""
        with self._lock:
            n = max((common_prefix(e.tokens, tokens) for e in self._entries if e.partition == partition), default=0)
        return n if n >= self.min_tokens else 0

    def store(self, tokens: Sequence[int], partition: str = SHARED) -> tuple[int | None, list[int]]:
        """(slot, dropped): where to copy a finished sequence's ``tokens`` (None: do not keep it), and the slots
        whose entries are dropped and must be cleared first (the chosen slot may be one of them). An entry of
        ``partition`` the sequence extends is replaced by it; other partitions' entries only age."""
        tokens = tuple(tokens)
        if len(tokens) < self.min_tokens or len(tokens) > self.budget_tokens or not self.slots:
            return None, []
        with self._lock:
            dropped = []
            for e in [e for e in self._entries if e.partition == partition]:
                n = common_prefix(e.tokens, tokens)
                if n == len(tokens):  # already covered by a longer (or equal) entry
                    self._clock += 1
                    e.used = self._clock
                    return None, []
                if n == len(e.tokens):  # the new sequence extends this entry: it replaces it
                    self._entries.remove(e)
                    dropped.append(e.slot)
            # least recently used first, until a slot and the tokens fit
            self._entries.sort(key=lambda e: e.used)
            while self._entries and (len(self._entries) >= len(self.slots) or
                                     sum(len(e.tokens) for e in self._entries) + len(tokens) > self.budget_tokens):
                dropped.append(self._entries.pop(0).slot)
            free = [s for s in self.slots if s not in {e.slot for e in self._entries}]
            self._clock += 1
            self._entries.append(_Entry(free[0], tokens, self._clock, partition))
            self.stats.stored += 1
            self.stats.evicted += len(dropped)
            return free[0], dropped

    def clear(self) -> list[int]:
        """Drop every entry; returns their slots (for the engine to clear)."""
        with self._lock:
            slots = [e.slot for e in self._entries]
            self.stats.evicted += len(slots)
            self._entries = []
            return slots

    @property
    def cached_tokens(self) -> int:
        with self._lock:
            return sum(len(e.tokens) for e in self._entries)

    def __len__(self) -> int:
        return len(self._entries)
