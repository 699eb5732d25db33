"""Online distillation: the verifier's idle compute turns each opted-in partition's teacher signal
(cloud/learning/teacher.py) into a LoRA adapter for its drafter (cloud/learning/distill.py), offered to that partition's
edges.

A partition gets a round when it has filed ``min_positions`` positions since its last one and the verifier is idle
(no session open, nothing queued or running on the engine) for ``idle_s``; the round trains on every sample the
store holds for that partition, within ``round_budget_s`` of step time, and yields at the next decoder layer the
moment the verifier is not idle (a session opening, a draft queued), carrying on when it is idle again. Each
partition has its own adapter and optimizer state (never another's samples); finished, the adapter is written as
llama.cpp's LoRA GGUF (cloud/learning/lora_gguf.py) and published in ``AdapterStore`` under the partition: the verifier
names it in that partition's Opened, and serves its bytes to callers of that partition only.

Training time is shared round-robin (``next_round``): an interrupted round goes on first, and otherwise the due
partition whose last round started least recently goes next, so a tenant with much traffic cannot starve another.
What training holds is bounded: a partition holding an adapter, training state or a round counts against its
tenant (the teacher store's: whose text it learnt from), at most ``max_tenant_adapters`` a tenant and
``max_adapters`` in all; past a cap the least recently used (trained, named in an Opened, or served) goes, adapter,
state and round, from memory and disk (``over_caps``). Every tick first sweeps, due or not, idle or not: adapters
past their lifetime, the training state of their lineage, and a round holding text the teacher store has expired.

Losslessness is untouched: an adapter changes the drafter's proposals, never the verifier's decisions.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Collection, Mapping, Sequence

from tandem.core.messages import AdapterInfo
from tandem.core.model_id import file_sha256

from . import adapter_dir
from .lora_gguf import lora_gguf, sha256
from .teacher import TeacherStore

if TYPE_CHECKING:  # (imported where used: it is the torch side)
    from .distill import Distiller, Round

log = logging.getLogger("tandem.cloud.online")


@dataclass(frozen=True)
class OnlineConfig:
    min_positions: int = 512  # positions a partition files after its last round before its next
    round_budget_s: float = 300.0  # step time one round may spend (idle compute, bounded)
    epochs: int = 1  # passes over the partition's samples in a round
    idle_s: float = 2.0  # the verifier idle this long before a round starts (or resumes)
    max_tokens: int = 512  # tokens in one training window
    rank: int = 16
    alpha: float = 32.0
    lr: float = 2e-4
    max_tenant_adapters: int = 4  # partitions one tenant may hold an adapter, training state or a round for
    max_adapters: int = 16  # ... all tenants together

    def __post_init__(self):
        if min(self.max_tenant_adapters, self.max_adapters) < 1:
            raise ValueError(f"online distillation: max_tenant_adapters and max_adapters must be at least 1, got "
                             f"{self.max_tenant_adapters} and {self.max_adapters}")


def next_round(due: Sequence[str], interrupted: Collection[str], started: Mapping[str, int]) -> str | None:
    """Which due partition trains next: one whose round was interrupted goes on (a round is bounded, by
    ``round_budget_s`` of step time and its epochs over one partition's samples, so finishing it is one turn, not
    a monopoly, and it is never made to start over); otherwise the one whose last round started least recently
    (``started``: a stamp that grows, 0 or absent: never), ties in ``due``'s order. A partition with traffic is due
    again at once, but every other due partition has its turn first."""
    for p in due:
        if p in interrupted:
            return p
    return min(due, key=lambda p: started.get(p, 0), default=None)


def over_caps(held: Sequence[tuple[str, str, int]], per_tenant: int, total: int) -> list[str]:
    """``held``: (partition, tenant, last use: a stamp that grows); the partitions to evict, least recently used
    first, so that no tenant holds more than ``per_tenant`` and all together no more than ``total``."""
    order = sorted(held, key=lambda h: h[2])
    count = Counter(tenant for _, tenant, _ in order)
    out = []
    for partition, tenant, _ in order:
        if count[tenant] > per_tenant:
            out.append(partition)
            count[tenant] -= 1
    kept = [partition for partition, _, _ in order if partition not in out]
    return out + kept[: max(0, len(kept) - total)]


@dataclass
class _Published:
    info: AdapterInfo
    data: bytes
    lineage_s: float  # when the training it continues began: its first round (the store's clock, Unix seconds)
    tenant: str = ""  # whom it counts against (cloud.learning.teacher: whose text it learnt from)
    used: int = 0  # the store's stamp when it was last published, named in an Opened or served


RENEW_AT = 0.5  # a lineage older than this fraction of its lifetime starts afresh, so its successor is out first


class AdapterStore:
    """The latest adapter of each partition (its bytes in memory: a rank-16 adapter of a 0.5B drafter is ~18 MB);
    with ``root``, also on disk (``cloud.learning.adapter_dir``), and what is there is served again after a restart.

    An adapter lives at most ``max_age_s`` from the start of its lineage (the first round of the training it
    continues), then it is gone, from memory and disk, with its training state. Set to the teacher store's
    ``max_age_s``: nothing learnt from a tenant's text outlives the text by more than the deployment keeps text
    at all. The distillation starts a new lineage from the adapter as first made once one is ``RENEW_AT`` of that
    old, so a partition with traffic has its next adapter before the last expires.

    Each adapter counts against a tenant and records its last use (``held``): the distillation evicts past its caps
    (``OnlineDistillation``, ``over_caps``) with ``drop``."""

    def __init__(self, root: Path | None = None, max_age_s: float = math.inf, clock: Callable[[], float] = time.time):
        if max_age_s <= 0:
            raise ValueError(f"adapter store: max_age_s must be positive, got {max_age_s}")
        self._lock = threading.Lock()
        self.root = Path(root) if root is not None else None
        self.max_age_s, self.clock = max_age_s, clock
        self._stamps = itertools.count(1)
        self._by_partition: dict[str, _Published] = {}
        if self.root is not None:  # (the oldest lineage counts as the least recently used)
            saved = adapter_dir.load_adapters(self.root)
            for partition in sorted(saved, key=lambda p: saved[p].lineage_unix):
                info, data, lineage, tenant = saved[partition]
                self._by_partition[partition] = _Published(info, data, lineage, tenant, self.stamp())
            self.expire()

    def stamp(self) -> int:
        """A use stamp: greater than every one before (what orders uses for the caps' least recently used)."""
        return next(self._stamps)  # (itertools.count is atomic under the GIL)

    def expire(self) -> None:
        """Drop every adapter past its lifetime now (otherwise each goes when next asked for)."""
        with self._lock:
            for partition in list(self._by_partition):
                self._current(partition)

    def held(self) -> dict[str, tuple[str, int]]:
        """Each partition holding an adapter: (the tenant it counts against, its last use stamp). Uses nothing."""
        with self._lock:
            return {partition: (p.tenant, p.used) for partition, p in self._by_partition.items()}

    def drop(self, partition: str, why: str = "evicted") -> None:
        """``partition``'s adapter gone, from memory and disk, with its training state."""
        with self._lock:
            p = self._by_partition.pop(partition, None)
            if self.root is not None:
                adapter_dir.remove(self.root, partition)
        if p is not None:
            log.info(f"adapter {why}", extra={"partition": partition[:12], "version": p.info.version})

    def publish(self, partition: str, data: bytes, base: str, version: int,
                lineage_s: float | None = None, tenant: str = "") -> AdapterInfo:
        """``lineage_s``: when the training this adapter continues began (None: now, a first round); ``tenant``:
        whom it counts against."""
        info = AdapterInfo(sha256(data), version, base, len(data))
        lineage = self.clock() if lineage_s is None else lineage_s
        if self.root is not None:  # (on disk first: what is served survives a restart)
            adapter_dir.save_adapter(self.root, partition, info, data, lineage, tenant)
        with self._lock:
            self._by_partition[partition] = _Published(info, data, lineage, tenant, self.stamp())
        return info

    def info(self, partition: str) -> AdapterInfo | None:
        """The partition's adapter (a use: what an Opened names)."""
        with self._lock:
            p = self._current(partition, use=True)
            return p.info if p else None

    def lineage(self, partition: str) -> float | None:
        with self._lock:
            p = self._current(partition)
            return p.lineage_s if p else None

    def get(self, partition: str, sha: str) -> tuple[AdapterInfo, bytes] | None:
        """The adapter ``sha`` and its file if it is ``partition``'s current one; None otherwise (another
        partition's adapter is as absent as one that never was)."""
        with self._lock:
            p = self._current(partition)
            if p is not None and p.info.sha256 == sha:
                p.used = self.stamp()
                return p.info, p.data
            return None

    def _current(self, partition: str, use: bool = False) -> _Published | None:
        """The partition's adapter, unless its lineage is past ``max_age_s``: then it is dropped (held lock)."""
        p = self._by_partition.get(partition)
        if p is not None and self.clock() - p.lineage_s >= self.max_age_s:
            del self._by_partition[partition]
            if self.root is not None:
                adapter_dir.remove(self.root, partition)
            log.info("adapter expired", extra={"partition": partition[:12], "version": p.info.version})
            return None
        if p is not None and use:
            p.used = self.stamp()
        return p


@dataclass
class _Partition:
    trained_at: int = 0  # the store's recorded() count the last round started from
    state: dict | None = None  # its adapter's weights and optimizer moments while another partition trains
    round: Round | None = None  # a round traffic interrupted
    rounds: int = 0
    lineage_s: float | None = None  # when its training began (the adapter store's clock), None: not yet
    tenant: str = ""  # whom its training counts against (the teacher store's, when its last round began)
    started: int = 0  # the adapter store's stamp when its last round started (0: never): the round-robin's order
    used: int = 0  # ... when it last trained (its round started or resumed): the caps' least recently used
    text_s: float | None = None  # the earliest last write (teacher store's clock) among the samples its round holds


@dataclass
class OnlineDistillation:
    teacher: TeacherStore
    adapters: AdapterStore
    drafter_source: Path  # the edge's drafter (GGUF or Hugging Face directory) the adapters are for
    idle: Callable[[], bool]  # the verifier has nothing to do (no session open, nothing queued)
    config: OnlineConfig = OnlineConfig()
    model: object | None = None  # the drafter in torch (loaded on the first round when None)
    clock: Callable[[], float] = time.monotonic
    last_report: object | None = None  # the last finished round's DistillReport
    current: Round | None = None  # the round being trained now, else None
    _parts: dict[str, _Partition] = field(default_factory=dict)
    _distiller: Distiller | None = None
    _live: str | None = None  # the partition whose adapter and optimizer state the distiller holds now
    _idle_since: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def base(self) -> str:
        """The drafter's identity its adapters carry: its file's sha256 (a directory: its name)."""
        src = Path(self.drafter_source)
        return file_sha256(src) if src.is_file() else src.name

    def start(self, poll_s: float = 0.2) -> threading.Thread:
        """Rounds on a thread of their own, whenever the verifier is idle, until ``stop`` (then ``start`` again
        goes on: an interrupted round resumes)."""
        self._stop.clear()
        t = self._thread = threading.Thread(target=self._loop, args=(poll_s,), name="online-distillation",
                                            daemon=True)
        t.start()
        return t

    def stop(self, timeout_s: float | None = None) -> None:
        """The round in progress drops its step (as for traffic) and the thread ends; waits ``timeout_s`` for it."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _loop(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                self.tick()
            except Exception:  # a failed round must not end distillation for good
                log.exception("online distillation round failed")

    def _idle_enough(self) -> bool:
        if not self.idle():
            self._idle_since = None
            return False
        now = self.clock()
        self._idle_since = now if self._idle_since is None else self._idle_since
        return now - self._idle_since >= self.config.idle_s

    def due(self) -> list[str]:
        """Partitions with a round to finish (first), or to start: ``min_positions`` filed since the last (a count
        the teacher store restarted, its partition having held nothing meanwhile, counts from 0)."""
        out = [p for p, part in self._parts.items() if part.round is not None]
        for p in self.teacher.partitions():
            part = self._parts.get(p)
            recorded, trained = self.teacher.recorded(p), part.trained_at if part else 0
            if p not in out and (recorded - trained if recorded >= trained else recorded) >= self.config.min_positions:
                out.append(p)
        return out

    def tick(self) -> AdapterInfo | None:
        """The sweep (always), then one partition's round, started or resumed (``next_round``), if the verifier has
        been idle long enough: what it published (None: nothing due, or the round yielded to traffic)."""
        self.sweep()
        due = self.due()
        if not due or not self._idle_enough():
            return None
        partition = next_round(due, {p for p, part in self._parts.items() if part.round is not None},
                               {p: part.started for p, part in self._parts.items()})
        assert partition is not None
        return self.run_round(partition, should_yield=lambda: self._stop.is_set() or not self.idle())

    def run_round(self, partition: str, should_yield: Callable[[], bool] = lambda: False) -> AdapterInfo | None:
        from .distill import Round, windows
        d = self._ensure_distiller()
        part = self._parts.get(partition) or self._restored(partition)
        part.used = self.adapters.stamp()
        if part.round is None:
            now = self.adapters.clock()
            if part.lineage_s is None or now - part.lineage_s >= RENEW_AT * self.adapters.max_age_s:
                part.lineage_s, part.state = now, None  # a new lineage, from the adapter as first made
                if self._live == partition:
                    self._live = None  # (the distiller's copy of the old one is not kept)
            part.trained_at = self.teacher.recorded(partition)
            part.tenant = self.teacher.tenant(partition) or part.tenant
            samples = self.teacher.samples(partition)
            part.text_s = min((s.at_s for s in samples), default=None)
            wins = windows(samples, self.config.max_tokens, d.n_vocab)
            part.round = Round(wins, self.config.epochs, self.config.round_budget_s, seed=part.rounds)
            part.started = part.used
        if self._live != partition:  # the distiller holds one partition's training; another's is swapped in
            if self._live is not None:
                self._parts[self._live].state = d.state()
            d.load_state(part.state)
            self._live = partition
        self.current = part.round
        try:
            finished = part.round.run(d, should_yield)
        finally:
            self.current = None
        if not finished:
            return None
        report, part.round, part.text_s = part.round.report, None, None
        self.last_report = report
        part.rounds += 1
        if self.adapters.root is not None:  # the state the next round continues from, even after a restart
            adapter_dir.save_state(self.adapters.root, partition, d.state())
        info = self.adapters.publish(partition, self.adapter_bytes(part.rounds), self.base, part.rounds,
                                     part.lineage_s, part.tenant)
        log.info("adapter published", extra={"partition": partition[:12], "version": info.version,
                                             "steps": report.steps, "positions": report.positions,
                                             "train_s": round(report.train_s, 1), "preempted": report.preempted})
        self._evict()
        return info

    def sweep(self) -> None:
        """What no longer may be kept goes, whether or not any partition is due: adapters past their lifetime with
        the training of their lineage (it learnt from text the teacher store no longer keeps), an interrupted
        round holding a sample the teacher store has expired, and past the caps the least recently used
        partitions' training; then the bookkeeping of partitions that hold nothing."""
        self.adapters.expire()
        now, text_now = self.adapters.clock(), self.teacher.clock()
        for p, part in list(self._parts.items()):
            if part.lineage_s is not None and now - part.lineage_s >= self.adapters.max_age_s:
                self._forget(p, "expired")
            elif part.text_s is not None and text_now - part.text_s >= self.teacher.max_age_s:
                part.round, part.text_s = None, None  # (what it trained stays: the text was in age then)
        self._evict()
        held, kept = self.adapters.held(), set(self.teacher.partitions())
        for p, part in list(self._parts.items()):
            if part.state is None and part.round is None and p != self._live and p not in held and p not in kept:
                del self._parts[p]

    def _evict(self) -> None:
        """Past ``max_tenant_adapters`` / ``max_adapters``: the least recently used partitions' training goes."""
        held = self.adapters.held()
        for p, part in self._parts.items():
            if part.state is not None or part.round is not None or p == self._live:
                tenant, used = held.get(p, ("", 0))
                held[p] = (part.tenant or tenant, max(used, part.used))
        for p in over_caps([(p, t, u) for p, (t, u) in held.items()], self.config.max_tenant_adapters,
                           self.config.max_adapters):
            self._forget(p, "evicted")

    def _forget(self, partition: str, why: str) -> None:
        """``partition``'s adapter (memory and disk), training state and round, gone."""
        self.adapters.drop(partition, why)
        part = self._parts.get(partition)
        if part is not None:
            part.lineage_s, part.state, part.round, part.text_s = None, None, None, None
        if self._live == partition:
            if self._distiller is not None:
                self._distiller.load_state(None)
            self._live = None

    def _restored(self, partition: str) -> _Partition:
        """A partition first seen since start: its training goes on from the adapter saved for this drafter (the
        store's ``root``), if there is one."""
        part = self._parts[partition] = _Partition()
        info = self.adapters.info(partition)
        if self.adapters.root is not None and info is not None and info.base == self.base:
            part.state = adapter_dir.load_state(self.adapters.root, partition)
            part.lineage_s = self.adapters.lineage(partition)
            part.rounds = info.version  # (versions go on rising even when the state did not survive)
            part.tenant = self.adapters.held().get(partition, ("", 0))[0]
        return part

    def adapter_bytes(self, version: int) -> bytes:
        d = self._ensure_distiller()
        cfg = d.model.get_base_model().config
        return lora_gguf(d.lora(), d.alpha, cfg.model_type, cfg.num_hidden_layers, self.base, version)

    def _ensure_distiller(self) -> Distiller:
        if self._distiller is None:
            from .distill import Distiller, load_drafter
            model = self.model if self.model is not None else load_drafter(self.drafter_source)
            c = self.config
            self._distiller = Distiller(model, rank=c.rank, alpha=c.alpha, lr=c.lr)
        return self._distiller
