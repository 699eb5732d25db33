"""Online distillation: the verifier's idle compute turns each opted-in partition's teacher signal
(cloud/teacher.py) into a LoRA adapter for its drafter (cloud/distill.py), offered to that partition's edges.

A partition gets a round when it has filed ``min_positions`` positions since its last one and the verifier is idle
(no session open, nothing queued or running on the engine) for ``idle_s``; the round trains on every sample the
store holds for that partition, within ``round_budget_s`` of step time, and yields at the next decoder layer the
moment the verifier is not idle (a session opening, a draft queued), carrying on when it is idle again. Each
partition has its own adapter and optimizer state (never another's samples); finished, the adapter is written as
llama.cpp's LoRA GGUF (cloud/lora_gguf.py) and published in ``AdapterStore`` under the partition: the verifier
names it in that partition's Opened, and serves its bytes to callers of that partition only.

Losslessness is untouched: an adapter changes the drafter's proposals, never the verifier's decisions.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tandem.core.messages import AdapterInfo
from tandem.core.model_id import file_sha256

from . import adapter_dir
from .lora_gguf import lora_gguf, sha256
from .teacher import TeacherStore

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


@dataclass
class _Published:
    info: AdapterInfo
    data: bytes
    lineage_s: float  # when the training it continues began: its first round (the store's clock, Unix seconds)


RENEW_AT = 0.5  # a lineage older than this fraction of its lifetime starts afresh, so its successor is out first


class AdapterStore:
    """The latest adapter of each partition (its bytes in memory: a rank-16 adapter of a 0.5B drafter is ~18 MB);
    with ``root``, also on disk (``cloud.adapter_dir``), and what is there is served again after a restart.

    An adapter lives at most ``max_age_s`` from the start of its lineage (the first round of the training it
    continues), then it is gone, from memory and disk, with its training state. Set to the teacher store's
    ``max_age_s``: nothing learnt from a tenant's text outlives the text by more than the deployment keeps text
    at all. The distillation starts a new lineage from the adapter as first made once one is ``RENEW_AT`` of that
    old, so a partition with traffic has its next adapter before the last expires."""

    def __init__(self, root: Path | None = None, max_age_s: float = math.inf, clock: Callable[[], float] = time.time):
        if max_age_s <= 0:
            raise ValueError(f"adapter store: max_age_s must be positive, got {max_age_s}")
        self._lock = threading.Lock()
        self.root = Path(root) if root is not None else None
        self.max_age_s, self.clock = max_age_s, clock
        self._by_partition: dict[str, _Published] = {}
        if self.root is not None:
            for partition, (info, data, lineage) in adapter_dir.load_adapters(self.root).items():
                self._by_partition[partition] = _Published(info, data, lineage)
            self.expire()

    def expire(self) -> None:
        """Drop every adapter past its lifetime now (otherwise each goes when next asked for)."""
        with self._lock:
            for partition in list(self._by_partition):
                self._current(partition)

    def publish(self, partition: str, data: bytes, base: str, version: int,
                lineage_s: float | None = None) -> AdapterInfo:
        """``lineage_s``: when the training this adapter continues began (None: now, a first round)."""
        info = AdapterInfo(sha256(data), version, base, len(data))
        lineage = self.clock() if lineage_s is None else lineage_s
        if self.root is not None:  # (on disk first: what is served survives a restart)
            adapter_dir.save_adapter(self.root, partition, info, data, lineage)
        with self._lock:
            self._by_partition[partition] = _Published(info, data, lineage)
        return info

    def info(self, partition: str) -> AdapterInfo | None:
        with self._lock:
            p = self._current(partition)
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
            return (p.info, p.data) if p is not None and p.info.sha256 == sha else None

    def _current(self, partition: str) -> _Published | None:
        """The partition's adapter, unless its lineage is past ``max_age_s``: then it is dropped (held lock)."""
        p = self._by_partition.get(partition)
        if p is not None and self.clock() - p.lineage_s >= self.max_age_s:
            del self._by_partition[partition]
            if self.root is not None:
                adapter_dir.remove(self.root, partition)
            log.info("adapter expired", extra={"partition": partition[:12], "version": p.info.version})
            return None
        return p


@dataclass
class _Partition:
    trained_at: int = 0  # the store's recorded() count the last round started from
    state: dict | None = None  # its adapter's weights and optimizer moments while another partition trains
    round: object | None = None  # a round traffic interrupted
    rounds: int = 0
    lineage_s: float | None = None  # when its training began (the adapter store's clock), None: not yet


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
    current: object | None = None  # the round being trained now (a distill.Round), else None
    _parts: dict[str, _Partition] = field(default_factory=dict)
    _distiller: object | None = None
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
        """Partitions with a round to start or to finish."""
        out = []
        for p in self.teacher.partitions():
            part = self._parts.get(p)
            if part is not None and part.round is not None:
                out.append(p)
            elif self.teacher.recorded(p) - (part.trained_at if part else 0) >= self.config.min_positions:
                out.append(p)
        return out

    def tick(self) -> AdapterInfo | None:
        """One partition's round, started or resumed, if the verifier has been idle long enough: what it published
        (None: nothing due, or the round yielded to traffic)."""
        self._forget_expired()
        due = self.due()
        if not due or not self._idle_enough():
            return None
        return self.run_round(due[0], should_yield=lambda: self._stop.is_set() or not self.idle())

    def run_round(self, partition: str, should_yield: Callable[[], bool] = lambda: False) -> AdapterInfo | None:
        from .distill import Round, windows
        d = self._ensure_distiller()
        part = self._parts.get(partition) or self._restored(partition)
        if part.round is None:
            now = self.adapters.clock()
            if part.lineage_s is None or now - part.lineage_s >= RENEW_AT * self.adapters.max_age_s:
                part.lineage_s, part.state = now, None  # a new lineage, from the adapter as first made
                if self._live == partition:
                    self._live = None  # (the distiller's copy of the old one is not kept)
            part.trained_at = self.teacher.recorded(partition)
            wins = windows(self.teacher.samples(partition), self.config.max_tokens, d.n_vocab)
            part.round = Round(wins, self.config.epochs, self.config.round_budget_s, seed=part.rounds)
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
        report, part.round = part.round.report, None
        self.last_report = report
        part.rounds += 1
        if self.adapters.root is not None:  # the state the next round continues from, even after a restart
            adapter_dir.save_state(self.adapters.root, partition, d.state())
        info = self.adapters.publish(partition, self.adapter_bytes(part.rounds), self.base, part.rounds,
                                     part.lineage_s)
        log.info("adapter published", extra={"partition": partition[:12], "version": info.version,
                                             "steps": report.steps, "positions": report.positions,
                                             "train_s": round(report.train_s, 1), "preempted": report.preempted})
        return info

    def _forget_expired(self) -> None:
        """Training whose lineage is past the adapters' lifetime is dropped with its adapter: it learnt from text
        the teacher store no longer keeps."""
        self.adapters.expire()
        now = self.adapters.clock()
        for p, part in self._parts.items():
            if part.lineage_s is not None and now - part.lineage_s >= self.adapters.max_age_s:
                part.lineage_s, part.state, part.round = None, None, None
                if self._live == p:
                    self._ensure_distiller().load_state(None)
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
        return part

    def adapter_bytes(self, version: int) -> bytes:
        d = self._ensure_distiller()
        cfg = d.model.get_base_model().config
        return lora_gguf(d.lora(), d.alpha, cfg.model_type, cfg.num_hidden_layers, self.base, version)

    def _ensure_distiller(self):
        if self._distiller is None:
            from .distill import Distiller, load_drafter
            model = self.model if self.model is not None else load_drafter(self.drafter_source)
            c = self.config
            self._distiller = Distiller(model, rank=c.rank, alpha=c.alpha, lr=c.lr)
        return self._distiller
