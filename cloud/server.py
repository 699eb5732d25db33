"""gRPC verifier service (asyncio): a thin servicer that converts wire <-> domain around a ``Backend``.

One event loop serves every session stream; compute happens on the backend's engine thread, which verifies the
pending drafts of many sessions in one forward (cloud/scheduler.py). A session stream reads requests as they come:
while the verifier decodes tokens alone (``decode_steps``; drafted by its host where the session asks,
cloud.host_drafting), a Draft that arrives stops the run at the next token and is verified (rebased onto those
tokens) at once: the target never waits for the edge, nor the edge for a run. A bad request ends only its stream.

Tenancy and limits (``StreamLimits``, checked before anything reaches the backend): a session's cache partition
comes from its ``cache_salt`` and its verifier key (core.tenancy); a key holds ``key_sessions`` sessions, prefills
``key_prefill_tokens_per_minute`` (core.quota) and keeps ``key_pending_streams`` streams without their Open (due
within ``open_timeout_s``); a ``Tokenizer`` or ``DrafterAdapter`` download takes a session slot and
``DOWNLOAD_COST_TOKENS``; a session lives ``session_lifetime_s`` at most; a stream buffers ``inbox_messages``
requests (then gRPC's flow control pushes back). Gateway keys (``exempt``) are outside the per-key limits.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator

import grpc

from tandem.core import tenancy, tracing, wire
from tandem.core.model_id import model_slug
from tandem.core.auth import ApiKeys, GrpcAuthInterceptor, Tls, metadata_key
from tandem.core.quota import KeyLimits, Lease, QuotaExceeded, Quotas, Units
from tandem.core.messages import EMPTY, DraftRequest, Finish, Limits, Verdict
from tandem.protos import verifier_pb2 as pb
from tandem.protos import verifier_pb2_grpc as pb_grpc

from . import metrics
from .backend import Backend, LocalBackend, ReplicaLost
from .engines.engine import VerifierEngine
from .grpc_health import set_health, standard_health
from .host_drafting import HostDrafting, HostSession
from .scheduler import Scheduler
from .learning.teacher import TeacherStore
from .session import Exhausted, InvalidRequest, Refused, UnknownSession, VerifierError

log = logging.getLogger("tandem.cloud.server")

STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownSession: grpc.StatusCode.NOT_FOUND,
    Refused: grpc.StatusCode.FAILED_PRECONDITION,
    Exhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ReplicaLost: grpc.StatusCode.UNAVAILABLE,
}


class _Expired(Exception):
    """The client sent nothing for the idle timeout."""


class PortInUse(OSError):
    """A server could not listen where it was told to."""


@dataclass(frozen=True)
class StreamLimits:
    """Limits of the gRPC plane, per verifier key and per stream (0: off)."""
    key_sessions: int = 0  # sessions one key holds at once
    key_prefill_tokens_per_minute: int = 0  # prompt tokens one key's Opens prefill per minute (resumes included)
    session_lifetime_s: float = 0.0  # longest a session may live, however busy
    inbox_messages: int = 8  # requests a stream buffers before flow control pushes back on its client
    key_pending_streams: int = 16  # streams one key holds open before their Open


TOKENIZER_CHUNK_BYTES = 1 << 20  # under gRPC's default 4 MB message limit, whatever the client's settings
DOWNLOAD_COST_TOKENS = 1024  # prefill tokens a Tokenizer or DrafterAdapter download takes from its key's budget
GRPC_UNITS = Units("this verifier key", "sessions", "prefill tokens", "--key-sessions",
                   "--key-prefill-tokens-per-minute")


class VerifierServicer(pb_grpc.VerifierServicer):
    """Wire <-> domain around a ``Backend`` (one local engine, or a Ray pool of replicas)."""

    def __init__(self, backend: Backend, idle_timeout_s: float = 300.0, open_timeout_s: float = 10.0,
                 max_streams: int = 256, chat_template: str = "", limits: StreamLimits = StreamLimits(),
                 exempt: ApiKeys = ApiKeys(), teach: ApiKeys = ApiKeys(), host: HostDrafting | None = None,
                 keys: ApiKeys = ApiKeys()):
        """``keys``: the verifier keys (Health's load figures are theirs alone); ``exempt``: keys the per-key
        limits do not apply to (gateways, which limit their own callers); ``teach``:
        keys whose tenants opted in to keeping the target's distribution at their positions
        (cloud.learning.teacher); ``host``: the host's drafter, for sessions that ask it to draft
        (cloud.host_drafting)."""
        if limits.inbox_messages < 1:
            raise ValueError(f"inbox_messages must be >= 1, got {limits.inbox_messages}")
        self.limits, self.exempt, self.teach, self.host, self.keys = limits, exempt, teach, host, keys
        self.quotas = Quotas(KeyLimits(limits.key_sessions, limits.key_prefill_tokens_per_minute), units=GRPC_UNITS)
        self.backend = backend
        self.chat_template = chat_template  # published instead of the target's own (--chat-template)
        self.idle_timeout_s = idle_timeout_s  # a session stream silent this long is ended and its cache freed
        self.open_timeout_s = open_timeout_s  # a stream must send Open this soon (silent streams hold nothing)
        self.max_streams = max_streams  # session streams at once; Health is never counted
        self.streams = 0
        self.pending: dict[str, int] = {}  # streams without their Open yet, by key (tenancy.tenant)
        self.draining = False
        self.model_name = model_slug(backend.info.model_id)  # the metrics' model_name label

    async def Health(self, request, context):
        i = self.backend.info  # keyless for liveness probes; the load figures only for a caller holding a key
        load = self.keys.check(metadata_key(context.invocation_metadata()))
        return pb.HealthResponse(target_model=i.model_id, engine=i.engine, vocab_size=i.vocab_size,
                                 vocab_fingerprint=i.vocab_fingerprint, n_ctx=i.n_ctx,
                                 active_sessions=self.backend.active_sessions() if load else 0,
                                 max_sessions=i.max_sessions if load else 0,
                                 draining=self.draining, chat_template=self.chat_template or i.chat_template,
                                 bos_token=i.bos_token, eos_token=i.eos_token)

    def _exempt(self, key: str) -> bool:
        return self.exempt.enabled and self.exempt.check(key)

    async def _download(self, context) -> Lease | None:
        """A download's charge to its key (None for an exempt key): a session slot while it streams and
        ``DOWNLOAD_COST_TOKENS``; RESOURCE_EXHAUSTED when the key has neither to spare."""
        key = metadata_key(context.invocation_metadata())
        if self._exempt(key):
            return None
        try:
            return self.quotas.acquire(tenancy.tenant(key), DOWNLOAD_COST_TOKENS)
        except QuotaExceeded as e:
            metrics.ERRORS.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            raise  # (abort raises)

    async def Tokenizer(self, request, context):
        lease = await self._download(context)
        try:
            try:
                kind, data = await self.backend.tokenizer()
            except VerifierError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            if not data:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"this verifier's {self.backend.info.engine} "
                                                                   f"engine has no tokenizer file to offer")
            for lo in range(0, len(data), TOKENIZER_CHUNK_BYTES):
                yield pb.TokenizerChunk(format=kind if lo == 0 else "", data=data[lo:lo + TOKENIZER_CHUNK_BYTES],
                                        vocab_fingerprint=self.backend.info.vocab_fingerprint if lo == 0 else "")
        finally:
            if lease is not None:
                lease.release(DOWNLOAD_COST_TOKENS)

    async def DrafterAdapter(self, request, context):
        try:
            tenancy.check_salt(request.cache_salt)
        except tenancy.SaltError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        lease = await self._download(context)
        try:
            partition = tenancy.partition(request.cache_salt, metadata_key(context.invocation_metadata()))
            found = await self.backend.adapter(partition, request.sha256)
            if found is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no drafter adapter {request.sha256[:16]!r} for "
                                                               f"this caller (adapters go to their own partition only)")
                return  # (abort raises)
            info, data = wire.adapter_to_wire(found[0]), found[1]
            for lo in range(0, len(data), TOKENIZER_CHUNK_BYTES):
                yield pb.AdapterChunk(format="gguf-lora" if lo == 0 else "", info=info if lo == 0 else None,
                                      data=data[lo:lo + TOKENIZER_CHUNK_BYTES])
        finally:
            if lease is not None:
                lease.release(DOWNLOAD_COST_TOKENS)

    async def Session(self, request_iterator, context):
        if self.streams >= self.max_streams:
            metrics.ERRORS.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this verifier serves {self.max_streams} "
                                                                    f"session streams at once; retry later")
        self.streams += 1
        try:
            async for response in self._stream(request_iterator, context):
                yield response
        finally:
            self.streams -= 1

    async def _stream(self, request_iterator, context):
        # bounded: when full, the reader stops reading and gRPC's flow control holds the client's further messages
        inbox: asyncio.Queue = asyncio.Queue(maxsize=self.limits.inbox_messages)
        reader = asyncio.create_task(_read(request_iterator, inbox))
        state = _Stream()
        state.key = metadata_key(context.invocation_metadata())
        cap, name = self.limits.key_pending_streams, tenancy.tenant(state.key)
        if cap and not self._exempt(state.key):
            if self.pending.get(name, 0) >= cap:
                reader.cancel()
                metrics.ERRORS.labels("RESOURCE_EXHAUSTED").inc()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this verifier key already holds {cap} "
                                                                        f"streams that have not sent their Open")
            self.pending[name] = self.pending.get(name, 0) + 1
            state.pending = name
        # the client's trace (traceparent metadata) continues here: a session span, a span per verify round
        state.span = tracing.start_span("tandem.verifier.session", tracing.extract(context.invocation_metadata()),
                                        "server", {"tandem.model": self.model_name})
        try:
            async for response in self._session(inbox, state):
                yield response
        except VerifierError as e:
            code = next((c for cls, c in STATUS.items() if isinstance(e, cls)), grpc.StatusCode.INTERNAL)
            message = e.args[0] if e.args else str(e)
            log.info("session %s: %s: %s", state.sid, code.name, message)
            metrics.ERRORS.labels(code.name).inc()
            state.span.set_status_error(f"{code.name}: {message}")
            await context.abort(code, message)
        except _Expired:
            if state.sid is None:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no Open within {self.open_timeout_s:.0f} s of the stream's start")
            log.info("session %s: stream idle for %.0f s: ended", state.sid, self.idle_timeout_s)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no message for {self.idle_timeout_s:.0f} s; "
                                                                   f"the session expired and its cache was freed")
        finally:
            reader.cancel()
            self._opened(state)
            if state.host is not None:
                state.host.stand()
            if state.lease is not None:  # the key's session slot is free; an opened session's prefill stays charged
                state.lease.release(state.lease.reserved if state.sid is not None else 0)
            state.span.set_attributes({"tandem.session_id": state.sid or "", "tandem.committed_len": state.committed})
            state.span.end()
            if state.sid is not None:
                metrics.SESSIONS.dec()
                if not state.closed:
                    try:
                        await self.backend.close(state.sid)
                    except VerifierError:
                        pass  # already gone (replica lost, or closed by the backend)

    def _opened(self, state: "_Stream") -> None:
        """The stream's first message arrived (or the stream ended): it no longer counts as pending."""
        if state.pending is not None:
            self.pending[state.pending] -= 1
            if not self.pending[state.pending]:
                del self.pending[state.pending]
            state.pending = None

    async def _session(self, inbox: asyncio.Queue, state: "_Stream") -> AsyncIterator[pb.SessionResponse]:
        req, _ = await self._receive(inbox, self.open_timeout_s)
        self._opened(state)
        if req is None:
            return
        kind = req.WhichOneof("kind")
        if kind in ("draft", "close"):
            raise UnknownSession(f"unknown session {getattr(req, kind).session_id!r}: send Open first on this stream")
        if kind != "open":
            raise InvalidRequest("empty SessionRequest: set one of open, draft, close")
        if self.draining:
            raise ReplicaLost("this verifier is shutting down; open the session on another replica")
        open_req = self._tenant(wire.open_from_wire(req.open), state)
        if self.limits.session_lifetime_s:
            state.deadline = time.monotonic() + self.limits.session_lifetime_s
        state.host = HostSession.before_open(self.host, open_req.cache_salt, open_req.prompt, open_req.host_draft)
        opened = await self.backend.open(open_req)
        state.sid, state.committed = opened.session_id, len(open_req.prompt)
        metrics.SESSIONS.inc()
        log.debug("opened %s: prompt %d tokens, limits %s", state.sid, len(open_req.prompt), opened.limits)
        if state.host is not None:
            opened = state.host.opened(opened)
        yield wire.opened_to_wire(opened)
        run, hosted = open_req.decode_steps, open_req.host_draft
        while True:
            if run > 0 and state.finish is Finish.NONE and inbox.empty():  # decode alone until a draft arrives
                before = state.committed  # (drafted by the host, where it drafts for this session)
                host = state.host if hosted and state.host is not None and state.host.ok else None
                tree = await host.chain() if host is not None else EMPTY
                yield await self._verify(state, DraftRequest(state.committed, tree), host=host)
                run -= max(1, state.committed - before)
                continue
            req, arrived_ns = await self._receive(inbox, state=state)
            if req is None:  # the client ended its side without Close: the session is freed in Session()
                return
            kind = req.WhichOneof("kind")
            if kind == "draft":
                _check_id(req.draft.session_id, state)
                if req.draft.seq < 1:
                    raise InvalidRequest("draft seq must be 1, 2, 3, ... in sending order (0 marks tokens the "
                                         "verifier decodes alone)")
                if state.finish is not Finish.NONE:
                    continue  # sent before the client saw the session finish: nothing to verify
                draft = wire.draft_from_wire(req.draft)
                yield await self._verify(state, draft, arrived_ns)
                run, hosted = draft.decode_steps, draft.host_draft
                if state.host is not None and not hosted:
                    state.host.stand()  # the client drafts itself again: its seat goes to another session
            elif kind == "close":
                _check_id(req.close.session_id, state)
                state.closed = True
                committed = await self.backend.close(state.sid)
                yield pb.SessionResponse(closed=pb.Closed(session_id=state.sid, committed_len=committed))
                return
            elif kind == "open":
                raise InvalidRequest("this stream already opened a session; open one session per stream")
            else:
                raise InvalidRequest("empty SessionRequest: set one of open, draft, close")

    def _tenant(self, req, state: "_Stream"):
        """The open request with its cache partition resolved, once the key's limits admit it."""
        try:
            tenancy.check_salt(req.cache_salt)
        except tenancy.SaltError as e:
            raise InvalidRequest(str(e)) from None
        if not self._exempt(state.key):
            try:  # the key's account is its tenant id: a digest, never the key itself
                state.lease = self.quotas.acquire(tenancy.tenant(state.key), len(req.prompt))
            except QuotaExceeded as e:
                raise Exhausted(str(e)) from None
        return replace(req, cache_salt=tenancy.partition(req.cache_salt, state.key), tenant=tenancy.tenant(state.key),
                       teach=self.teach.enabled and self.teach.check(state.key) and not req.withhold_from_teacher)

    async def _verify(self, state: "_Stream", draft: DraftRequest, arrived_ns: int = 0,
                      host: HostSession | None = None) -> pb.SessionResponse:
        """``arrived_ns``: when the draft was read off the stream; its wait for the token the verifier was decoding
        alone counts in the verdict's queue_us, so that the client's round time less queue and verify is the
        link's alone. ``host``: the draft is its host chain (the verdict carries the tokens it took)."""
        self._check_lifetime(state)
        waited_us = (time.perf_counter_ns() - arrived_ns) // 1000 if arrived_ns else 0
        assert state.sid is not None, "a draft before the session's open"
        with tracing.span("tandem.verifier.verify", state.span) as span:
            v: Verdict = await self.backend.verify(state.sid, draft)
            if waited_us:
                v = replace(v, queue_us=v.queue_us + waited_us)
            span.set_attributes({"tandem.draft_seq": v.draft_seq, "tandem.tree_nodes": v.forward_tokens - 1,
                                 "tandem.accepted": len(v.accepted), "tandem.committed_len": v.committed_len,
                                 "tandem.queue_us": v.queue_us, "tandem.verify_us": v.verify_us,
                                 "tandem.rebased": v.rebased, "tandem.stale": v.stale})
        metrics.record_verdict(draft.tree.depth - v.rebased if not v.stale else 0, v.forward_tokens - 1,
                               len(v.accepted), v.committed_len - state.committed, v.queue_us, v.verify_us,
                               self.model_name)
        state.committed, state.finish = v.committed_len, v.finish
        if state.host is not None:
            state.host.follow(draft.tree, v)
        return wire.verdict_to_wire(host.settle(draft.tree, v) if host is not None else v)

    def _check_lifetime(self, state: "_Stream") -> None:
        if state.deadline is not None and time.monotonic() >= state.deadline:
            raise Exhausted(f"session lifetime limit of {self.limits.session_lifetime_s:.0f} s reached "
                            f"(--session-lifetime-s); its cache was freed: open a new session to go on")

    async def _receive(self, inbox: asyncio.Queue, timeout_s: float | None = None,
                       state: "_Stream | None" = None) -> tuple:
        """(the next request, when it was read off the stream in ns), or (None, 0) when the client ended its side."""
        timeout_s = timeout_s or self.idle_timeout_s
        left = None if state is None or state.deadline is None else state.deadline - time.monotonic()
        try:
            item = await asyncio.wait_for(inbox.get(), timeout_s if left is None else max(0.0, min(timeout_s, left)))
        except asyncio.TimeoutError:
            if state is not None:
                self._check_lifetime(state)
            raise _Expired() from None
        return (None, 0) if item is None else item


class _Stream:
    __slots__ = ("sid", "committed", "finish", "closed", "span", "key", "lease", "deadline", "pending", "host")

    def __init__(self):
        self.span: tracing.Span = tracing.NO_SPAN  # the session's span, once the stream starts
        self.key = ""  # the verifier key the stream presented (empty: auth off)
        self.lease: Lease | None = None  # its key's session slot and prefill tokens
        self.deadline: float | None = None  # monotonic time the session's lifetime ends
        self.pending: str | None = None  # the key it counts under as a stream without its Open yet
        self.sid: str | None = None
        self.committed = 0
        self.finish = Finish.NONE
        self.closed = False
        self.host: HostSession | None = None  # its host drafting's view of the committed tokens (a host drafter)


async def _read(request_iterator, inbox: asyncio.Queue) -> None:
    """Requests into the inbox as they arrive; None when the client ends its side."""
    try:
        async for req in request_iterator:
            await inbox.put((req, time.perf_counter_ns()))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the stream broke: let the session loop end
        log.debug("request stream ended: %s", e)
    await inbox.put(None)


def _check_id(given: str, state: _Stream) -> None:
    if given != state.sid:
        raise UnknownSession(f"unknown session {given!r}: this stream's session is {state.sid!r}")
    if state.closed:
        raise UnknownSession(f"session {state.sid!r} is closed; open a new session")


class VerifierServer:
    """The verifier's gRPC server on its own event-loop thread, so callers can stay synchronous."""

    def __init__(self, backend: Backend, address: str, idle_timeout_s: float, keys: ApiKeys, tls: Tls | None,
                 max_message_bytes: int = 4 << 20, max_streams: int = 256, open_timeout_s: float = 10.0,
                 chat_template: str = "", owns_backend: bool = False, limits: StreamLimits = StreamLimits(),
                 exempt: ApiKeys = ApiKeys(), teach: ApiKeys = ApiKeys(), host: HostDrafting | None = None):
        """``owns_backend``: ``stop`` also stops the backend's engine loop (``serve`` made the backend)."""
        self.backend = backend
        self._owns_backend = owns_backend
        self.servicer = VerifierServicer(backend, idle_timeout_s, open_timeout_s, max_streams, chat_template, limits,
                                         exempt, teach, host, keys)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="verifier-grpc", daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self._health = None  # grpc.health.v1's servicer
        try:
            self.port = self._call(self._start(address, keys, tls, max_message_bytes))
        except BaseException:  # nothing listens: end the loop thread it would have served on
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            raise

    def _call(self, coro, timeout: float | None = 60):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self, address, keys, tls, max_message_bytes) -> int:
        # messages are capped (a prompt of a full context is well under it); the cap is checked before parsing.
        # No SO_REUSEPORT (gRPC's default on Linux): a second server on a port in use must fail, not quietly take
        # half of the first one's clients.
        self._server = grpc.aio.server(interceptors=[GrpcAuthInterceptor(keys)] if keys.enabled else None,
                                       options=[("grpc.max_receive_message_length", max_message_bytes),
                                                ("grpc.so_reuseport", 0)])
        pb_grpc.add_VerifierServicer_to_server(self.servicer, self._server)
        self._health = standard_health(self._server)
        try:
            port = (self._server.add_secure_port(address, tls.server_credentials()) if tls
                    else self._server.add_insecure_port(address))
        except RuntimeError:  # grpcio raises where older releases returned 0
            port = 0
        if port == 0:
            raise PortInUse(f"cannot listen on {address} for the verifier (gRPC): the port is in use, or the "
                            f"address is not this machine's")
        await self._server.start()
        if self._health is not None:
            await set_health(self._health, serving=True)
        return port

    def drain(self, timeout_s: float) -> int:
        """Refuse new sessions (Health: draining) and wait up to ``timeout_s`` for open ones to end; returns how
        many are still open."""
        self.servicer.draining = True
        if self._health is not None:
            self._call(set_health(self._health, serving=False))
        deadline = time.monotonic() + timeout_s
        while self.backend.active_sessions() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.backend.active_sessions()

    def stop(self, grace: float | None = None) -> None:
        """Stop serving (active streams get ``grace`` seconds to finish), then end the loop thread."""
        if self._server is not None and self._loop.is_running():
            self._call(self._server.stop(grace), timeout=None)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        # its engine loop thread would otherwise hold the engine (and its memory) forever
        if self._owns_backend and isinstance(self.backend, LocalBackend):  # (serve makes a LocalBackend)
            self.backend.scheduler.stop()


def serve(engine: VerifierEngine | None = None, address: str = "127.0.0.1:50051", max_sessions: int = 8,
          server_max: Limits = Limits(0, 64, 16), scheduler: Scheduler | None = None,
          backend: Backend | None = None, idle_timeout_s: float = 300.0, keys: ApiKeys = ApiKeys(),
          tls: Tls | None = None, max_streams: int = 256, open_timeout_s: float = 10.0,
          chat_template: str = "", limits: StreamLimits = StreamLimits(),
          exempt: ApiKeys = ApiKeys(), teacher: TeacherStore | None = None,
          teach: ApiKeys = ApiKeys(), host: HostDrafting | None = None) -> tuple[VerifierServer, int]:
    """Start the verifier service over ``backend`` (default: a ``LocalBackend`` on ``engine``); returns the
    server and the bound port (``address`` may end in ``:0``). With ``keys``, sessions need
    ``authorization: Bearer <key>`` metadata; with ``tls``, the port speaks TLS. ``chat_template``: the Jinja
    template published to clients instead of the target's own. ``limits``: per key and per stream; ``exempt``:
    keys outside the per-key limits. ``teacher`` with ``teach``: the sessions of those keys keep the target's top-k
    at their committed positions there, per partition (a local engine's backend only). ``host``: the host's
    drafter, for sessions that ask it to draft."""
    if teacher is not None and backend is not None:
        raise ValueError("serve: a teacher store is kept by the local backend serve makes; this backend was given")
    owns = backend is None
    if backend is None:
        if engine is None:
            raise TypeError("serve needs an engine or a backend")
        backend = LocalBackend(engine, server_max, max_sessions, scheduler, teacher=teacher)
    server = VerifierServer(backend, address, idle_timeout_s, keys, tls, max_streams=max_streams,
                            open_timeout_s=open_timeout_s, chat_template=chat_template, owns_backend=owns,
                            limits=limits, exempt=exempt, teach=teach, host=host)
    log.info("verifier %s serving %s on port %d", backend.info.engine, backend.info.model_id, server.port)
    return server, server.port
