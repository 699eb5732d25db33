"""A verifier replica as an async Ray actor: one engine loop (``LocalBackend``) per GPU, or per CPU slice.

The actor's methods are coroutines on its event loop and await the engine loop's futures, so many sessions' drafts
are pending at once and the loop can batch them into one forward.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import ray

from tandem.core.messages import DraftRequest, Limits, Opened, OpenRequest, Verdict

from .backend import LocalBackend
from .engines import load_engine
from .scheduler import Scheduler


log = logging.getLogger("tandem.cloud.replica")


@ray.remote
class VerifierReplica:
    def __init__(self, engine_name: str, engine_kwargs: dict, max_sessions: int, server_max: Limits,
                 scheduler_kwargs: dict | None = None, idle_s: float = 900.0):
        """``idle_s``: a session with no request for this long is closed here, whatever the front thinks (a front
        that died, or a close lost on the way, must not hold a KV block forever)."""
        from tandem.core import logs
        logs.configure(os.environ.get("TANDEM_LOG"))
        engine = load_engine(engine_name, **engine_kwargs)
        self.backend = LocalBackend(engine, server_max, max_sessions, Scheduler(engine, **(scheduler_kwargs or {})))
        self.idle_s = idle_s
        threading.Thread(target=self._sweep, name="sweep-idle", daemon=True).start()
        log.info("replica up: %s", self.backend.info)

    def _sweep(self) -> None:
        period = max(1.0, min(60.0, self.idle_s / 4))
        while True:
            time.sleep(period)
            try:
                swept = self.backend.sweep_idle(self.idle_s)
            except Exception:  # never let the sweeper die
                log.exception("idle sweep failed")
                continue
            if swept:
                log.warning("closed %d sessions idle for over %.0f s", len(swept), self.idle_s)

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

    async def tokenizer(self) -> tuple[str, bytes]:
        return await self.backend.tokenizer()

    def node_id(self) -> str:
        """The Ray node this replica runs on."""
        return ray.get_runtime_context().get_node_id()
