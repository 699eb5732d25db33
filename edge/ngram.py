"""Free drafts: prompt lookup over the session's own history, plus a small cross-session cache.

Code edits, quoting and extraction repeat spans of the prompt or of earlier output. If the last ``n`` committed
tokens occurred before, what followed them then is a cheap guess of what follows now (prompt lookup decoding);
failing that, a bounded LRU of n-grams seen in earlier sessions (Hierarchy Drafting's idea of drafting from
several levels of memory) may know. Proposals cost dictionary lookups (microseconds) and are grafted onto the
model drafter's tree as one more branch (``edge.drafting.graft``), so they never replace or delay the model's draft.

Indexing: for every n in [n_min, n_max] and every position p of the history, ``index[n-gram ending at p - 1] = p``
(the later occurrence overwrites the earlier, so lookups find the most recent one). The current suffix is only
indexed once a token follows it, so a lookup never finds itself.

The cross-session cache is partitioned (core.tenancy): a session only finds n-grams that sessions of its own
partition generated, so a gateway's drafter shared by many API keys never drafts one key's text for another.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class NgramDrafter:
    # n_min = 3: two-token matches are mostly coincidences in chat text ("of the"); their rejected branches still
    # cost verifier work for no accepted token (bench.drafter on ShareGPT compares n_min 2 and 3)
    def __init__(self, n_max: int = 4, n_min: int = 3, max_tokens: int = 16, cache_entries: int = 1 << 14):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_max, self.n_min, self.max_tokens = n_max, n_min, max_tokens
        self.cache_entries = cache_entries
        # across sessions (LRU over all partitions): (partition, n-gram) -> what followed it
        self._cache: OrderedDict[tuple[str, tuple[int, ...]], tuple[int, ...]] = OrderedDict()
        self.history: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self._prompt_len = 0
        self._partition = ""

    def start(self, prompt: Sequence[int], partition: str = "") -> None:
        """A new session on ``prompt``, reading and feeding ``partition``'s share of the cross-session cache."""
        self.history, self._index, self._prompt_len, self._partition = [], {}, len(prompt), partition
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        h = self.history
        for tok in tokens:
            p = len(h)
            for n in range(self.n_min, min(self.n_max, p) + 1):
                self._index[tuple(h[p - n:p])] = p
            h.append(tok)

    def propose(self, limit: int | None = None, end: int | None = None) -> list[int]:
        """The continuation after the most recent occurrence of the longest suffix of ``history[:end]`` (default:
        the whole history) that occurred before (session first, then the cross-session cache); empty when
        nothing matches."""
        limit = min(limit or self.max_tokens, self.max_tokens)
        h = self.history
        end = len(h) if end is None else end
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            key = tuple(h[end - n:end])
            p = self._index.get(key)
            if p is not None and p < end:  # the occurrence that ends exactly at `end` is the suffix itself
                return h[p:p + limit]
            cached = self._cache.get((self._partition, key))
            if cached is not None:
                self._cache.move_to_end((self._partition, key))
                return list(cached[:limit])
        return []

    def finish(self, share: bool = True) -> None:
        """Remember this session's generated n-grams (with what followed them) for later sessions; ``share``
        False keeps them out (a session with a pinned seed must not shape other sessions' trees)."""
        if not share:
            return
        h, start = self.history, max(self._prompt_len, self.n_min)
        for p in range(start, len(h)):
            for n in range(self.n_min, min(self.n_max, p) + 1):
                key = (self._partition, tuple(h[p - n:p]))
                self._cache[key] = tuple(h[p:p + self.max_tokens])
                self._cache.move_to_end(key)
        while len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)
