"""The target's distribution at committed positions, kept for distilling the drafter (online speculative decoding).

Every verify forward computes the target's logits at each position it commits; a session of an opted-in tenant
keeps, per committed token, the target's ``k`` likeliest tokens and their log-probabilities there (the teacher
signal of a forward KL to the target's top-k), with the tokens before it. Nothing is kept for a tenant that has not
opted in (the servicer decides, from the caller's key: ``OpenRequest.teach``).

Kept per cache partition (core.tenancy): a tenant's positions are read back for that partition only, never pooled.
Bounded per partition in bytes (its oldest sessions go first) and in age (older than ``max_age_s``: gone the next
time the partition is touched). The verify path only copies a verdict's rows into a bounded queue; one worker
thread reduces them to top-k (a pass over the vocabulary a row) and files them, and when the queue is full the
verdict's positions are dropped (``dropped``): collection never waits on the verify path. ``clock`` is injectable.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


@dataclass
class Sample:
    """One session's text and, from ``first`` on, the target's top-k at each committed position: position j of
    ``top_ids`` / ``top_logprobs`` is the distribution the target gave ``tokens[first + j]`` (its own token among
    them at temperature 0) after ``tokens[:first + j]``."""

    tokens: list[int]
    first: int
    top_ids: list[np.ndarray] = field(default_factory=list)  # per position: [k] int32, likeliest first
    top_logprobs: list[np.ndarray] = field(default_factory=list)  # per position: [k] float32
    at_s: float = 0.0  # when it was last written (the store's clock)
    nbytes: int = 0  # what it holds: 8 a token, and its arrays


def top_k_logprobs(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``k`` likeliest ids (likeliest first; ties: the lower id) and their log-probabilities under the
    row's softmax. O(vocabulary) a row (a partition, then a sort of k): it runs on the verify path."""
    x = np.asarray(rows, dtype=np.float32)
    k = min(k, x.shape[1])
    top = x.max(axis=1, keepdims=True)
    lse = top + np.log(np.exp(x - top).sum(axis=1, keepdims=True, dtype=np.float64))
    part = np.argpartition(-x, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(x, part, axis=1)
    ids = np.take_along_axis(part, np.lexsort((part, -vals), axis=1), axis=1)
    return ids.astype(np.int32), (np.take_along_axis(x, ids, axis=1) - lse).astype(np.float32)


class TeacherStore:
    def __init__(self, k: int = 16, max_bytes: int = 64 << 20, max_age_s: float = 24 * 3600.0,
                 clock: Callable[[], float] = time.monotonic, max_pending: int = 64):
        """``max_bytes``: per partition; ``k``: alternatives kept per position; ``max_pending``: verdicts queued
        for the worker before more are dropped."""
        if k < 1 or max_bytes < 1 or max_age_s <= 0:
            raise ValueError(f"teacher store: k, max_bytes and max_age_s must be positive, got {k}, {max_bytes}, "
                             f"{max_age_s}")
        self.k, self.max_bytes, self.max_age_s, self.clock = k, max_bytes, max_age_s, clock
        self.dropped = 0  # verdicts whose positions the full queue turned away
        self._lock = threading.Lock()
        self._parts: dict[str, OrderedDict[int, Sample]] = {}  # partition -> its samples, oldest first
        self._bytes: dict[str, int] = {}  # partition -> what its samples hold
        self._recorded: dict[str, int] = {}  # partition -> positions ever filed (only grows)
        self._next = 0
        self._queue: queue.Queue = queue.Queue(max_pending)
        threading.Thread(target=self._work, name="teacher-store", daemon=True).start()

    def flush(self) -> None:
        """Wait until every queued verdict is filed."""
        self._queue.join()

    def session(self, partition: str, tokens: Sequence[int]) -> "TeacherSession":
        """A handle for one verifier session of ``partition`` (an opted-in tenant's) whose text so far is
        ``tokens`` (the prompt)."""
        with self._lock:
            self._next += 1
            return TeacherSession(self, partition, self._next, list(tokens))

    def samples(self, partition: str) -> list[Sample]:
        """``partition``'s samples, oldest first (what a distillation of that tenant's drafter reads)."""
        with self._lock:
            self._expire(partition)
            return [s for s in self._parts.get(partition, {}).values() if s.top_ids]

    def partitions(self) -> list[str]:
        """The partitions that hold samples now."""
        with self._lock:
            return list(self._parts)

    def recorded(self, partition: str) -> int:
        """Positions ever filed for ``partition`` (a count that only grows: what a distiller compares with the
        count it last trained at)."""
        with self._lock:
            return self._recorded.get(partition, 0)

    def nbytes(self, partition: str) -> int:
        with self._lock:
            self._expire(partition)
            return self._bytes.get(partition, 0)

    def _enqueue(self, *item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                self._record(*item)
            finally:
                self._queue.task_done()

    def _record(self, partition: str, sid: int, text: list[int], before: int, new: list[int],
                rows: np.ndarray) -> None:
        """``text[:before]``: the session's tokens before ``new`` (``text`` only grows)."""
        ids, logprobs = top_k_logprobs(rows, self.k)
        with self._lock:
            self._expire(partition)
            part = self._parts.setdefault(partition, OrderedDict())
            # (a session whose sample the budget or the age took starts a new one at its text so far)
            fresh = sid not in part
            sample = Sample(text[:before], before, nbytes=8 * before) if fresh else part.pop(sid)
            sample.tokens.extend(new)
            sample.top_ids.extend(ids)
            sample.top_logprobs.extend(logprobs)
            sample.at_s = self.clock()
            self._recorded[partition] = self._recorded.get(partition, 0) + len(new)
            grown = 8 * len(new) + ids.nbytes + logprobs.nbytes
            sample.nbytes += grown
            part[sid] = sample  # (the most recently written last)
            self._bytes[partition] = self._bytes.get(partition, 0) + grown + (8 * before if fresh else 0)
            self._drop(partition, lambda oldest: self._bytes[partition] > self.max_bytes)

    def _expire(self, partition: str) -> None:
        cutoff = self.clock() - self.max_age_s
        self._drop(partition, lambda oldest: oldest.at_s < cutoff)

    def _drop(self, partition: str, while_: Callable[[Sample], bool]) -> None:
        """Drop ``partition``'s oldest samples while ``while_(oldest)``."""
        part = self._parts.get(partition)
        while part and while_(next(iter(part.values()))):
            self._bytes[partition] -= part.popitem(last=False)[1].nbytes
        if part is not None and not part:
            del self._parts[partition], self._bytes[partition]


@dataclass
class TeacherSession:
    """What one verifier session commits, fed to its store (``VerifierSession.apply`` calls ``record``)."""

    store: TeacherStore
    partition: str
    sid: int
    text: list[int]  # the session's tokens so far (prompt and committed)

    def record(self, new: Sequence[int], rows: np.ndarray) -> None:
        """``new`` committed tokens, ``rows[i]`` the target's logits at ``new[i]``'s position."""
        if len(new):  # (the rows copied: the engine reuses its buffers; the text only grows, so no copy of it)
            new = [int(t) for t in new]
            self.store._enqueue(self.partition, self.sid, self.text, len(self.text), new, np.array(rows[: len(new)]))
            self.text.extend(new)
