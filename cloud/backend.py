"""What the gRPC servicer talks to: a verifier backend (domain types only, asyncio).

``LocalBackend`` is one engine + its scheduler loop in this process; ``orchestrator.pool.ray_pool.PoolBackend`` spreads
sessions over Ray-managed replicas, each of which runs a ``LocalBackend``. Methods are coroutines so that one event
loop serves every session stream; compute happens on the scheduler's engine thread.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from tandem.core.messages import AdapterInfo, OpenRequest, Opened

from . import metrics
from .engines.engine import VerifierEngine
from .constraint import ConstraintError, GrammarMask
from .scheduler import Scheduler
from .learning.online import AdapterStore
from .learning.teacher import TeacherStore
from .session import (DraftRequest, Exhausted, InvalidRequest, Limits, UnknownSession, Verdict, VerifierError,
                      VerifierSession, check_open, extra_pieces, start_session)

__all__ = ["Backend", "BackendInfo", "LocalBackend", "OpenRequest", "Opened", "ReplicaLost"]


class ReplicaLost(VerifierError):
    """The replica holding the session is gone; reopen with the committed history (no token is lost)."""


@dataclass(frozen=True)
class BackendInfo:
    engine: str
    model_id: str
    vocab_size: int
    vocab_fingerprint: str
    n_ctx: int
    max_sessions: int
    chat_template: str = ""  # the target's (or the server's --chat-template), published in Health
    bos_token: str = ""
    eos_token: str = ""


class Backend(Protocol):
    info: BackendInfo

    async def open(self, req: OpenRequest) -> Opened: ...

    async def verify(self, session_id: str, req: DraftRequest) -> Verdict: ...

    async def close(self, session_id: str) -> int:
        """Returns the committed length at close."""

    def active_sessions(self) -> int: ...

    async def tokenizer(self) -> tuple[str, bytes]:
        """The target's tokenizer as a file an edge loads: (format, contents), ("", b"") when the engine has none
        ("gguf-vocab": a GGUF without weights; "hf-tokenizer-json": a Hugging Face tokenizer.json)."""

    async def adapter(self, partition: str, sha256: str) -> tuple[AdapterInfo, bytes] | None:
        """The drafter adapter ``sha256`` and its file, if it is ``partition``'s current one (cloud.learning.online);
        else None."""


class LocalBackend:
    def __init__(self, engine: VerifierEngine, server_max: Limits = Limits(0, 64, 16), max_sessions: int = 8,
                 scheduler: Scheduler | None = None, teacher: TeacherStore | None = None,
                 adapters: AdapterStore | None = None):
        """``teacher``: where opted-in tenants' sessions keep the target's top-k at their committed positions;
        ``adapters``: the drafter adapters distilled from them, named in each partition's Opened."""
        self.engine = engine
        self.teacher, self.adapters = teacher, adapters
        self.server_max = server_max
        self.scheduler = scheduler or Scheduler(engine)
        self.info = BackendInfo(engine.name, engine.model_id, engine.vocab_size, engine.vocab_fingerprint,
                                engine.n_ctx, min(max_sessions, getattr(engine, "max_sessions", max_sessions)),
                                getattr(engine, "chat_template", ""), getattr(engine, "bos_token", ""),
                                getattr(engine, "eos_token", ""))
        self._lock = threading.Lock()
        self._sessions: dict[str, VerifierSession | None] = {}
        self._used: dict[str, float] = {}  # session id -> monotonic time of its last request (sweep_idle)
        self._busy: dict[str, int] = {}  # session id -> requests in progress
        self.scheduler.open_sessions = self.active_sessions
        metrics.watch_engine(engine)

    async def open(self, req: OpenRequest) -> Opened:
        # identity, size and values first, in the caller's thread: a bad request costs the engine nothing
        sampling = check_open(self.engine, req.prompt, req.sampling, req.vocab_size, req.vocab_fingerprint,
                              req.target_model, req.top_logprobs, req.prior_output)
        with self._lock:
            if len(self._sessions) >= self.info.max_sessions:
                raise Exhausted(f"this replica holds its maximum of {self.info.max_sessions} sessions; retry later "
                                f"or use another replica")
            sid = uuid.uuid4().hex
            self._sessions[sid] = None  # reserve the slot while compiling and prefilling
        try:
            constraint = None
            if req.constraint is not None:  # compiled once the slot is granted (a full replica compiles nothing),
                try:  # off the engine thread and off this loop: it may take a while
                    constraint = await asyncio.to_thread(GrammarMask, self.engine, req.constraint)
                except ConstraintError as e:
                    raise InvalidRequest(f"constraint: {e}") from None
        except BaseException:
            with self._lock:
                self._sessions.pop(sid, None)
            raise
        # the prompt: computed in the scheduler's forwards beside other sessions' drafts (chunked prefill), or
        # whole between them
        opening = self.scheduler.open(lambda: start_session(
            self.engine, list(req.prompt), sampling, req.limits, self.server_max, prior_output=req.prior_output,
            constraint=constraint, partition=req.cache_salt, chunked=self.scheduler.mixed_prefill))
        try:
            session = await asyncio.wrap_future(opening)
        except BaseException:
            with self._lock:
                self._sessions.pop(sid, None)
            # the caller went away (cancelled) while the prefill ran: free the session when it is done
            opening.add_done_callback(self._close_orphan)
            raise
        session.top_logprobs = req.top_logprobs
        if self.teacher is not None and req.teach:
            session.teacher = self.teacher.session(req.cache_salt, req.prompt, tenant=req.tenant)
        with self._lock:
            self._sessions[sid] = session
            self._used[sid] = time.monotonic()
        return Opened(sid, session.limits, session.prefill_us, self.info.model_id, self.info.n_ctx,
                      session.cached_tokens, extra_pieces(self.engine, req.vocab_size),
                      self.adapters.info(req.cache_salt) if self.adapters is not None else None)

    def _close_orphan(self, opening) -> None:
        if not opening.cancelled() and opening.exception() is None:
            self.scheduler.call(opening.result().close)

    def _get(self, session_id: str) -> VerifierSession:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSession(f"unknown session {session_id!r} on this replica (closed, expired or never "
                                 f"opened); open a new session")
        return session

    def session(self, session_id: str) -> VerifierSession:
        """The live session (tests and benches inspect it)."""
        return self._get(session_id)

    async def verify(self, session_id: str, req: DraftRequest) -> Verdict:
        session = self._get(session_id)
        with self._lock:
            self._busy[session_id] = self._busy.get(session_id, 0) + 1
        try:
            return await asyncio.wrap_future(self.scheduler.verify(session, req))
        finally:
            with self._lock:
                self._used[session_id] = time.monotonic()
                self._busy[session_id] -= 1
                if not self._busy[session_id]:
                    del self._busy[session_id]

    async def close(self, session_id: str) -> int:
        session = self._get(session_id)
        with self._lock:
            self._sessions.pop(session_id, None)
            self._used.pop(session_id, None)
        await asyncio.wrap_future(self.scheduler.call(session.close))
        return session.committed_len

    def sweep_idle(self, idle_s: float) -> list[str]:
        """Close the sessions with no request for ``idle_s`` seconds (their caller is gone: a front that died, a
        close that never arrived); returns their ids. A session with a request in progress is never idle."""
        now = time.monotonic()
        with self._lock:
            stale = [sid for sid, t in self._used.items()
                     if now - t > idle_s and not self._busy.get(sid) and self._sessions.get(sid) is not None]
            sessions = [self._sessions.pop(sid) for sid in stale]
            for sid in stale:
                del self._used[sid]
        for session in sessions:
            if session is not None:
                self.scheduler.call(session.close)
        return stale

    def active_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    async def tokenizer(self) -> tuple[str, bytes]:
        def read() -> tuple[str, bytes]:  # written once (seconds), then read
            made = self.engine.tokenizer_file() if hasattr(self.engine, "tokenizer_file") else None
            return (made[0], made[1].read_bytes()) if made else ("", b"")
        return await asyncio.to_thread(read)

    async def adapter(self, partition: str, sha256: str) -> tuple[AdapterInfo, bytes] | None:
        return self.adapters.get(partition, sha256) if self.adapters is not None else None
