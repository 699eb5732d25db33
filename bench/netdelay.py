"""An in-process network delay for gRPC session streams: every message, each way, arrives ``one_way_ms`` (± jitter)
after it was sent, in order, and messages in flight overlap as on a real link (a stream of verdicts is delayed,
not spaced out). Good enough for tests and quick benches; the namespace test bed (bench/netbed.py) emulates a link
with the kernel's help."""
from __future__ import annotations

import queue
import random
import threading
import time

import grpc

_END = object()


class _Link:
    """One direction: items put now come out of ``get`` no earlier than their due time, in order."""

    def __init__(self, delay):
        self._delay = delay
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._last_due = 0.0

    def put(self, item) -> None:
        due = max(time.monotonic() + self._delay(), self._last_due)  # jitter never reorders
        self._last_due = due
        self._q.put((due, item))

    def get(self):
        due, item = self._q.get()
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return item


class _DelayedResponses:
    def __init__(self, call, delay):
        self._call = call
        self._link = _Link(delay)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for msg in self._call:
                self._link.put(msg)
            self._link.put(_END)
        except grpc.RpcError as e:
            self._link.put(e)

    def __iter__(self):
        return self

    def __next__(self):
        item = self._link.get()
        if item is _END:
            raise StopIteration
        if isinstance(item, grpc.RpcError):
            raise item
        return item

    def __getattr__(self, name):  # cancel(), code(), details(), ...
        return getattr(self._call, name)


class DelayInterceptor(grpc.StreamStreamClientInterceptor):
    def __init__(self, one_way_ms: float, jitter_ms: float = 0.0, seed: int = 0):
        self.one_way_ms = one_way_ms
        self.jitter_ms = jitter_ms
        self._rng = random.Random(seed)

    def _delay(self) -> float:
        jitter = self._rng.uniform(-self.jitter_ms, self.jitter_ms) if self.jitter_ms else 0.0
        return max(0.0, self.one_way_ms + jitter) / 1000

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        link = _Link(self._delay)

        def pump():
            for req in request_iterator:
                link.put(req)
            link.put(_END)

        threading.Thread(target=pump, daemon=True).start()
        return _DelayedResponses(continuation(client_call_details, iter(link.get, _END)), self._delay)
