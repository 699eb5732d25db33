"""gRPC verifier service: a thin servicer that converts wire <-> domain and calls sessions over one engine.

Sessions are served one forward at a time (one engine lock); batching across sessions is a later step. A bad
request ends only its own stream, with a status code and a message saying what to fix.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent import futures

import grpc

from protos import verifier_pb2 as pb
from protos import verifier_pb2_grpc as pb_grpc

from .acceptance import Sampling
from .engine import VerifierEngine
from .session import (Exhausted, Finish, InvalidRequest, Limits, Refused, StaleDraft, UnknownSession, Verdict,
                      VerifierError, VerifierSession, open_session)
from .tree import DraftTree

log = logging.getLogger("tandem.cloud.server")

STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownSession: grpc.StatusCode.NOT_FOUND,
    StaleDraft: grpc.StatusCode.FAILED_PRECONDITION,
    Refused: grpc.StatusCode.FAILED_PRECONDITION,
    Exhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
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


# -- servicer -----------------------------------------------------------------------------------------------------
class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine, server_max: Limits = Limits(0, 64, 16), max_sessions: int = 8):
        self.engine = engine
        self.server_max = server_max
        self.max_sessions = max_sessions
        self._engine_lock = threading.Lock()
        self._registry_lock = threading.Lock()
        self._sessions: dict[str, VerifierSession] = {}

    def Health(self, request, context):
        with self._registry_lock:
            active = len(self._sessions)
        return pb.HealthResponse(target_model=self.engine.model_id, engine=self.engine.name,
                                 vocab_size=self.engine.vocab_size, vocab_fingerprint=self.engine.vocab_fingerprint,
                                 n_ctx=self.engine.n_ctx, active_sessions=active, max_sessions=self.max_sessions)

    def Session(self, request_iterator, context):
        sid, session = None, None
        try:
            for req in request_iterator:
                kind = req.WhichOneof("kind")
                if kind == "open":
                    if session is not None:
                        raise InvalidRequest("this stream already opened a session; open one session per stream")
                    sid, session, opened = self._open(req.open)
                    yield pb.SessionResponse(opened=opened)
                elif kind == "draft":
                    self._check_id(req.draft.session_id, sid, session)
                    yield pb.SessionResponse(verdict=self._verify(session, req.draft))
                elif kind == "close":
                    self._check_id(req.close.session_id, sid, session)
                    self._forget(sid, session)
                    yield pb.SessionResponse(closed=pb.Closed(session_id=sid, committed_len=session.committed_len))
                else:
                    raise InvalidRequest("empty SessionRequest: set one of open, draft, close")
        except VerifierError as e:
            log.info("session %s: %s: %s", sid, type(e).__name__, e)
            context.abort(STATUS[type(e)], str(e))
        finally:
            if session is not None:
                self._forget(sid, session)

    # -- steps ----------------------------------------------------------------------------------------------------
    def _open(self, msg: pb.Open):
        with self._registry_lock:
            if len(self._sessions) >= self.max_sessions:
                raise Exhausted(f"this replica holds its maximum of {self.max_sessions} sessions; retry later or "
                                f"use another replica")
            sid = uuid.uuid4().hex
            self._sessions[sid] = None  # reserve the slot while prefilling
        try:
            with self._engine_lock:
                session = open_session(self.engine, list(msg.prompt_tokens), sampling_from_wire(msg.sampling),
                                       limits_from_wire(msg.limits), self.server_max, vocab_size=msg.vocab_size,
                                       vocab_fingerprint=msg.vocab_fingerprint, target_model=msg.target_model)
        except BaseException:
            with self._registry_lock:
                self._sessions.pop(sid, None)
            raise
        with self._registry_lock:
            self._sessions[sid] = session
        opened = pb.Opened(session_id=sid, target_model=self.engine.model_id, n_ctx=self.engine.n_ctx,
                           limits=limits_to_wire(session.limits), prefill_us=session.prefill_us)
        if msg.HasField("first_draft"):
            msg.first_draft.session_id = sid
            opened.first_verdict.CopyFrom(self._verify(session, msg.first_draft))
        log.debug("opened %s: prompt %d tokens, limits %s", sid, session.prompt_len, session.limits)
        return sid, session, opened

    def _verify(self, session: VerifierSession, msg: pb.Draft) -> pb.Verdict:
        tree = tree_from_wire(msg.tree)
        session.check_draft(msg.committed_len, tree)  # reject before queueing for the engine
        t0 = time.perf_counter_ns()
        with self._engine_lock:
            queue_us = (time.perf_counter_ns() - t0) // 1000
            verdict = session.verify(msg.committed_len, tree, queue_us)
        return verdict_to_wire(verdict)

    @staticmethod
    def _check_id(given: str, sid: str | None, session: VerifierSession | None) -> None:
        if session is None:
            raise UnknownSession(f"unknown session {given!r}: send Open first on this stream")
        if given != sid:
            raise UnknownSession(f"unknown session {given!r}: this stream's session is {sid!r}")
        if session.closed:
            raise UnknownSession(f"session {sid!r} is closed; open a new session")

    def _forget(self, sid: str, session: VerifierSession) -> None:
        with self._registry_lock:
            self._sessions.pop(sid, None)
        if not session.closed:
            with self._engine_lock:
                session.close()

    @property
    def active_sessions(self) -> int:
        with self._registry_lock:
            return len(self._sessions)


def serve(engine: VerifierEngine, address: str = "127.0.0.1:50051", max_sessions: int = 8,
          server_max: Limits = Limits(0, 64, 16)) -> tuple[grpc.Server, int]:
    """Start the verifier service; returns the server and the bound port (``address`` may end in ``:0``)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_sessions + 4),
                         options=[("grpc.max_receive_message_length", 16 << 20)])
    pb_grpc.add_VerifierServicer_to_server(VerifierServicer(engine, server_max, max_sessions), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind the verifier to {address}")
    server.start()
    log.info("verifier %s serving %s on port %d", engine.name, engine.model_id, port)
    return server, port
