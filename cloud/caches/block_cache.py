"""Block-hashed prefix cache for engines that keep each session's KV in its own tensors (cloud/engines/torch_engine.py).

A session's committed tokens are cut into blocks of ``block_tokens``. Block i is known by the pair (block i - 1,
its own tokens): a chain, so a block matches only under the very same whole prefix, as its KV depends on every
token before it (vLLM's automatic prefix caching keys blocks the same way). When a session ends, its full blocks
that are not cached yet are copied out; a new session's prefill walks its prompt's blocks from the start and reuses
the longest chain present, and computes only the rest (a partial last block is always computed).

Against whole-sequence entries (cloud/caches/prefix_cache.py, which the llama.cpp engine uses because a KV cell there is
shared by seq id, not copied) blocks store a shared prefix once: a system prompt common to a hundred conversations
costs its blocks once, and two conversations that forked after turn 3 share turns 1-3.

A chain starts at its partition's root (``core.tenancy``): the same tokens cached by another partition are other
blocks, never found, so a hit tells one tenant nothing of another's conversations.

Eviction is least recently used among leaves (blocks no cached block continues), bounded by ``budget_tokens``. A
lookup or store touches its chain from the first block on, so a block is never older than its descendants and
evicting leaves first never strands a reachable block. Pure bookkeeping: a block's payload is whatever the engine
hands in (per-layer key/value tensors); the cache never looks inside.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tandem.core.tenancy import SHARED

from .prefix_cache import PrefixStats

_ROOT = 0  # block ids start above it


def _root(partition: str) -> str:
    """The parent of a chain's first block: its partition (a string, never a block id)."""
    return "root:" + partition


@dataclass
class _Block:
    id: int
    key: tuple[int | str, tuple[int, ...]]  # (parent block id, or the partition's root; this block's tokens)
    payload: Any
    used: int  # logical clock of the last lookup or store that walked through it
    children: int = 0  # cached blocks continuing this one


@dataclass
class BlockCache:
    budget_tokens: int  # most cached tokens in all (a block costs block_tokens)
    block_tokens: int = 16
    min_tokens: int = 32  # a shorter reusable prefix is not worth the copy
    stats: PrefixStats = field(default_factory=PrefixStats)  # stored / evicted count blocks here

    def __post_init__(self):
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        self._blocks: dict[tuple[int | str, tuple[int, ...]], _Block] = {}
        self._by_id: dict[int, _Block] = {}
        self._next_id = _ROOT + 1
        self._clock = 0
        self._lock = threading.Lock()

    @property
    def max_blocks(self) -> int:
        return max(0, self.budget_tokens) // self.block_tokens

    def _chain(self, tokens: Sequence[int], partition: str) -> list[_Block]:
        """The cached blocks of ``partition`` covering ``tokens`` from the start, up to the first miss."""
        b, chain = self.block_tokens, []
        parent: int | str = _root(partition)
        for lo in range(0, len(tokens) - b + 1, b):
            block = self._blocks.get((parent, tuple(tokens[lo : lo + b])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        return chain

    def _touch(self, chain: list[_Block]) -> None:
        for block in chain:  # first block first: ancestors never newer than descendants
            self._clock += 1
            block.used = self._clock

    def lookup(self, tokens: Sequence[int], partition: str = SHARED) -> tuple[list[Any], int]:
        """(payloads, n): the payloads of ``partition``'s longest cached chain of blocks prefixing ``tokens``, first
        block first, and the tokens they cover; ([], 0) when that is under ``min_tokens``."""
        with self._lock:
            self.stats.lookups += 1
            chain = self._chain(tokens, partition)
            n = len(chain) * self.block_tokens
            if not chain or n < self.min_tokens:
                return [], 0
            self._touch(chain)
            self.stats.hits += 1
            self.stats.reused_tokens += n
            return [block.payload for block in chain], n

    def peek(self, tokens: Sequence[int], partition: str = SHARED) -> int:
        """The prefix of ``tokens`` that ``lookup`` would reuse, without counting or touching anything."""
        with self._lock:
            n = len(self._chain(tokens, partition)) * self.block_tokens
        return n if n >= self.min_tokens else 0

    def store(self, tokens: Sequence[int], payload: Callable[[int], Any], partition: str = SHARED) -> int:
        """Cache the full blocks of a finished sequence's ``tokens``; ``payload(i)`` copies out block i (tokens
        ``i * block_tokens`` up to the next block), called only for blocks not cached yet. Returns how many blocks
        were added. Sequences under ``min_tokens`` are not kept; past the budget only the first blocks are."""
        b = self.block_tokens
        n_blocks = min(len(tokens) // b, self.max_blocks)
        if n_blocks * b < self.min_tokens:
            return 0
        with self._lock:
            chain = self._chain(tokens[: n_blocks * b], partition)
            self._touch(chain)
            missing = n_blocks - len(chain)
            keep = {block.id for block in chain}
            while missing and len(self._blocks) + missing > self.max_blocks:
                if not self._evict_one(keep):
                    missing = max(0, self.max_blocks - len(self._blocks))  # only the chain is left: store fewer
            parent = chain[-1] if chain else None
            for i in range(len(chain), len(chain) + missing):
                key = (parent.id if parent else _root(partition), tuple(tokens[i * b : (i + 1) * b]))
                self._clock += 1
                block = _Block(self._next_id, key, payload(i), self._clock)
                self._next_id += 1
                self._blocks[key] = self._by_id[block.id] = block
                if parent is not None:
                    parent.children += 1
                parent = block
            self.stats.stored += missing
            return missing

    def _evict_one(self, keep: set[int]) -> bool:
        """Drop the least recently used leaf outside ``keep``; False when there is none."""
        leaves = [block for block in self._blocks.values() if not block.children and block.id not in keep]
        if not leaves:
            return False
        self._drop(min(leaves, key=lambda block: block.used))
        return True

    def _drop(self, block: _Block) -> None:
        del self._blocks[block.key]
        del self._by_id[block.id]
        above = block.key[0]
        parent = self._by_id.get(above) if isinstance(above, int) else None
        if parent is not None:
            parent.children -= 1
        self.stats.evicted += 1

    def clear(self) -> int:
        """Drop every block (their payloads are freed with them); returns how many there were."""
        with self._lock:
            n = len(self._blocks)
            self.stats.evicted += n
            self._blocks.clear()
            self._by_id.clear()
            return n

    @property
    def cached_tokens(self) -> int:
        with self._lock:
            return len(self._blocks) * self.block_tokens

    def __len__(self) -> int:
        return len(self._blocks)
