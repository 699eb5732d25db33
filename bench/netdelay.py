"""An in-process network delay for gRPC session streams: each message waits ``one_way_ms`` (± jitter) before it
is sent, and each response before it is handed to the caller. Good enough to test and measure a round-trip protocol
with one message in flight per direction; the namespace test bed emulates a real link."""
from __future__ import annotations

import random
import time

import grpc


class _DelayedResponses:
    def __init__(self, call, delay):
        self._call = call
        self._delay = delay

    def __iter__(self):
        return self

    def __next__(self):
        msg = next(self._call)
        time.sleep(self._delay())
        return msg

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
        def delayed():
            for req in request_iterator:
                time.sleep(self._delay())
                yield req

        return _DelayedResponses(continuation(client_call_details, delayed()), self._delay)
