"""The baselines on the same GPUs: devices that do no drafting.

- ``ServerAR`` (server-only serving): after the prefill the replica decodes one token per forward for the session,
  batched with every other session (continuous batching, the product's own scheduler mirrored in ``replica``), and
  streams each over the link.
- ``ServerSD`` (server-side speculation): a session of a ``lockstep.LockstepReplica``, which drafts for all its
  sessions on the GPU and verifies them in lock-step rounds, at a depth it chooses per step (0: plain decoding).
  Its acceptance comes from the text it is given: the recorded traces of the same drafter as Tandem's (``server_sd``)
  or a published EAGLE-class acceptance (``server_eagle``, ``eagle_text``). Every committed token is streamed.

``prompt_len``: the request's whole prompt (the conversation so far and its new turn); ``cached``: how much of it
the replica's prefix cache already holds (not computed again).
"""
from __future__ import annotations

import random
from typing import Callable

from .events import Link, Sim
from .replica import Replica, Work
from .traces import Text

RUN_CAP = 16  # the traces' chains are recorded to this depth


class ServerAR:
    depth = 0

    def __init__(self, sim: Sim, pool, text: Text, max_new: int, up: Link, down: Link, sid: str,
                 on_end: Callable[["ServerAR"], None], on_emit: Callable[[int], None], prompt_len: int = 0,
                 cached: int = 0):
        self.sim, self.pool, self.text, self.max_new, self.down = sim, pool, text, max_new, down
        self.sid, self.on_end, self.on_emit = sid, on_end, on_emit
        self.prompt_len = prompt_len or text.prompt_tokens
        self.cached = min(cached, self.prompt_len - 1)
        self.generated = self.received = 0
        self.replica: Replica | None = None
        up.send(lambda: pool.admit(sid, self._open))

    def _prefill(self, replica, done: Callable[[float, int], None]) -> None:
        self.replica = replica
        replica.open_sessions += 1
        replica.submit(Work(self, self.prompt_len - 1 - self.cached, done, "prefill", context=self.cached))

    def _open(self, replica: Replica) -> None:
        self._prefill(replica, lambda ms, q: self._round())

    def context(self) -> int:
        return self.prompt_len + self.generated

    def _round(self) -> None:
        """The next forward's work for this session (one token)."""
        self.replica.submit(Work(self, 1, lambda ms, q: self._commit(1) or self._round(), context=self.context()))

    def _commit(self, n: int) -> bool:
        """Commit up to ``n`` tokens and stream them; True when the answer is complete."""
        n = min(n, self.max_new - self.generated)
        self.generated += n
        self.replica.committed += n
        self.down.send(lambda: self._arrive(n))
        if self.generated >= self.max_new:
            self.replica.open_sessions -= 1
            self.pool.release(self.sid)
            return True
        return False

    def _arrive(self, n: int) -> None:
        self.received += n
        self.on_emit(n)
        if self.received >= self.max_new:
            self.on_end(self)


class ServerSD(ServerAR):
    """A session of a ``LockstepReplica``: it joins the replica's steps once its prompt is in."""

    def _open(self, replica) -> None:
        self._prefill(replica, lambda ms, q: replica.join(self))

    def held(self, depth: int) -> int:
        i = self.generated
        return min(self.text.runs[i], depth) if i < len(self.text.runs) else 0

    def commit(self, tokens: int) -> None:
        if self._commit(tokens):
            self.replica.leave(self)


def eagle_text(text: Text, alpha: float, rng: random.Random) -> Text:
    """``text`` with its acceptance replaced by an EAGLE-class drafter's: every position's first choice is the
    target's token with probability ``alpha``, independently (a flat acceptance by depth, as EAGLE-3 reports it),
    and ``L[i]`` is the run of such positions from i (capped as the recorded traces are)."""
    hits = [rng.random() < alpha for _ in text.runs]
    runs, run = [0] * len(hits), 0
    for i in range(len(hits) - 1, -1, -1):
        run = run + 1 if hits[i] else 0
        runs[i] = min(run, RUN_CAP)
    return Text(text.dataset, text.prompt_tokens, tuple(runs))
