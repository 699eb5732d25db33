"""The Ray pool's bookkeeping against scripted actors (no Ray cluster): an open that races a replica's death is
placed elsewhere and not left orphaned; a replica that is only unreachable for a moment is not written off; no live
replica is UNAVAILABLE, not RESOURCE_EXHAUSTED; a slow replica is UNAVAILABLE with the placement released; Health
reports the capacity alive now; a lost replica is replaced, and a replacement that fails to start is retried; an open
whose caller went away frees the session the replica opened anyway."""
import asyncio
import threading
from concurrent.futures import Future

import pytest

ray = pytest.importorskip("ray")
from ray.exceptions import ActorDiedError, ActorUnavailableError  # noqa: E402

from tandem.cloud.backend import BackendInfo, ReplicaLost  # noqa: E402
from tandem.cloud.session import Exhausted, Limits  # noqa: E402
from tandem.core.messages import DraftRequest, Opened, OpenRequest, Verdict  # noqa: E402
from tandem.orchestrator.pool import ray_pool as pool_module  # noqa: E402
from tandem.orchestrator.pool.placement import Placement  # noqa: E402
from tandem.orchestrator.pool.ray_pool import PoolBackend  # noqa: E402

INFO = BackendInfo("torch", "m", 10, "fp", 64, 2)


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        f: Future = Future()
        try:
            f.set_result(self.fn(*args))
        except BaseException as e:
            f.set_exception(e)
        return type("Ref", (), {"future": lambda self_: f})()


class Actor:
    """A replica whose behaviour the test sets: "ok", "dead", "unavailable", "slow"."""

    def __init__(self, name):
        self.name, self.mode, self.opened, self.closed = name, "ok", [], []
        self.open = Method(self._open)
        self.verify = Method(self._verify)
        self.close = Method(lambda sid: self.closed.append(sid) or 0)
        self.info = Method(lambda: INFO)

    def _fail(self):
        if self.mode == "dead":
            raise ActorDiedError()
        if self.mode == "unavailable":
            raise ActorUnavailableError("connection lost", None)

    def _open(self, req, timeout_s):
        self._fail()
        if self.mode == "slow":
            raise asyncio.TimeoutError()
        self.opened.append(req)
        return Opened(f"{self.name}-s{len(self.opened)}", Limits(8, 4, 4), 1)

    def _verify(self, sid, req):
        self._fail()
        return Verdict((), 1, req.committed_len + 1)


def pool(n=2, replace=False):
    p = PoolBackend.__new__(PoolBackend)
    p.actors = {f"replica-{i}": Actor(f"replica-{i}") for i in range(n)}
    p.placement = Placement({name: 2 for name in p.actors})
    p._remote, p._orphans, p._lock = {}, set(), threading.Lock()
    p.timeout_s, p._first, p._next, p.replacing, p._owns_ray = 1.0, INFO, n, 0, False
    p.replace_backoff_s, p._closing = 0.01, threading.Event()
    spawned = []
    p._spawn = lambda: spawned.append(Actor(f"new-{len(spawned)}")) or spawned[-1]
    if not replace:
        p._replace = lambda: None
    return p, spawned


def run(coro):
    return asyncio.run(coro)


def test_an_open_racing_a_death_lands_elsewhere_and_is_not_orphaned():
    p, _ = pool()
    p.actors["replica-0"].mode = "dead"
    opened = run(p.open(OpenRequest((1, 2))))
    assert p.replica_of(opened.session_id) == "replica-1"
    assert run(p.verify(opened.session_id, DraftRequest(2))).committed_len == 3  # not answered as an orphan
    assert p.info.max_sessions == 2  # the dead replica's capacity is gone from Health


def test_no_live_replica_is_unavailable_not_full():
    p, _ = pool()
    for a in p.actors.values():
        a.mode = "dead"
    with pytest.raises(ReplicaLost, match="no live verifier replica"):
        run(p.open(OpenRequest((1, 2))))
    p2, _ = pool(1)
    run(p2.open(OpenRequest((1,))))
    run(p2.open(OpenRequest((1,))))
    with pytest.raises(Exhausted):  # alive but full: that one is RESOURCE_EXHAUSTED
        run(p2.open(OpenRequest((1,))))


def test_a_momentarily_unreachable_replica_is_not_written_off():
    p, _ = pool()
    s = run(p.open(OpenRequest((1, 2))))
    where = p.replica_of(s.session_id)
    p.actors[where].mode = "unavailable"
    with pytest.raises(ReplicaLost, match="did not answer"):
        run(p.verify(s.session_id, DraftRequest(2)))
    assert where not in p.placement.dead and p.info.max_sessions == 4
    p.actors[where].mode = "ok"
    again = run(p.open(OpenRequest((1, 2, 3))))  # the edge re-opens; the replica serves again
    assert run(p.verify(again.session_id, DraftRequest(3))).committed_len == 4


def test_a_slow_open_releases_its_placement():
    p, _ = pool(1)
    p.actors["replica-0"].mode = "slow"
    with pytest.raises(ReplicaLost, match="did not answer in time"):
        run(p.open(OpenRequest((1,))))
    assert p.placement.load("replica-0") == 0


def test_a_lost_replica_is_replaced(monkeypatch):
    monkeypatch.setattr(pool_module.ray, "get", lambda ref, timeout=None: ref.future().result())
    p, spawned = pool(2, replace=True)
    s = run(p.open(OpenRequest((1, 2))))
    where = p.replica_of(s.session_id)
    p.actors[where].mode = "dead"
    with pytest.raises(ReplicaLost):
        run(p.verify(s.session_id, DraftRequest(2)))
    deadline = __import__("time").monotonic() + 5
    while p.replacing and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.01)
    assert len(spawned) == 1 and "replica-2" in p.actors and p.info.max_sessions == 4
    with pytest.raises(ReplicaLost, match="reopen"):  # the lost session must be re-opened, once
        run(p.verify(s.session_id, DraftRequest(2)))
    t = run(p.open(OpenRequest((1, 2))))
    assert run(p.verify(t.session_id, DraftRequest(2))).committed_len == 3


def test_a_replacement_that_fails_to_start_is_retried(monkeypatch):
    monkeypatch.setattr(pool_module.ray, "get", lambda ref, timeout=None: ref.future().result())
    killed = []
    monkeypatch.setattr(pool_module.ray, "kill", lambda actor: killed.append(actor))
    p, spawned = pool(2, replace=True)
    starts = iter(["dead", "dead", "ok"])  # the first two replacements die while loading

    def spawn():
        a = Actor(f"new-{len(spawned)}")
        if next(starts) == "dead":
            a.info = Method(lambda: (_ for _ in ()).throw(ActorDiedError()))
        spawned.append(a)
        return a

    p._spawn = spawn
    p._lost("replica-0")
    deadline = __import__("time").monotonic() + 5
    while p.replacing and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.01)
    assert len(spawned) == 3 and killed == spawned[:2]  # the failed ones are killed, not left half-started
    assert p.info.max_sessions == 4 and "replica-4" in p.actors and "replica-2" not in p.actors


def test_an_open_whose_caller_left_frees_the_replica_session(monkeypatch):
    """Cancelling the caller does not stop the actor's open: when it lands, the pool closes it there."""
    monkeypatch.setattr(pool_module.ray, "cancel", lambda ref: None)
    p, _ = pool(1)
    actor = p.actors["replica-0"]
    waiters: list[Future] = []  # as with Ray, every ref.future() is a new future of the same result

    def future():
        waiters.append(Future())
        return waiters[-1]

    actor.open = type("M", (), {"remote": lambda self, *a: type("Ref", (), {"future": lambda s: future()})()})()

    async def caller_leaves():
        task = asyncio.ensure_future(p.open(OpenRequest((1, 2))))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(caller_leaves())
    assert p.placement.load("replica-0") == 0 and actor.closed == []
    for f in waiters:  # the prefill finishes after all
        if not f.cancelled():
            f.set_result(Opened("replica-0-late", Limits(8, 4, 4), 1))
    assert actor.closed == ["replica-0-late"] and p.active_sessions() == 0
