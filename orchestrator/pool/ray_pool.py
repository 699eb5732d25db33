"""Ray-managed verifier pool: replicas as actors, placement owned here, lost replicas survived and replaced.

One ``VerifierReplica`` actor per GPU (``num_gpus=1``), or per CPU slice when the cluster has no GPU, spread over the
cluster's nodes (Ray's ``SPREAD``: a node lost takes as few replicas as it can), and only on nodes that advertise
``replica_resource`` when one is named (``ray start --resources '{"tandem_verifier": 1}'``: one replica per unit). Works
with a local Ray (started here) or an existing cluster (``address``, e.g. ``auto`` after ``ray start --head``, or
``$TANDEM_RAY_ADDRESS``; KubeRay's head service). Sessions are placed on open (on the replica whose prefix cache likely
holds the longest prefix of the prompt, else the least loaded: orchestrator/pool/placement.py) and stay put. When a
replica dies, its sessions fail with ``ReplicaLost`` (gRPC ``UNAVAILABLE``); the edge re-opens with its committed
history and the placement picks a live replica, so no committed token is lost, duplicated or changed; a replacement
replica is started in the background. A replica that is only unreachable for a moment (Ray's ``ActorUnavailableError``)
fails the call in flight the same way but is not written off. Health reports the live capacity.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from tandem.cloud.backend import BackendInfo, OpenRequest, Opened, ReplicaLost
from tandem.core import lifetime
from tandem.cloud.replica import VerifierReplica
from tandem.cloud.session import DraftRequest, Exhausted, Limits, UnknownSession, Verdict

from .placement import NoCapacity, NoReplica, Placement

log = logging.getLogger("tandem.orchestrator.pool")

LOST = (RayActorError, ActorDiedError)  # the actor is gone for good
TRANSIENT = (ActorUnavailableError, GetTimeoutError, asyncio.TimeoutError)  # unreachable or slow, for now


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
                 call_timeout_s: float = 300.0, scheduler_kwargs: dict | None = None, replica_idle_s: float = 900.0,
                 replace_backoff_s: float = 5.0, replica_resource: str = ""):
        """``scheduler_kwargs``: each replica's engine loop (``cloud.scheduler.Scheduler``: max_batch_tokens,
        window_ms, verify_budget_tokens, verify_budget_ms). ``replica_idle_s``: replicas close sessions with no
        request for this long themselves. ``replace_backoff_s``: the first wait before retrying a replacement
        replica that failed to start (doubling, up to a minute). ``replica_resource``: a custom Ray resource each
        replica takes one unit of (a replacement then waits for a node that has one free)."""
        address = address or os.environ.get("TANDEM_RAY_ADDRESS") or None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            _init_ray(address)
        gpus = ray.cluster_resources().get("GPU", 0)
        self._resources: dict = {"num_gpus": 1, "num_cpus": 1} if gpus >= replicas else {"num_cpus": cpus_per_replica}
        if replica_resource:
            self._resources["resources"] = {replica_resource: 1}
        self._spawn_args = (engine, engine_kwargs, max_sessions_per_replica, server_max, scheduler_kwargs or {},
                            replica_idle_s)
        self.replace_backoff_s = replace_backoff_s
        self._closing = threading.Event()
        self.timeout_s = call_timeout_s
        self._next = replicas
        self.actors = {f"replica-{i}": self._spawn() for i in range(replicas)}
        infos = dict(zip(self.actors, ray.get([a.info.remote() for a in self.actors.values()])))
        first = next(iter(infos.values()))
        if any((i.model_id, i.vocab_fingerprint) != (first.model_id, first.vocab_fingerprint) for i in infos.values()):
            raise RuntimeError("verifier replicas serve different models; a pool must serve one target")
        self._first = first
        self.placement = Placement({name: i.max_sessions for name, i in infos.items()})
        self._remote: dict[str, tuple[str, str]] = {}  # pool session id -> (replica, replica's session id)
        self._orphans: set[str] = set()  # sessions whose replica died: answered UNAVAILABLE until re-opened
        self._lock = threading.Lock()
        self.replacing = 0  # replacements being started
        log.info("verifier pool up: %d replicas (%s each)", replicas, self._resources)

    def _spawn(self):
        # (ray.remote makes it an actor class, whose .options its stubs do not know)
        actor = VerifierReplica.options(  # type: ignore[attr-defined]
            max_restarts=0, max_concurrency=64, scheduling_strategy="SPREAD", **self._resources)
        return actor.remote(*self._spawn_args)

    @property
    def info(self) -> BackendInfo:
        """Identity, and the capacity of the replicas alive now (not of those the pool started with)."""
        f = self._first
        with self._lock:
            live = len([n for n in self.actors if n not in self.placement.dead])
            capacity = self.placement.live_capacity()
        return BackendInfo(f"{f.engine} x{live} (ray)", f.model_id, f.vocab_size, f.vocab_fingerprint, f.n_ctx,
                           capacity, f.chat_template, f.bos_token, f.eos_token)

    async def _get(self, ref, timeout_s: float | None = None):
        """Await a Ray result from this event loop, within the call timeout."""
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s or self.timeout_s)

    # -- Backend ---------------------------------------------------------------------------------------------------
    async def open(self, req: OpenRequest) -> Opened:
        sid = uuid.uuid4().hex
        while True:
            with self._lock:
                try:
                    name = self.placement.place(sid, req.prompt, req.cache_salt)
                except NoReplica as e:
                    raise ReplicaLost(str(e)) from None
                except NoCapacity as e:
                    raise Exhausted(str(e)) from None
            ref = self.actors[name].open.remote(req, self.timeout_s)
            try:
                # the replica gives up (and frees what it allocated) when its open outlasts our wait
                opened = await self._get(ref, self.timeout_s + 5)
            except asyncio.CancelledError:  # our caller went away; the actor's task goes on regardless
                self._abandon(sid, name, ref)
                raise
            except TRANSIENT as e:  # first: ActorUnavailableError is a RayActorError too
                with self._lock:
                    self.placement.release(sid)
                raise ReplicaLost(f"verifier replica {name} did not answer in time ({type(e).__name__}); retry"
                                  ) from None
            except LOST:
                self._lost(name)
                with self._lock:
                    self._orphans.discard(sid)  # it never opened: nothing to resume
                continue  # try the next live replica
            except BaseException:
                with self._lock:
                    self.placement.release(sid)
                raise
            with self._lock:
                self._remote[sid] = (name, opened.session_id)
                self.placement.opened(name, req.prompt, req.cache_salt)
            return Opened(sid, opened.limits, opened.prefill_us, self.info.model_id, self.info.n_ctx,
                          opened.cached_tokens, opened.extra_pieces)

    async def verify(self, session_id: str, req: DraftRequest) -> Verdict:
        name, rsid = self._where(session_id)
        try:
            return await self._get(self.actors[name].verify.remote(rsid, req))
        except TRANSIENT as e:  # the session's state there is unknown now: the edge re-opens, elsewhere or not
            self._drop(session_id, name, rsid)
            raise ReplicaLost(f"verifier replica {name} did not answer in time ({type(e).__name__}); reopen the "
                              f"session with its committed history") from None
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
        except TRANSIENT as e:  # already forgotten here; the replica frees it when it hears, or with its process
            raise ReplicaLost(f"verifier replica {name} did not answer the close ({type(e).__name__})") from None
        except LOST:
            self._lost(name)
            raise ReplicaLost(f"verifier replica {name} was lost") from None

    def active_sessions(self) -> int:
        with self._lock:
            return len(self._remote)

    async def tokenizer(self) -> tuple[str, bytes]:
        """From any live replica: every replica serves the same target (checked at start)."""
        with self._lock:
            live = [n for n in self.actors if n not in self.placement.dead]
        if not live:
            raise ReplicaLost("no live replica to read the target's tokenizer from")
        return await self._get(self.actors[live[0]].tokenizer.remote())

    async def adapter(self, partition: str, sha256: str):
        """None: replicas keep no teacher signal, so the pool distils no adapter."""
        return None

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

    def _abandon(self, session_id: str, name: str, ref) -> None:
        """An open whose caller stopped waiting: free the placement now, and the replica's session once the open
        lands there (cancelling the ObjectRef asks the actor to stop, but an open that already finished, or finishes
        first, holds a KV block until someone closes it)."""
        with self._lock:
            self.placement.release(session_id)
        actor = self.actors[name]

        def close_when_opened(future) -> None:
            try:
                opened = future.result()
            except BaseException:  # cancelled or failed there: nothing was kept
                return
            try:
                actor.close.remote(opened.session_id)
            except Exception:  # the replica is gone, and the session with it
                pass

        ref.future().add_done_callback(close_when_opened)
        try:
            ray.cancel(ref)
        except Exception:
            pass

    def _drop(self, session_id: str, name: str, rsid: str) -> None:
        """Forget one session whose replica did not answer; ask the replica to free it if it still can."""
        with self._lock:
            self._remote.pop(session_id, None)
            self.placement.release(session_id)
        try:
            self.actors[name].close.remote(rsid)  # fire and forget
        except Exception:
            pass

    def _lost(self, name: str) -> None:
        with self._lock:
            if name in self.placement.dead:
                return
            lost = self.placement.mark_dead(name)
            for sid in lost:
                self._remote.pop(sid, None)
                self._orphans.add(sid)
            self.replacing += 1
        log.warning("replica %s lost; %d sessions must re-open elsewhere; starting a replacement", name, len(lost))
        threading.Thread(target=self._replace, name="replace-replica", daemon=True).start()

    def _replace(self) -> None:
        """Start a new replica in place of a lost one (minutes on a GPU: the model loads), retrying with a doubling
        wait until one comes up or the pool shuts down: a pool never stays smaller for one failed start."""
        wait = self.replace_backoff_s
        try:
            while not self._closing.is_set():
                with self._lock:
                    name, self._next = f"replica-{self._next}", self._next + 1
                actor = None
                try:
                    actor = self._spawn()
                    info = ray.get(actor.info.remote(), timeout=self.timeout_s * 4)
                except Exception as e:
                    log.error("replacement replica %s did not start (%s); retrying in %.0f s", name, e, wait)
                    if actor is not None:
                        try:
                            ray.kill(actor)
                        except Exception:
                            pass
                    self._closing.wait(wait)
                    wait = min(60.0, 2 * wait)
                    continue
                with self._lock:
                    self.actors[name] = actor
                    self.placement.add(name, info.max_sessions)
                log.warning("replacement replica %s up", name)
                return
        finally:
            with self._lock:
                self.replacing -= 1

    def replica_of(self, session_id: str) -> str:
        return self._where(session_id)[0]

    def nodes(self) -> dict[str, str]:
        """Live replica -> the Ray node it runs on."""
        with self._lock:
            live = {n: a for n, a in self.actors.items() if n not in self.placement.dead}
        return dict(zip(live, ray.get([a.node_id.remote() for a in live.values()], timeout=self.timeout_s)))

    def load(self) -> dict[str, int]:
        with self._lock:
            return {name: self.placement.load(name) for name in self.actors if name not in self.placement.dead}

    def shutdown(self) -> None:
        self._closing.set()
        for a in self.actors.values():
            try:
                ray.kill(a)
            except Exception:  # already dead
                pass
        if self._owns_ray:
            ray.shutdown()
