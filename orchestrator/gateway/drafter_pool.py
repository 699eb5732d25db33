"""The gateway's drafters, lent to one request at a time, each request to the drafter that has the most of it.

A drafter keeps the cells of its last generation's history (``edge.llama_drafter.LlamaDrafter.start``: the next
turn of a chat evaluates only its new message) and forgets them when a generation of another cache partition comes
(``edge.client``). So the next turn of a conversation should go back to the drafter that drafted the last one: a
request goes to the free drafter whose last request was of its partition and shares the longest prefix with its
prompt; with none, to the one free the longest (the others keep their partitions' histories for their next turns).
Only a partition's own history counts, so which drafter a request gets says nothing of other tenants' prompts.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

from tandem.core.tree import common_prefix

if TYPE_CHECKING:
    from tandem.edge.client import EdgeClient


class DrafterPool:
    """Edge clients (one drafter each) lent to one request at a time."""

    def __init__(self, clients: Sequence[EdgeClient]):
        self.clients = list(clients)
        self._lock = threading.Lock()
        self._free: list[EdgeClient] = list(self.clients)  # the one free the longest first
        self._last: dict[int, tuple[str, list[int]]] = {}  # id(client) -> (partition, prompt) of its last request

    def acquire(self, partition: str = "", prompt: Sequence[int] = ()) -> EdgeClient | None:
        """The free client with the longest prefix of ``prompt`` from ``partition``'s last requests, else the one
        free the longest; None when all are lent."""
        prompt = list(prompt)
        with self._lock:
            if not self._free:
                return None
            best, shared = 0, 0
            for i, client in enumerate(self._free):
                last = self._last.get(id(client))
                n = common_prefix(last[1], prompt) if last is not None and last[0] == partition else 0
                if n > shared:
                    best, shared = i, n
            client = self._free.pop(best)
            self._last[id(client)] = (partition, prompt)
            return client

    def release(self, client: EdgeClient) -> None:
        with self._lock:
            self._free.append(client)

    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        for c in self.clients:
            c.close()
