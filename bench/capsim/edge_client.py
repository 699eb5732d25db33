"""A Tandem edge client on the virtual clock: the product's own round loop (``edge.rounds.RoundLoop``) and planner
(the draft policy, or a fixed shape), a drafter whose operations take a device class's measured times and whose
chains come from the acceptance trace, and the link to its verifier session.

The drafter (``SimDrafter``) runs the loop's jobs one at a time, as the real client's drafter thread does: catching
up costs ``catch_up_ms`` per committed token it has not evaluated, a tree ``level_ms`` per level (a level of a wider
tree evaluates its k frontier nodes in one batch: half a level more per extra node, the policy's own assumption).
A chain drafted at output position i holds its first min(L[i], d) tokens (the trace); a tree's other candidates
hold as ``trees`` models them; the rest are tokens the target never emits. A conversation's earlier turns are in
the drafter's kept cells (``cached``): only the new turn is caught up on.
"""
from __future__ import annotations

import random
import zlib
from typing import Callable

from tandem.core.messages import Limits, Opened
from tandem.edge.rounds import Emit, Job, RoundLoop, SendClose, SendDraft, SendOpen

from . import trees
from .events import Link, Sim
from .physics import Device
from .replica import Replica, VerifierSession
from .traces import Text


class SimDrafter:
    def __init__(self, sim: Sim, device: Device, prompt_len: int, text: Text,
                 done: Callable[[int, object, float, tuple[int, float]], None], cached: int = 0,
                 rng: random.Random | None = None, agree: float = 0.8, after: "SimDrafter | None" = None):
        """``after``: the device's drafter of its last request, whose final jobs run to their end first (the real
        client's next generation waits for its drafter thread likewise)."""
        self.sim, self.device, self.prompt_len, self.text, self.done = sim, device, prompt_len, text, done
        self.history: list[int] = []
        self.n_kv = 0
        self.cached, self.agree = cached, agree
        self.ranks = trees.Ranks(text.runs, rng or random.Random(0))
        self.jobs: list[Job] = []
        self.busy = False
        self.after = after if after is not None and after.busy else None
        self.on_idle: list[Callable[[], None]] = []

    def submit(self, job: Job) -> None:
        self.jobs.append(job)
        if self.busy:
            return
        if self.after is not None and self.after.busy:
            self.busy = True
            self.after.on_idle.append(self._next)
        else:
            self._next()

    def _next(self) -> None:
        if not self.jobs:
            self.busy = False
            waiting, self.on_idle = self.on_idle, []
            for resume in waiting:
                resume()
            return
        self.busy = True
        job = self.jobs.pop(0)
        result, total, draft_ms, catch_up = None, 0.0, 0.0, (0, 0.0)
        for op, *args in job.ops:
            if op in ("catch_up", "draft"):
                pending = len(self.history) - self.n_kv
                ms = pending * self.device.catch_up_ms
                catch_up, total, self.n_kv = (pending, ms), total + ms, len(self.history)
                if op == "draft":
                    shape = args[0]
                    result = trees.build(shape, len(self.history) - self.prompt_len, self.ranks, self.agree)
                    draft_ms = result.tree.depth * self.device.level_ms * (1 + 0.5 * (shape.k - 1))
                    total += draft_ms
            elif op == "start":
                self.history, self.n_kv = list(args[0]), min(self.cached, len(args[0]))
            elif op == "extend":
                self.history += list(args[0])
            elif op == "commit":
                built, path, tokens = args
                self.history += list(tokens)
                self.n_kv = min(len(self.history), self.n_kv + min(len(path), max(0, len(built.tree) - 1)))
            else:
                raise ValueError(f"the simulated drafter does not {op}")
        self.sim.after(total / 1000, lambda: self._finish(job, result, draft_ms, catch_up))

    def _finish(self, job: Job, result, draft_ms: float, catch_up: tuple[int, float]) -> None:
        self.done(job.tag, result, draft_ms, catch_up)
        self._next()


class EdgeClient:
    """One request of one device: opens a session where the pool places it, runs the round loop to the end, and
    reports each batch of tokens as it reaches the user (``on_emit``)."""

    def __init__(self, sim: Sim, pool, planner, device: Device, text: Text, max_new: int, up: Link, down: Link,
                 sid: str, partition: str = "", max_tree: tuple[int, int] = (64, 16),
                 on_end: Callable[["EdgeClient"], None] = lambda c: None, on_emit: Callable[[int], None] = len,
                 prompt_len: int = 0, cached: int = 0, device_cached: int = 0, rng: random.Random | None = None,
                 agree: float = 0.8, drafter_before: SimDrafter | None = None):
        """``prompt_len``: the whole prompt (default: the text's); ``cached``: its first tokens in the verifier's
        prefix cache; ``device_cached``: in the drafter's kept cells."""
        self.sim, self.pool, self.up, self.down, self.sid = sim, pool, up, down, sid
        self.on_end, self.on_emit = on_end, on_emit
        self.prompt = tuple(range(-(prompt_len or text.prompt_tokens), 0))
        self.cached = cached
        self.max_new, self.limits = max_new, Limits(max_new, *max_tree)
        planner.new_request(partition)
        self.loop = RoundLoop(self.prompt, max_new, planner, self.limits)
        self.drafter = SimDrafter(sim, device, len(self.prompt), text, self._job_done, device_cached, rng, agree,
                                  drafter_before)
        self.partition = partition
        # the host drafts the same text with draws of its own (none taken from ``rng``: runs without a host stay as
        # they were)
        self.host_ranks = trees.Ranks(text.runs, random.Random(zlib.crc32(f"host/{sid}".encode())))
        self.session: VerifierSession | None = None
        self.t_open = sim.now
        self.ended = self.closing = False
        self._do(self.loop.begin(sim.now))

    def _do(self, actions) -> None:
        for a in actions:
            if isinstance(a, Emit):
                self.on_emit(len(a.tokens))
            elif isinstance(a, Job):
                self.drafter.submit(a)
            elif isinstance(a, SendOpen):
                self.up.send(lambda a=a: self._open(a))
            elif isinstance(a, SendDraft):
                self.up.send(lambda a=a: self.session is not None and self.session.on_draft(a.draft))
            elif isinstance(a, SendClose):
                self._send_close()
        if self.loop.finish is not None and not self.ended:
            self.ended = True
            self._send_close()
            self.on_end(self)

    def _open(self, a: SendOpen) -> None:
        def opened(replica: Replica) -> None:
            self.session = VerifierSession(replica, len(a.prompt), self.limits, self._reply, a.decode_steps,
                                           self.sid, self.cached, a.host_draft, self.host_ranks, self.partition)
            if self.closing:  # the client finished while the open waited for room
                self._close()
        self.pool.admit(self.sid, opened)

    def _send_close(self) -> None:
        if not self.closing:
            self.closing = True
            self.up.send(self._close)

    def _close(self) -> None:
        if self.session is not None and not self.session.closed:
            self.session.close()
            self.pool.release(self.sid)

    def _reply(self, message) -> None:
        self.down.send(lambda: self._arrive(message))

    def _arrive(self, message) -> None:
        if self.loop.finish is not None:
            return
        if isinstance(message, Opened):
            self._do(self.loop.on_opened(message, self.sim.now))
        else:
            self._do(self.loop.on_verdict(message, self.sim.now))

    def _job_done(self, tag: int, result, draft_ms: float, catch_up: tuple[int, float]) -> None:
        self._do(self.loop.on_job_done(tag, result, draft_ms, catch_up, self.sim.now))
