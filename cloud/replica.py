"""A verifier replica as an async Ray actor: one engine loop (``LocalBackend``) per GPU, or per CPU slice.

The actor's methods are coroutines on its event loop and await the engine loop's futures, so many sessions' drafts
are pending at once and the loop can batch them into one forward.
"""
from __future__ import annotations

import asyncio
import os

import ray

from tandem.core.messages import DraftRequest, Limits, Opened, OpenRequest, Verdict

from .backend import LocalBackend
from .engines import load_engine
from .scheduler import Scheduler


@ray.remote
class VerifierReplica:
    def __init__(self, engine_name: str, engine_kwargs: dict, max_sessions: int, server_max: Limits,
                 scheduler_kwargs: dict | None = None):
        import logging

        from tandem.core import logs
        logs.configure(os.environ.get("TANDEM_LOG"))
        engine = load_engine(engine_name, **engine_kwargs)
        self.backend = LocalBackend(engine, server_max, max_sessions, Scheduler(engine, **(scheduler_kwargs or {})))
        logging.getLogger("tandem.cloud.replica").info("replica up: %s", self.backend.info)

    def info(self):
        return self.backend.info

    async def open(self, req: OpenRequest, timeout_s: float | None = None) -> Opened:
        """``timeout_s``: the caller stops waiting then; an open still running is cancelled, and a prefill that
        finishes anyway frees its session (LocalBackend.open), so no session outlives a caller that gave up."""
        return await asyncio.wait_for(self.backend.open(req), timeout_s)

    async def verify(self, session_id: str, req: DraftRequest) -> Verdict:
        return await self.backend.verify(session_id, req)

    async def close(self, session_id: str) -> int:
        return await self.backend.close(session_id)

    def active_sessions(self) -> int:
        return self.backend.active_sessions()
