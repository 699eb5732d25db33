"""The target's distribution at committed positions, kept for distilling the drafter (online speculative decoding).

Every verify forward computes the target's logits at each position it commits; a session of an opted-in tenant
keeps, per committed token, the target's ``k`` likeliest tokens and their log-probabilities there (the teacher
signal of a forward KL to the target's top-k), with the tokens before it. Nothing is kept for a tenant that has not
opted in (the servicer decides, from the caller's key: ``OpenRequest.teach``).

Kept per cache partition (core.tenancy): a tenant's positions are read back for that partition only, never pooled.
Each sample is charged to the tenant whose session wrote it (``OpenRequest.tenant``, its verifier key's digest), and
the store holds at most ``max_bytes`` a partition, ``max_tenant_bytes`` for all of one tenant's partitions together
(a tenant picks partitions through ``cache_salt``, so the per-partition cap alone bounds nothing) and
``max_total_bytes`` in all. Over a cap, the least recently used goes first: within the scope that is over (the
partition, the writing tenant's samples, everything), the least recently written partition's oldest samples. A
sample older than ``max_age_s`` is gone by the next sweep, which the worker runs every ``sweep_s`` whether or not
anyone touches the partition (and a read of a partition expires it first).

The verify path only copies a verdict's rows into a bounded queue; one worker thread reduces them to top-k (a pass
over the vocabulary a row) and files them, and when the queue is full the verdict's positions are dropped
(``dropped``): collection never waits on the verify path. ``clock`` (ages) is injectable; ``sweep_s`` is in real
seconds.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

log = logging.getLogger("tandem.cloud.teacher")

TENANT_CAP = 4  # ``max_tenant_bytes`` by default: this many partitions' worth (``max_bytes``)
TOTAL_CAP = 16  # ``max_total_bytes`` by default: this many partitions' worth


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
    tenant: str = ""  # whose session wrote it (what its bytes count against)


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
                 clock: Callable[[], float] = time.monotonic, max_pending: int = 64,
                 max_tenant_bytes: int | None = None, max_total_bytes: int | None = None, sweep_s: float = 60.0):
        """``max_bytes``: per partition; ``max_tenant_bytes``: per tenant, all its partitions together (None:
        ``TENANT_CAP`` partitions' worth); ``max_total_bytes``: the whole store (None: ``TOTAL_CAP`` partitions'
        worth); ``max_age_s``: a sample's life after its last write; ``sweep_s``: real seconds between the worker's
        expiry sweeps; ``k``: alternatives kept per position; ``max_pending``: verdicts queued for the worker
        before more are dropped."""
        max_tenant_bytes = TENANT_CAP * max_bytes if max_tenant_bytes is None else max_tenant_bytes
        max_total_bytes = TOTAL_CAP * max_bytes if max_total_bytes is None else max_total_bytes
        if min(k, max_bytes, max_tenant_bytes, max_total_bytes) < 1 or max_age_s <= 0 or sweep_s <= 0:
            raise ValueError(f"teacher store: k, the byte caps, max_age_s and sweep_s must be positive, got k={k}, "
                             f"max_bytes={max_bytes}, max_tenant_bytes={max_tenant_bytes}, "
                             f"max_total_bytes={max_total_bytes}, max_age_s={max_age_s}, sweep_s={sweep_s}")
        self.k, self.max_bytes, self.max_age_s, self.clock = k, max_bytes, max_age_s, clock
        self.max_tenant_bytes, self.max_total_bytes, self.sweep_s = max_tenant_bytes, max_total_bytes, sweep_s
        self.dropped = 0  # verdicts whose positions the full queue turned away
        self._lock = threading.Lock()
        # partition -> its samples, oldest first; partitions least recently written first
        self._parts: OrderedDict[str, OrderedDict[int, Sample]] = OrderedDict()
        self._bytes: dict[str, int] = {}  # partition -> what its samples hold
        self._tenant_bytes: dict[str, int] = {}  # tenant -> what its samples hold, every partition
        self._total = 0
        self._owner: dict[str, str] = {}  # partition -> the tenant that last wrote to it
        self._recorded: dict[str, int] = {}  # partition -> positions filed while it held samples (only grows)
        self._next = 0
        self._queue: queue.Queue = queue.Queue(max_pending)
        threading.Thread(target=self._work, name="teacher-store", daemon=True).start()

    def flush(self) -> None:
        """Wait until every queued verdict is filed."""
        self._queue.join()

    def session(self, partition: str, tokens: Sequence[int], tenant: str = "") -> "TeacherSession":
        """A handle for one verifier session of ``partition`` (an opted-in tenant's) whose text so far is
        ``tokens`` (the prompt); what it keeps counts against ``tenant`` (``OpenRequest.tenant``)."""
        with self._lock:
            self._next += 1
            return TeacherSession(self, partition, self._next, list(tokens), tenant)

    def samples(self, partition: str) -> list[Sample]:
        """``partition``'s samples, oldest first (what a distillation of that tenant's drafter reads)."""
        with self._lock:
            self._expire(partition)
            return [s for s in self._parts.get(partition, {}).values() if s.top_ids]

    def partitions(self) -> list[str]:
        """The partitions that hold samples now, least recently written first (as of the last sweep: listing
        expires nothing)."""
        with self._lock:
            return list(self._parts)

    def tenant(self, partition: str) -> str:
        """The tenant that last wrote to ``partition`` ("" when it holds nothing): whom what is learnt from it
        counts against (cloud.learning.online)."""
        with self._lock:
            return self._owner.get(partition, "")

    def recorded(self, partition: str) -> int:
        """Positions filed for ``partition`` while it held samples: a count that only grows until the partition
        holds nothing, then starts again from 0 (what a distiller compares with the count it last trained at)."""
        with self._lock:
            return self._recorded.get(partition, 0)

    def nbytes(self, partition: str) -> int:
        with self._lock:
            self._expire(partition)
            return self._bytes.get(partition, 0)

    def tenant_nbytes(self, tenant: str) -> int:
        """What ``tenant``'s samples hold, every partition (as of the last sweep)."""
        with self._lock:
            return self._tenant_bytes.get(tenant, 0)

    def total_nbytes(self) -> int:
        """What the store holds (as of the last sweep)."""
        with self._lock:
            return self._total

    def sweep(self) -> None:
        """Expire every partition's samples older than ``max_age_s`` (the worker calls this every ``sweep_s``)."""
        with self._lock:
            for partition in list(self._parts):
                self._expire(partition)

    def _enqueue(self, *item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def _work(self) -> None:
        next_sweep = time.monotonic() + self.sweep_s
        while True:
            try:  # (woken by a verdict, or by the next sweep's time: an idle store still expires)
                item = self._queue.get(timeout=max(0.0, next_sweep - time.monotonic()))
            except queue.Empty:
                item = None
            if item is not None:
                try:
                    self._record(*item)
                except Exception:  # one bad verdict must not end collection
                    log.exception("teacher positions not filed")
                finally:
                    self._queue.task_done()
            if time.monotonic() >= next_sweep:
                try:
                    self.sweep()
                except Exception:
                    log.exception("teacher sweep failed")
                next_sweep = time.monotonic() + self.sweep_s

    def _record(self, partition: str, sid: int, tenant: str, text: list[int], before: int, new: list[int],
                rows: np.ndarray) -> None:
        """``text[:before]``: the session's tokens before ``new`` (``text`` only grows)."""
        ids, logprobs = top_k_logprobs(rows, self.k)
        with self._lock:
            self._expire(partition)
            part = self._parts.setdefault(partition, OrderedDict())
            self._parts.move_to_end(partition)  # (the most recently written partition last)
            # (a session whose sample a cap or the age took starts a new one at its text so far)
            fresh = sid not in part
            sample = Sample(text[:before], before, nbytes=8 * before, tenant=tenant) if fresh else part.pop(sid)
            sample.tokens.extend(new)
            sample.top_ids.extend(ids)
            sample.top_logprobs.extend(logprobs)
            sample.at_s = self.clock()
            self._recorded[partition] = self._recorded.get(partition, 0) + len(new)
            self._owner[partition] = tenant
            grown = 8 * len(new) + ids.nbytes + logprobs.nbytes
            sample.nbytes += grown
            part[sid] = sample  # (the most recently written last)
            self._charge(partition, tenant, grown + (8 * before if fresh else 0))
            self._evict(lambda: self._bytes.get(partition, 0) > self.max_bytes, only=partition)
            self._evict(lambda: self._tenant_bytes.get(tenant, 0) > self.max_tenant_bytes, tenant=tenant)
            self._evict(lambda: self._total > self.max_total_bytes)

    def _charge(self, partition: str, tenant: str, n: int) -> None:
        self._bytes[partition] = self._bytes.get(partition, 0) + n
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + n
        self._total += n

    def _expire(self, partition: str) -> None:
        """Drop ``partition``'s samples older than ``max_age_s`` (the oldest are first: each is moved to the end
        when written)."""
        cutoff = self.clock() - self.max_age_s
        part = self._parts.get(partition)
        while part:
            sid, oldest = next(iter(part.items()))
            if oldest.at_s >= cutoff:
                break
            self._remove(partition, sid)

    def _evict(self, over: Callable[[], bool], only: str | None = None, tenant: str | None = None) -> None:
        """While ``over()``: drop the oldest sample (``tenant``'s, when given) of the least recently written
        partition (``only``, when given) that has one."""
        if not over():
            return
        for partition in [only] if only is not None else list(self._parts):
            for sid, sample in list(self._parts.get(partition, {}).items()):
                if not over():
                    return
                if tenant is None or sample.tenant == tenant:
                    self._remove(partition, sid)

    def _remove(self, partition: str, sid: int) -> None:
        part = self._parts[partition]
        sample = part.pop(sid)
        self._charge(partition, sample.tenant, -sample.nbytes)
        if not self._tenant_bytes[sample.tenant]:
            del self._tenant_bytes[sample.tenant]
        if not part:  # (a partition holding nothing leaves no trace)
            del self._parts[partition], self._bytes[partition], self._owner[partition], self._recorded[partition]


@dataclass
class TeacherSession:
    """What one verifier session commits, fed to its store (``VerifierSession.apply`` calls ``record``)."""

    store: TeacherStore
    partition: str
    sid: int
    text: list[int]  # the session's tokens so far (prompt and committed)
    tenant: str = ""  # whom what it keeps counts against

    def record(self, new: Sequence[int], rows: np.ndarray) -> None:
        """``new`` committed tokens, ``rows[i]`` the target's logits at ``new[i]``'s position."""
        if len(new):  # (the rows copied: the engine reuses its buffers; the text only grows, so no copy of it)
            new = [int(t) for t in new]
            self.store._enqueue(self.partition, self.sid, self.tenant, self.text, len(self.text), new,
                                np.array(rows[: len(new)]))
            self.text.extend(new)
