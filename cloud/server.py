"""gRPC verifier service: a thin servicer that converts wire <-> domain and calls sessions over one engine.

Every engine call goes through one ``Scheduler`` (cloud/scheduler.py), which verifies the pending drafts of many
sessions in one forward. A bad request ends only its own stream, with a status code and a message saying what to
fix.
"""
from __future__ import annotations

import logging
import threading
from concurrent import futures
from typing import Iterator

import grpc

from protos import verifier_pb2 as pb
from protos import verifier_pb2_grpc as pb_grpc

from orchestrator.auth import ApiKeys, GrpcAuthInterceptor, Tls

from . import metrics
from .acceptance import Sampling
from .backend import Backend, LocalBackend, OpenRequest, ReplicaLost
from .engine import VerifierEngine
from .scheduler import Scheduler
from .session import (Exhausted, Finish, InvalidRequest, Limits, Refused, StaleDraft, UnknownSession, Verdict,
                      VerifierError)
from .tree import DraftTree

log = logging.getLogger("tandem.cloud.server")

STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownSession: grpc.StatusCode.NOT_FOUND,
    StaleDraft: grpc.StatusCode.FAILED_PRECONDITION,
    Refused: grpc.StatusCode.FAILED_PRECONDITION,
    Exhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ReplicaLost: grpc.StatusCode.UNAVAILABLE,
}
FINISH = {Finish.NONE: pb.FINISH_REASON_UNSPECIFIED, Finish.STOP: pb.FINISH_REASON_STOP,
          Finish.LENGTH: pb.FINISH_REASON_LENGTH}


# -- wire <-> domain ----------------------------------------------------------------------------------------------
def tree_from_wire(msg: pb.DraftTree) -> DraftTree:
    return DraftTree(tuple(msg.tokens), tuple(msg.parents))


def limits_from_wire(msg: pb.Limits) -> Limits:
    return Limits(msg.max_new_tokens, msg.max_tree_nodes, msg.max_tree_depth)


def limits_to_wire(limits: Limits) -> pb.Limits:
    return pb.Limits(max_new_tokens=limits.max_new_tokens, max_tree_nodes=limits.max_tree_nodes,
                     max_tree_depth=limits.max_tree_depth)


def sampling_from_wire(msg: pb.SamplingParams) -> Sampling:
    return Sampling(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p, seed=msg.seed)


def verdict_to_wire(v: Verdict) -> pb.Verdict:
    return pb.Verdict(accepted=v.accepted, bonus_token=v.bonus, committed_len=v.committed_len,
                      finish_reason=FINISH[v.finish], queue_us=v.queue_us, verify_us=v.verify_us)


class _IdleTimer:
    """Cancels a session stream whose client went silent: sessions expire instead of holding a cache forever."""

    def __init__(self, timeout_s: float, context):
        self._timeout_s, self._context, self._timer = timeout_s, context, None
        self.reset()

    def _expire(self):
        log.info("session stream idle for %.0f s: cancelled", self._timeout_s)
        self._context.cancel()

    def reset(self):
        self.stop()
        self._timer = threading.Timer(self._timeout_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def stop(self):
        if self._timer is not None:
            self._timer.cancel()


# -- servicer -----------------------------------------------------------------------------------------------------
class VerifierServicer(pb_grpc.VerifierServicer):
    """Wire <-> domain around a ``Backend`` (one local engine, or a Ray pool of replicas)."""

    def __init__(self, backend: Backend, idle_timeout_s: float = 300.0):
        self.backend = backend
        self.idle_timeout_s = idle_timeout_s  # a session stream silent this long is cancelled and its cache freed

    def Health(self, request, context):
        i = self.backend.info
        return pb.HealthResponse(target_model=i.model_id, engine=i.engine, vocab_size=i.vocab_size,
                                 vocab_fingerprint=i.vocab_fingerprint, n_ctx=i.n_ctx,
                                 active_sessions=self.backend.active_sessions(), max_sessions=i.max_sessions)

    def Session(self, request_iterator, context):
        sid, closed = None, False
        idle = _IdleTimer(self.idle_timeout_s, context)
        try:
            for req in request_iterator:
                idle.reset()
                kind = req.WhichOneof("kind")
                if kind == "open":
                    if sid is not None:
                        raise InvalidRequest("this stream already opened a session; open one session per stream")
                    sid, opened, run = self._open(req.open)
                    metrics.SESSIONS.inc()
                    yield pb.SessionResponse(opened=opened)
                    for verdict in run:  # the rest of a decode run started by the first draft
                        idle.reset()
                        yield pb.SessionResponse(verdict=verdict)
                elif kind == "draft":
                    self._check_id(req.draft.session_id, sid, closed)
                    for verdict in self._verdicts(sid, req.draft):
                        idle.reset()
                        yield pb.SessionResponse(verdict=verdict)
                elif kind == "close":
                    self._check_id(req.close.session_id, sid, closed)
                    closed = True
                    committed = self.backend.close(sid)
                    yield pb.SessionResponse(closed=pb.Closed(session_id=sid, committed_len=committed))
                else:
                    raise InvalidRequest("empty SessionRequest: set one of open, draft, close")
        except VerifierError as e:
            code = next((c for cls, c in STATUS.items() if isinstance(e, cls)), grpc.StatusCode.INTERNAL)
            message = e.args[0] if e.args else str(e)
            log.info("session %s: %s: %s", sid, code.name, message)
            metrics.ERRORS.labels(code.name).inc()
            context.abort(code, message)
        finally:
            idle.stop()
            if sid is not None:
                metrics.SESSIONS.dec()
            if sid is not None and not closed:
                try:
                    self.backend.close(sid)
                except VerifierError:
                    pass  # already gone (replica lost, or closed by the backend)

    def _open(self, msg: pb.Open) -> tuple[str, pb.Opened, Iterator[pb.Verdict]]:
        req = OpenRequest(tuple(msg.prompt_tokens), sampling_from_wire(msg.sampling), limits_from_wire(msg.limits),
                          msg.vocab_size, msg.vocab_fingerprint, msg.target_model)
        opened = self.backend.open(req)
        out = pb.Opened(session_id=opened.session_id, target_model=self.backend.info.model_id,
                        n_ctx=self.backend.info.n_ctx, limits=limits_to_wire(opened.limits),
                        prefill_us=opened.prefill_us)
        run: Iterator[pb.Verdict] = iter(())
        if msg.HasField("first_draft"):
            run = self._verdicts(opened.session_id, msg.first_draft)
            out.first_verdict.CopyFrom(next(run))
        log.debug("opened %s: prompt %d tokens, limits %s", opened.session_id, len(req.prompt), opened.limits)
        return opened.session_id, out, run

    def _verdicts(self, sid: str, msg: pb.Draft) -> Iterator[pb.Verdict]:
        """One verdict for a tree; for an empty tree with ``decode_steps`` > 1, one verdict per decoded token, each
        sent as soon as it is known, until the run or the session ends. Every step goes through the scheduler, so
        a decode run batches with other sessions' drafts like any one-token draft."""
        tree = tree_from_wire(msg.tree)
        if msg.decode_steps > 1 and len(tree):
            raise InvalidRequest(f"decode_steps={msg.decode_steps} needs an empty tree (server-side decoding); "
                                 f"this draft has {len(tree)} nodes")
        committed_len = msg.committed_len
        for _ in range(max(1, msg.decode_steps)):
            verdict = self.backend.verify(sid, committed_len, tree)
            metrics.record_verdict(tree.depth, len(tree), len(verdict.accepted),
                                   verdict.committed_len - committed_len, verdict.queue_us, verdict.verify_us)
            yield verdict_to_wire(verdict)
            if verdict.finish is not Finish.NONE:
                return
            committed_len = verdict.committed_len

    @staticmethod
    def _check_id(given: str, sid: str | None, closed: bool) -> None:
        if sid is None:
            raise UnknownSession(f"unknown session {given!r}: send Open first on this stream")
        if given != sid:
            raise UnknownSession(f"unknown session {given!r}: this stream's session is {sid!r}")
        if closed:
            raise UnknownSession(f"session {sid!r} is closed; open a new session")


def serve(engine: VerifierEngine | None = None, address: str = "127.0.0.1:50051", max_sessions: int = 8,
          server_max: Limits = Limits(0, 64, 16), scheduler: Scheduler | None = None,
          backend: Backend | None = None, idle_timeout_s: float = 300.0, keys: ApiKeys = ApiKeys(),
          tls: Tls | None = None) -> tuple[grpc.Server, int]:
    """Start the verifier service over ``backend`` (default: a ``LocalBackend`` on ``engine``); returns the
    server and the bound port (``address`` may end in ``:0``). With ``keys``, sessions need
    ``authorization: Bearer <key>`` metadata; with ``tls``, the port speaks TLS."""
    backend = backend or LocalBackend(engine, server_max, max_sessions, scheduler)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=backend.info.max_sessions + 8),
                         interceptors=[GrpcAuthInterceptor(keys)] if keys.enabled else None,
                         options=[("grpc.max_receive_message_length", 16 << 20)])
    pb_grpc.add_VerifierServicer_to_server(VerifierServicer(backend, idle_timeout_s), server)
    port = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind the verifier to {address}")
    server.start()
    log.info("verifier %s serving %s on port %d", backend.info.engine, backend.info.model_id, port)
    return server, port
