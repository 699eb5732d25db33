"""A verifier replica as an async Ray actor: one engine loop (``LocalBackend``) per GPU, or per CPU slice.

Calls block on the engine loop's futures in a thread pool sized for the replica's sessions, so many sessions'
drafts are pending at once and the loop can batch them into one forward.
"""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import ray

from .backend import LocalBackend, OpenRequest, Opened
from .engine import load_engine
from .session import Limits, Verdict
from .tree import DraftTree


@ray.remote
class VerifierReplica:
    def __init__(self, engine_name: str, engine_kwargs: dict, max_sessions: int, server_max: Limits):
        import logging

        from orchestrator import logs
        logs.configure(os.environ.get("TANDEM_LOG"))
        engine = load_engine(engine_name, **engine_kwargs)
        self.backend = LocalBackend(engine, server_max, max_sessions)
        self._pool = ThreadPoolExecutor(max_workers=self.backend.info.max_sessions + 2)
        logging.getLogger("tandem.cloud.replica").info("replica up: %s", self.backend.info)

    def info(self):
        return self.backend.info

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def open(self, req: OpenRequest) -> Opened:
        return await self._run(self.backend.open, req)

    async def verify(self, session_id: str, committed_len: int, tree: DraftTree) -> Verdict:
        return await self._run(self.backend.verify, session_id, committed_len, tree)

    async def close(self, session_id: str) -> int:
        return await self._run(self.backend.close, session_id)

    def active_sessions(self) -> int:
        return self.backend.active_sessions()

    def batch_stats(self):
        return self.backend.scheduler.stats
