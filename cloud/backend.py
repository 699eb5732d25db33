"""What the gRPC servicer talks to: a verifier backend (domain types only).

``LocalBackend`` is one engine + its scheduler loop in this process; ``orchestrator.pool.PoolBackend`` spreads
sessions over Ray-managed replicas, each of which runs a ``LocalBackend``.
"""
from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Protocol

from .acceptance import Sampling
from .engine import VerifierEngine
from .scheduler import Scheduler
from .session import Exhausted, Limits, UnknownSession, Verdict, VerifierError, VerifierSession, open_session
from .tree import DraftTree


class ReplicaLost(VerifierError):
    """The replica holding the session is gone; reopen with the committed history (no token is lost)."""


@dataclass(frozen=True)
class OpenRequest:
    prompt: tuple[int, ...]
    sampling: Sampling = Sampling()
    limits: Limits = Limits()
    vocab_size: int = 0
    vocab_fingerprint: str = ""
    target_model: str = ""


@dataclass(frozen=True)
class Opened:
    session_id: str
    limits: Limits
    prefill_us: int


@dataclass(frozen=True)
class BackendInfo:
    engine: str
    model_id: str
    vocab_size: int
    vocab_fingerprint: str
    n_ctx: int
    max_sessions: int


class Backend(Protocol):
    info: BackendInfo

    def open(self, req: OpenRequest) -> Opened: ...

    def verify(self, session_id: str, committed_len: int, tree: DraftTree) -> Verdict: ...

    def close(self, session_id: str) -> int:
        """Returns the committed length at close."""

    def active_sessions(self) -> int: ...


class LocalBackend:
    def __init__(self, engine: VerifierEngine, server_max: Limits = Limits(0, 64, 16), max_sessions: int = 8,
                 scheduler: Scheduler | None = None):
        self.engine = engine
        self.server_max = server_max
        self.scheduler = scheduler or Scheduler(engine)
        self.info = BackendInfo(engine.name, engine.model_id, engine.vocab_size, engine.vocab_fingerprint,
                                engine.n_ctx, min(max_sessions, getattr(engine, "max_sessions", max_sessions)))
        self._lock = threading.Lock()
        self._sessions: dict[str, VerifierSession | None] = {}
        self.scheduler.open_sessions = self.active_sessions

    def open(self, req: OpenRequest) -> Opened:
        with self._lock:
            if len(self._sessions) >= self.info.max_sessions:
                raise Exhausted(f"this replica holds its maximum of {self.info.max_sessions} sessions; retry later "
                                f"or use another replica")
            sid = uuid.uuid4().hex
            self._sessions[sid] = None  # reserve the slot while prefilling
        try:
            session = self.scheduler.call(lambda: open_session(
                self.engine, list(req.prompt), req.sampling, req.limits, self.server_max, vocab_size=req.vocab_size,
                vocab_fingerprint=req.vocab_fingerprint, target_model=req.target_model)).result()
        except BaseException:
            with self._lock:
                self._sessions.pop(sid, None)
            raise
        with self._lock:
            self._sessions[sid] = session
        return Opened(sid, session.limits, session.prefill_us)

    def _get(self, session_id: str) -> VerifierSession:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSession(f"unknown session {session_id!r} on this replica (closed, expired or never "
                                 f"opened); open a new session")
        return session

    def verify(self, session_id: str, committed_len: int, tree: DraftTree) -> Verdict:
        return self.scheduler.verify(self._get(session_id), committed_len, tree).result()

    def close(self, session_id: str) -> int:
        session = self._get(session_id)
        with self._lock:
            self._sessions.pop(session_id, None)
        self.scheduler.call(session.close).result()
        return session.committed_len

    def active_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)
