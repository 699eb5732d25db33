"""The baselines on the same replicas: devices that do no drafting.

- ``ServerAR`` (server-only serving): after the prefill the replica decodes one token per forward for the session,
  batched with every other session (continuous batching), and streams each over the link.
- ``ServerSD`` (server-side speculation): the drafter runs on the GPU too. Each round drafts a chain of ``depth``
  (``depth`` drafter forwards, batched across sessions, on the drafter's curve), then verifies it in one target
  forward; acceptance from the same trace as Tandem's; every committed token is streamed.
"""
from __future__ import annotations

from typing import Callable

from .events import Link, Sim
from .replica import Replica, Work
from .traces import Text


class ServerAR:
    depth = 0

    def __init__(self, sim: Sim, pool, text: Text, max_new: int, up: Link, down: Link, sid: str,
                 on_end: Callable[["ServerAR"], None], on_emit: Callable[[int], None]):
        self.sim, self.pool, self.text, self.max_new, self.down = sim, pool, text, max_new, down
        self.sid, self.on_end, self.on_emit = sid, on_end, on_emit
        self.generated = self.received = 0
        self.replica: Replica | None = None
        up.send(lambda: pool.admit(sid, self._open))

    def _open(self, replica: Replica) -> None:
        self.replica = replica
        replica.open_sessions += 1
        replica.submit(Work(self, self.text.prompt_tokens, lambda ms, q: self._round(), "prefill"))

    def _context(self) -> int:
        return self.text.prompt_tokens + self.generated

    def _round(self) -> None:
        """The next forward's work for this session (one token here)."""
        self.replica.submit(Work(self, 1, lambda ms, q: self._commit(1), context=self._context()))

    def _commit(self, n: int) -> None:
        n = min(n, self.max_new - self.generated)
        self.generated += n
        self.replica.committed += n
        self.down.send(lambda: self._arrive(n))
        if self.generated >= self.max_new:
            self.replica.open_sessions -= 1
            self.pool.release(self.sid)
        else:
            self._round()

    def _arrive(self, n: int) -> None:
        self.received += n
        self.on_emit(n)
        if self.received >= self.max_new:
            self.on_end(self)


class ServerSD(ServerAR):
    def __init__(self, *args, depth: int = 4, **kw):
        self.depth = depth
        super().__init__(*args, **kw)

    def _round(self) -> None:
        self._draft(self.depth)

    def _draft(self, left: int) -> None:
        if left == 0:
            self.replica.submit(Work(self, 1 + self.depth, lambda ms, q: self._commit(self._held() + 1),
                                     context=self._context()))
        else:
            self.replica.submit(Work(self, 1, lambda ms, q: self._draft(left - 1), "drafter",
                                     context=self._context() + self.depth - left))

    def _held(self) -> int:
        i = self.generated
        return min(self.text.runs[i], self.depth) if i < len(self.text.runs) else 0
