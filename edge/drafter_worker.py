"""The drafter's own thread: runs a generation's drafter jobs (edge/actions.py ``Job``) one at a time, in order,
and hands the drafter from one generation's worker to the next (``hand_over``, ``wait_idle``)."""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any, cast

from .actions import Job
from .drafter import Drafter, SpeculativeDrafter
from .rounds import NO_TREE

# what a worker puts on its generation's event queue: ("job", tag, result, draft_ms, (tokens, ms), time) or
# ("fail", exception); the verifier stream's events share the queue (edge/transport.py)
Event = tuple[Any, ...]


class DrafterWorker:
    """Runs drafter jobs one at a time on its own thread; each job's outcome goes onto the event queue as
    ("job", tag, result, draft_ms, (caught-up tokens, ms), time).

    A generation does not wait for its worker's last job when it ends (a tree or a long catch-up still running
    when the last verdict arrives would hold the answer back for nothing): the worker finishes that one job on its
    own and drops the rest. The drafter's next worker waits for it (``after``) before touching the drafter, on its
    own thread, so the next generation's Open and the tokens the verifier decodes alone are not held up either;
    ``wait_idle(drafter)`` waits for it before using a drafter outside an ``EdgeClient``."""

    def __init__(self, drafter: Drafter, events: queue.SimpleQueue[Event]):
        self.drafter, self.events = drafter, events
        self._after: DrafterWorker | None = None
        self._forget = False
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="drafter", daemon=True)
        self._started = threading.Event()

    def start(self, after: DrafterWorker | None = None, forget: bool = False) -> None:
        """``forget``: drop the cells the drafter kept from earlier sessions before the first job (they belong to
        another cache partition)."""
        self._after, self._forget = after, forget
        self._thread.start()
        self._started.set()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """No more jobs: queued ones are dropped (their generation is over), the one in progress finishes (the
        drafter is never left mid-operation), then the thread ends."""
        try:
            while True:
                self._jobs.get_nowait()
        except queue.Empty:
            pass
        self._jobs.put(None)

    def join(self) -> None:
        self._started.wait()  # registered before it started: a waiter may come that early
        self._thread.join()

    def _loop(self) -> None:
        if self._after is not None:  # the previous generation's last job still owns the drafter
            self._after.join()
            self._after = None
        if self._forget:
            try:
                self.drafter.start([])
            except BaseException as e:
                self.events.put(("fail", e))
                return
        while (job := self._jobs.get()) is not None:
            try:
                result, draft_ms, catch_up = self._run(job)
                self.events.put(("job", job.tag, result, draft_ms, catch_up, time.perf_counter()))
            except BaseException as e:  # a drafter failure ends the generation with that error
                self.events.put(("fail", e))

    def _run(self, job: Job) -> tuple[Any, float, tuple[int, float]]:
        """The last operation's result, its drafting time (ms), and the (tokens, ms) its catch-up evaluated."""
        d = self.drafter
        result: Any = None
        draft_ms, catch_up = 0.0, (0, 0.0)
        for op, *args in job.ops:
            t0 = time.perf_counter()
            if op in ("catch_up", "draft"):
                pending = d.pending()
                d.catch_up()
                t1 = time.perf_counter()
                catch_up = (pending, (t1 - t0) * 1000)
                if op == "draft":
                    result = d.draft(args[0])
                    draft_ms = (time.perf_counter() - t1) * 1000
            elif op == "start":
                d.start(args[0])
            elif op == "extend":
                d.commit(NO_TREE, (), args[0])
            elif op == "commit":
                d.commit(*args)
            elif op == "speculate":
                result = cast(SpeculativeDrafter, d).speculate(*args)  # (queued only for such a drafter)
                draft_ms = (time.perf_counter() - t0) * 1000
            elif op == "adopt":
                result = cast(SpeculativeDrafter, d).adopt()
            else:
                raise ValueError(f"unknown drafter operation {op!r}")
        return result, draft_ms, catch_up


# the last worker of each drafter, whose final job may still run after its generation ended
_LAST_WORKER: weakref.WeakKeyDictionary[object, DrafterWorker] = weakref.WeakKeyDictionary()
_LAST_WORKER_LOCK = threading.Lock()


def hand_over(drafter: Drafter, worker: DrafterWorker) -> DrafterWorker | None:
    """Record ``worker`` as the drafter's current one; returns the previous one (to wait for), or raises
    TypeError for a drafter that cannot be tracked (no weak references): then generations join at their end."""
    with _LAST_WORKER_LOCK:
        previous = _LAST_WORKER.get(drafter)
        _LAST_WORKER[drafter] = worker
    return previous


def wait_idle(drafter: Drafter) -> None:
    """Wait until no finished generation's last job still uses ``drafter`` (before using it directly)."""
    with _LAST_WORKER_LOCK:
        try:
            worker = _LAST_WORKER.get(drafter)
        except TypeError:
            return
    if worker is not None:
        worker.join()
