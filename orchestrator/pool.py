"""Ray-managed verifier pool: replicas as actors, placement owned here, lost replicas survived by re-opening.

One ``VerifierReplica`` actor per GPU (``num_gpus=1``), or per CPU slice when the cluster has no GPU. Works with a
local Ray (started here) or an existing cluster (``address``, e.g. ``auto`` after ``ray start --head``, or
``$TANDEM_RAY_ADDRESS``). Sessions are placed least-loaded on open and stay put. When a replica dies, its
sessions fail with ``ReplicaLost`` (gRPC ``UNAVAILABLE``); the edge re-opens with its committed history and the
placement picks a live replica, so no committed token is lost, duplicated or changed.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from cloud.backend import BackendInfo, OpenRequest, Opened, ReplicaLost
from core import lifetime
from cloud.replica import VerifierReplica
from cloud.session import DraftRequest, Exhausted, Limits, UnknownSession, Verdict

from .placement import NoCapacity, Placement

log = logging.getLogger("tandem.orchestrator.pool")

LOST = (RayActorError, ActorDiedError, ActorUnavailableError)


def _init_ray(address: str | None) -> None:
    """Connect to ``address``, or start a local Ray. A local raylet that misses Ray's fixed 30 s start-up window
    (seen once on a loaded 2-core host, with no raylet log at all) gets one more try. A local Ray's processes die
    with this one, even by SIGKILL: the raylet shares our fate, and a reaper catches the agents it starts."""
    if not address:
        lifetime.reap_descendants_on_exit()
    for attempt in (1, 2):
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                     configure_logging=False)
            return
        except Exception as e:
            if address or attempt == 2:
                raise
            log.warning("local Ray did not start (%s); trying once more", e)
            ray.shutdown()


class PoolBackend:
    def __init__(self, replicas: int, engine: str, engine_kwargs: dict, max_sessions_per_replica: int = 8,
                 server_max: Limits = Limits(0, 64, 16), address: str | None = None, cpus_per_replica: float = 1,
                 call_timeout_s: float = 300.0):
        address = address or os.environ.get("TANDEM_RAY_ADDRESS") or None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            _init_ray(address)
        gpus = ray.cluster_resources().get("GPU", 0)
        resources = {"num_gpus": 1, "num_cpus": 1} if gpus >= replicas else {"num_cpus": cpus_per_replica}
        self.timeout_s = call_timeout_s
        self.actors = {f"replica-{i}": VerifierReplica.options(max_restarts=0, max_concurrency=64,
                                                               **resources).remote(
            engine, engine_kwargs, max_sessions_per_replica, server_max) for i in range(replicas)}
        infos = dict(zip(self.actors, ray.get([a.info.remote() for a in self.actors.values()])))
        first = next(iter(infos.values()))
        if any((i.model_id, i.vocab_fingerprint) != (first.model_id, first.vocab_fingerprint) for i in infos.values()):
            raise RuntimeError("verifier replicas serve different models; a pool must serve one target")
        self.info = BackendInfo(f"{first.engine} x{replicas} (ray)", first.model_id, first.vocab_size,
                                first.vocab_fingerprint, first.n_ctx, sum(i.max_sessions for i in infos.values()))
        self.placement = Placement({name: i.max_sessions for name, i in infos.items()})
        self._remote: dict[str, tuple[str, str]] = {}  # pool session id -> (replica, replica's session id)
        self._orphans: set[str] = set()  # sessions whose replica died: answered UNAVAILABLE until re-opened
        self._lock = threading.Lock()
        log.info("verifier pool up: %d replicas (%s each)", replicas, resources)

    async def _get(self, ref):
        """Await a Ray result from this event loop, within the call timeout."""
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s)

    # -- Backend ---------------------------------------------------------------------------------------------------
    async def open(self, req: OpenRequest) -> Opened:
        sid = uuid.uuid4().hex
        while True:
            with self._lock:
                try:
                    name = self.placement.place(sid)
                except NoCapacity as e:
                    raise Exhausted(str(e)) from None
            try:
                opened = await self._get(self.actors[name].open.remote(req))
            except LOST:
                self._lost(name)
                continue  # try the next live replica
            except BaseException:
                with self._lock:
                    self.placement.release(sid)
                raise
            with self._lock:
                self._remote[sid] = (name, opened.session_id)
            return Opened(sid, opened.limits, opened.prefill_us, self.info.model_id, self.info.n_ctx)

    async def verify(self, session_id: str, req: DraftRequest) -> Verdict:
        name, rsid = self._where(session_id)
        try:
            return await self._get(self.actors[name].verify.remote(rsid, req))
        except LOST:
            self._lost(name)
            raise ReplicaLost(f"verifier replica {name} was lost; reopen the session with its committed "
                              f"history") from None

    async def close(self, session_id: str) -> int:
        with self._lock:
            self._orphans.discard(session_id)
        name, rsid = self._where(session_id)
        with self._lock:
            self._remote.pop(session_id, None)
            self.placement.release(session_id)
        try:
            return await self._get(self.actors[name].close.remote(rsid))
        except LOST:
            self._lost(name)
            raise ReplicaLost(f"verifier replica {name} was lost") from None

    def active_sessions(self) -> int:
        with self._lock:
            return len(self._remote)

    # -- pool ------------------------------------------------------------------------------------------------------
    def _where(self, session_id: str) -> tuple[str, str]:
        with self._lock:
            where = self._remote.get(session_id)
            orphan = session_id in self._orphans
        if orphan:
            raise ReplicaLost("the verifier replica of this session was lost; reopen the session with its "
                              "committed history")
        if where is None:
            raise UnknownSession(f"unknown session {session_id!r} (closed, or its replica was lost); open a new "
                                 f"session with the committed history")
        return where

    def _lost(self, name: str) -> None:
        with self._lock:
            if name in self.placement.dead:
                return
            lost = self.placement.mark_dead(name)
            for sid in lost:
                self._remote.pop(sid, None)
                self._orphans.add(sid)
        log.warning("replica %s lost; %d sessions must re-open elsewhere", name, len(lost))

    def replica_of(self, session_id: str) -> str:
        return self._where(session_id)[0]

    def load(self) -> dict[str, int]:
        with self._lock:
            return {name: self.placement.load(name) for name in self.actors if name not in self.placement.dead}

    def shutdown(self) -> None:
        for a in self.actors.values():
            try:
                ray.kill(a)
            except Exception:  # already dead
                pass
        if self._owns_ray:
            ray.shutdown()
