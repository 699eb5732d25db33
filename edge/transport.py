"""The edge's side of the gRPC link to a verifier: one session stream (``SessionStream``), the unary calls (Health,
the target's tokenizer file), and the error they raise (``RemoteError``). No round logic: edge/client.py drives
these from the round loop's actions."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from tandem.core.errors import TandemError
from tandem.core.vocab import is_fingerprint
from tandem.protos import verifier_pb2 as pb
from tandem.protos import verifier_pb2_grpc as pb_grpc

from .drafter_worker import Event

Metadata = Sequence[tuple[str, str]]


class RemoteError(TandemError, RuntimeError):
    """The verifier refused a request or could not be reached; ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"verifier: {code.name}: {details}")
        self.code = code
        self.details = details


class SessionStream:
    """One session stream; every response (or the stream's end or error) goes onto the event queue tagged with
    this connection's number, so a dropped connection's late messages are recognised."""

    def __init__(
        self,
        stub: pb_grpc.VerifierStub,
        metadata: Metadata,
        timeout_s: float,
        events: queue.SimpleQueue[Event],
        conn: int,
    ):
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._call = stub.Session(iter(self._requests.get, None), timeout=timeout_s, metadata=metadata)
        self._events, self.conn = events, conn
        threading.Thread(target=self._read, name="verifier-stream", daemon=True).start()

    def send(self, msg: pb.SessionRequest) -> None:
        self._requests.put(msg)

    def end_requests(self) -> None:
        self._requests.put(None)

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()

    def _read(self) -> None:
        try:
            for msg in self._call:
                self._events.put(("msg", self.conn, msg, time.perf_counter()))
            self._events.put(("end", self.conn, None, time.perf_counter()))
        except grpc.RpcError as e:
            self._events.put(("error", self.conn, e, time.perf_counter()))


def verifier_health(stub: pb_grpc.VerifierStub, timeout_s: float, metadata: Metadata = ()) -> pb.HealthResponse:
    try:
        response: pb.HealthResponse = stub.Health(pb.HealthRequest(), timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as e:
        raise RemoteError(e.code(), e.details()) from None
    return response


def target_tokenizer_file(
    stub: pb_grpc.VerifierStub, metadata: Metadata, h: pb.HealthResponse, timeout_s: float
) -> tuple[Path, Any]:
    """The target's tokenizer file (a vocabulary-only GGUF or a ``tokenizer.json``, ``translate.SUFFIX``) in this
    machine's cache under the vocabulary fingerprint the verifier publishes in its Health ``h`` (fetched from it
    when not there yet), and the tokenizer loaded from it, which must have that fingerprint."""
    from .translate import load_tokenizer

    if not h.vocab_fingerprint:
        raise RemoteError(grpc.StatusCode.FAILED_PRECONDITION, "the verifier publishes no vocabulary fingerprint")
    if not is_fingerprint(h.vocab_fingerprint):  # (it names a file here: nothing else may)
        raise RemoteError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the verifier publishes a vocabulary fingerprint that is not a sha256 (64 lowercase "
            f"hex digits): {h.vocab_fingerprint[:80]!r}",
        )
    path = _fetch_tokenizer_file(stub, metadata, h.vocab_fingerprint, timeout_s)
    tokenizer = load_tokenizer(path, h.vocab_size)
    if tokenizer.vocab_fingerprint != h.vocab_fingerprint:
        path.unlink(missing_ok=True)
        raise RemoteError(
            grpc.StatusCode.DATA_LOSS,
            "the verifier's tokenizer file does not have the vocabulary fingerprint it publishes",
        )
    return path, tokenizer


def _fetch_tokenizer_file(stub: pb_grpc.VerifierStub, metadata: Metadata, fingerprint: str, timeout_s: float) -> Path:
    """The tokenizer file cached under ``fingerprint``, fetched from the verifier when it is not there yet."""
    from .translate import SUFFIX, tokenizer_cache

    cached = [p for p in (tokenizer_cache(fingerprint, k) for k in SUFFIX) if p.is_file()]
    if cached:
        return cached[0]
    try:
        chunks = list(stub.Tokenizer(pb.TokenizerRequest(), timeout=timeout_s, metadata=metadata))
    except grpc.RpcError as e:
        raise RemoteError(e.code(), e.details()) from None
    kind = chunks[0].format if chunks else ""
    if kind not in SUFFIX:
        raise RemoteError(
            grpc.StatusCode.UNIMPLEMENTED, f"the verifier's tokenizer comes as {kind!r}, which this client cannot load"
        )
    path = tokenizer_cache(fingerprint, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(b"".join(c.data for c in chunks))
    tmp.replace(path)
    return path
