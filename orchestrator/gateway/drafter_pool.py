"""The gateway's drafters, lent to one request at a time, each request to the drafter that has the most of it; when
every drafter is lent, requests wait their turn in a bounded queue.

A drafter keeps the cells of its last generation's history (``edge.llama_drafter.LlamaDrafter.start``: the next
turn of a chat evaluates only its new message) and forgets them when a generation of another cache partition comes
(``edge.client``). So the next turn of a conversation should go back to the drafter that drafted the last one: a
request goes to the free drafter whose last request was of its partition and shares the longest prefix with its
prompt; with none, to the one free the longest (the others keep their partitions' histories for their next turns).
Only a partition's own history counts, so which drafter a request gets says nothing of other tenants' prompts.

Waiting requests are served first come, first served: a drafter given back goes straight to the request that has
waited the longest (whatever the drafter holds: a waiter takes the first drafter to come free), so no drafter is free
while requests wait and a later request cannot pass them.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence

from tandem.core.tree import common_prefix

if TYPE_CHECKING:
    from tandem.edge.client import EdgeClient


class PoolFull(Exception):
    """Every drafter is lent and ``max_waiting`` requests already wait."""


class QueueTimeout(Exception):
    """No drafter came free within the request's wait."""


class Gone(Exception):
    """The waiting request's caller went away (``gone()`` turned true)."""


class _Waiter:
    def __init__(self, loop: asyncio.AbstractEventLoop, partition: str, prompt: list[int]):
        self.loop, self.partition, self.prompt = loop, partition, prompt
        self.future: asyncio.Future = loop.create_future()
        self.client: EdgeClient | None = None  # set, under the pool's lock, when a drafter is handed over


class DrafterPool:
    """Edge clients (one drafter each) lent to one request at a time."""

    def __init__(self, clients: Sequence[EdgeClient]):
        self.clients = list(clients)
        self._lock = threading.Lock()
        self._free: list[EdgeClient] = list(self.clients)  # the one free the longest first
        self._last: dict[int, tuple[str, list[int]]] = {}  # id(client) -> (partition, prompt) of its last request
        self._waiting: deque[_Waiter] = deque()  # oldest first

    def _take(self, partition: str, prompt: list[int]) -> EdgeClient:
        """The free client with the longest prefix of ``prompt`` from ``partition``'s last requests, else the one
        free the longest (under the lock, with one free)."""
        best, shared = 0, 0
        for i, client in enumerate(self._free):
            last = self._last.get(id(client))
            n = common_prefix(last[1], prompt) if last is not None and last[0] == partition else 0
            if n > shared:
                best, shared = i, n
        client = self._free.pop(best)
        self._last[id(client)] = (partition, prompt)
        return client

    def acquire(self, partition: str = "", prompt: Sequence[int] = ()) -> EdgeClient | None:
        """A client now (see ``_take``), or None when all are lent."""
        with self._lock:
            if not self._free:
                return None
            return self._take(partition, list(prompt))

    async def lend(self, partition: str = "", prompt: Sequence[int] = (), max_waiting: int = 0,
                   timeout_s: float = 0.0, gone: Callable[[], Awaitable[bool]] | None = None,
                   poll_s: float = 0.25) -> EdgeClient:
        """A client now, else after waiting in line (first come, first served) for at most ``timeout_s``. Raises
        ``PoolFull`` when ``max_waiting`` requests already wait, ``QueueTimeout`` past the wait, and ``Gone`` as
        soon as ``gone()`` (asked every ``poll_s`` while waiting) says the caller left."""
        prompt = list(prompt)
        with self._lock:
            if self._free:
                return self._take(partition, prompt)
            if len(self._waiting) >= max_waiting:
                raise PoolFull
            waiter = _Waiter(asyncio.get_running_loop(), partition, prompt)
            self._waiting.append(waiter)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise QueueTimeout
                done, _ = await asyncio.wait({waiter.future}, timeout=min(poll_s, left))
                if done:
                    return waiter.future.result()
                if gone is not None and await gone():
                    raise Gone
        except BaseException:  # timed out, gone or cancelled: out of the line, or the drafter handed over goes back
            with self._lock:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
                    client = None
                else:
                    client = waiter.client
            if client is not None:
                self.release(client)
            raise

    def release(self, client: EdgeClient) -> None:
        """Give ``client`` back: to the request waiting the longest, else to the free ones. Any thread."""
        with self._lock:
            if not self._waiting:
                self._free.append(client)
                return
            waiter = self._waiting.popleft()
            waiter.client = client
            self._last[id(client)] = (waiter.partition, waiter.prompt)
        try:
            waiter.loop.call_soon_threadsafe(_hand, waiter.future, client)
        except RuntimeError:  # its loop is closed (the gateway stopped): nobody will take it
            with self._lock:
                self._free.append(client)

    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def waiting(self) -> int:
        """Requests waiting for a drafter."""
        with self._lock:
            return len(self._waiting)

    def close(self) -> None:
        for c in self.clients:
            c.close()


def _hand(future: asyncio.Future, client: EdgeClient) -> None:
    if not future.done():
        future.set_result(client)
