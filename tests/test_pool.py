"""Ray-managed verifier pool on the real pair: two local replicas, placement spreads and sticks, and killing a
replica mid-generation loses, duplicates or changes no committed token (the edge re-opens on its history), and
losing every replica is UNAVAILABLE until the replacements the pool starts serve."""
import asyncio
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from tandem.cloud import reference  # noqa: E402
from tandem.cloud.backend import OpenRequest  # noqa: E402
from tandem.cloud.server import serve  # noqa: E402
from tandem.cloud.session import DraftRequest, Limits  # noqa: E402
from tandem.edge.client import EdgeClient  # noqa: E402
from tandem.core.tree import TreeShape  # noqa: E402
from tandem.orchestrator.pool.ray_pool import PoolBackend  # noqa: E402

pytestmark = pytest.mark.models

NEW = 40


@pytest.fixture(scope="module")
def pool(target_path):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    backend = PoolBackend(2, "llama.cpp", dict(model_path=str(target_path), n_ctx=1024, n_threads=1,
                                               max_sessions=3, prefix_cache_tokens=1024), max_sessions_per_replica=3)
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    yield backend, f"127.0.0.1:{port}"
    srv.stop(grace=None)
    backend.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts(engine, humaneval_chats):
    return [engine.model.tokenize(engine.model.chat_prompt(c)) for c in humaneval_chats[:3]]


def test_placement_spreads_and_sticks(pool, prompts):
    backend, _ = pool
    run = asyncio.run
    a = run(backend.open(OpenRequest(tuple(prompts[0]), limits=Limits(8, 4, 4))))
    b = run(backend.open(OpenRequest(tuple(prompts[1]), limits=Limits(8, 4, 4))))
    assert {backend.replica_of(a.session_id), backend.replica_of(b.session_id)} == {"replica-0", "replica-1"}
    where = backend.replica_of(a.session_id)
    v = run(backend.verify(a.session_id, DraftRequest(len(prompts[0]))))
    assert v.committed_len == len(prompts[0]) + 1 and backend.replica_of(a.session_id) == where
    assert backend.load() == {"replica-0": 1, "replica-1": 1}
    run(backend.close(a.session_id))
    run(backend.close(b.session_id))
    assert backend.active_sessions() == 0


def test_the_next_turn_goes_to_the_replica_holding_its_prefix(pool, prompts):
    """Cache-aware routing: a conversation's next turn is placed on the replica whose prefix cache holds the last
    turn, though the other replica is less loaded, and prefills only what is new."""
    backend, _ = pool
    run = asyncio.run
    lim = Limits(8, 4, 4)
    p0 = tuple(prompts[0])
    a = run(backend.open(OpenRequest(p0, limits=lim)))
    warm = backend.replica_of(a.session_id)
    bonus = run(backend.verify(a.session_id, DraftRequest(len(p0)))).bonus
    run(backend.close(a.session_id))  # the replica keeps p0's cells
    x = run(backend.open(OpenRequest(tuple(prompts[2]), limits=lim)))  # a prompt no replica holds
    assert backend.replica_of(x.session_id) == warm, "precondition: x makes the warm replica the busier one"
    routed = backend.placement.prefix_routed
    turn2 = p0 + (bonus,) + tuple(prompts[2][-40:])  # the answer and a new user message appended
    b = run(backend.open(OpenRequest(turn2, limits=lim)))
    assert backend.replica_of(b.session_id) == warm and backend.placement.prefix_routed == routed + 1
    assert b.cached_tokens >= len(p0) - 1  # the last turn's prompt came from the cache, not a prefill
    run(backend.close(b.session_id))
    run(backend.close(x.session_id))


def run_all(address, drafters, prompts, on_progress=None):
    gens = [EdgeClient(d, address, TreeShape(2, 6, 3), backoff_s=0.1).generate(p, max_new_tokens=NEW)
            for d, p in zip(drafters, prompts)]
    errors = []

    def consume(g):
        try:
            for _ in g:
                pass
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(g,)) for g in gens]
    for t in threads:
        t.start()
    if on_progress:
        on_progress(gens)
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    return gens


def test_killing_a_replica_mid_generation_changes_no_token(pool, make_drafter, prompts, engine, noise,
                                                           target_greedy):
    backend, address = pool
    drafters = [make_drafter() for _ in prompts]
    clean = [g.tokens for g in run_all(address, drafters, prompts)]

    killed = {}

    def kill_when_running(gens):
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not all(len(g.tokens) >= 8 for g in gens):
            time.sleep(0.05)
        victim = "replica-0"
        killed["had"] = backend.load().get(victim, 0)
        ray.kill(backend.actors[victim])

    gens = run_all(address, drafters, prompts, on_progress=kill_when_running)
    assert killed["had"] >= 1, "the killed replica held no session: the test proved nothing"
    assert sum(g.stats.resumes for g in gens) >= killed["had"]
    assert "replica-0" not in backend.load()
    for g, ref_tokens, prompt in zip(gens, clean, prompts):
        assert len(g.tokens) == len(ref_tokens)  # nothing lost or duplicated
        if g.tokens != ref_tokens:
            # re-prefill on another replica changes batch shapes: only a measured near-tie may flip a token
            ref = target_greedy(engine, prompt, NEW)
            verdict = reference.classify(g.tokens, ref, noise)
            assert verdict.kind == "near_tie", str(verdict)


def test_losing_every_replica_is_unavailable_until_replacements_serve(pool, make_drafter, prompts, engine, noise,
                                                                      target_greedy):
    """All replicas killed: a session is UNAVAILABLE (not RESOURCE_EXHAUSTED: nothing is busy, nothing is alive),
    Health reports the capacity that is alive, and the pool starts replacements that then serve token-exact."""
    import grpc

    from tandem.edge.client import RemoteError, health
    backend, address = pool
    deadline = time.monotonic() + 300
    while backend.replacing and time.monotonic() < deadline:  # the previous test's replacement, if any
        time.sleep(0.5)
    for name in list(backend.load()):
        ray.kill(backend.actors[name])
    client = EdgeClient(make_drafter(), address, TreeShape(2, 6, 3), max_resumes=0)
    codes, capacity = [], []
    deadline = time.monotonic() + 300
    while True:  # what an application would do: retry with backoff until the pool serves again
        try:
            gen = client.generate(prompts[0], max_new_tokens=NEW).result()
            break
        except RemoteError as e:
            codes.append(e.code)
            capacity.append(health(address).max_sessions)
            assert time.monotonic() < deadline, "no replacement replica served within 300 s"
            time.sleep(1.0)
    client.close()
    assert codes and set(codes) == {grpc.StatusCode.UNAVAILABLE}, codes
    assert min(capacity) == 0  # Health counts the replicas alive, not those the pool started with
    while backend.replacing and time.monotonic() < deadline:  # the second replacement may still be loading
        time.sleep(0.5)
    assert len(backend.load()) == 2 and health(address).max_sessions == 2 * 3
    verdict = reference.classify(gen.tokens, target_greedy(engine, prompts[0], NEW), noise)
    assert verdict.ok, str(verdict)
