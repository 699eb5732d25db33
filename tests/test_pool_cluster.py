"""The verifier pool on a real multi-node Ray cluster (three raylets on this machine, ``ray.cluster_utils``): replicas
on different nodes, a conversation's next turn routed across nodes to the replica holding its prefix, a worker
node's raylet SIGKILLed mid-generation with every session finishing token-exact on the other node, and the lost
replica replaced once a node offering the replica resource joins again."""
import asyncio
import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from tandem.cloud import reference  # noqa: E402
from tandem.cloud.backend import OpenRequest  # noqa: E402
from tandem.cloud.server import serve  # noqa: E402
from tandem.cloud.session import DraftRequest, Limits  # noqa: E402
from tandem.core.tree import TreeShape  # noqa: E402
from tandem.edge.client import EdgeClient  # noqa: E402
from tandem.orchestrator.pool.ray_pool import PoolBackend  # noqa: E402

pytestmark = pytest.mark.models

NEW = 48
RESOURCE = "tandem_verifier"
FAST_FAILURE = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 4}


def worker(cluster):
    return cluster.add_node(num_cpus=1, resources={RESOURCE: 1})


@pytest.fixture(scope="module")
def cluster_pool(target_path):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": FAST_FAILURE})
    nodes = [worker(cluster), worker(cluster)]
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    backend = PoolBackend(2, "llama.cpp", dict(model_path=str(target_path), n_ctx=1024, n_threads=1, max_sessions=3,
                                               prefix_cache_tokens=1024),
                          max_sessions_per_replica=3, replica_resource=RESOURCE, call_timeout_s=60,
                          replace_backoff_s=1.0)
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    yield cluster, nodes, backend, f"127.0.0.1:{port}"
    srv.stop(grace=None)
    backend.shutdown()
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def prompts(engine, humaneval_chats):
    return [engine.model.tokenize(engine.model.chat_prompt(c)) for c in humaneval_chats[:3]]


def test_replicas_run_on_different_nodes_and_a_next_turn_follows_its_prefix(cluster_pool, prompts):
    cluster, nodes, backend, _ = cluster_pool
    where = backend.nodes()
    assert len(set(where.values())) == 2 and set(where.values()) == {n.node_id for n in nodes}
    run, lim = asyncio.run, Limits(8, 4, 4)
    p0 = tuple(prompts[0])
    a = run(backend.open(OpenRequest(p0, limits=lim)))
    warm = backend.replica_of(a.session_id)
    bonus = run(backend.verify(a.session_id, DraftRequest(len(p0)))).bonus
    run(backend.close(a.session_id))
    x = run(backend.open(OpenRequest(tuple(prompts[2]), limits=lim)))  # loads the warm node
    assert backend.replica_of(x.session_id) == warm
    b = run(backend.open(OpenRequest(p0 + (bonus,) + tuple(prompts[2][-40:]), limits=lim)))
    assert backend.replica_of(b.session_id) == warm and b.cached_tokens >= len(p0) - 1
    for s in (b, x):
        run(backend.close(s.session_id))


def test_a_node_killed_mid_generation_changes_no_token_and_its_replica_returns(cluster_pool, make_drafter, prompts,
                                                                                engine, noise, target_greedy):
    cluster, nodes, backend, address = cluster_pool
    gens = [EdgeClient(make_drafter(), address, TreeShape(1, 4, 4), backoff_s=0.1).generate(p, max_new_tokens=NEW)
            for p in prompts[:2]]
    errors = []

    def consume(g):
        try:
            for _ in g:
                pass
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(g,)) for g in gens]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not all(len(g.tokens) >= 8 for g in gens):
        time.sleep(0.05)
    by_node = backend.nodes()
    load = backend.load()
    victim = max(load, key=load.get)  # the replica holding sessions
    assert load[victim] >= 1, "no session on any replica: the test proves nothing"
    node = next(n for n in nodes if n.node_id == by_node[victim])
    os.kill(node.all_processes["raylet"][0].process.pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert sum(g.stats.resumes for g in gens) >= load[victim]
    survivor = next(n for n in by_node if n != victim)
    assert victim not in backend.load() and survivor in backend.load()
    for g, p in zip(gens, prompts):
        verdict = reference.classify(g.tokens, target_greedy(engine, p, NEW), noise)
        assert verdict.ok and len(g.tokens) == NEW, str(verdict)

    # the replacement waits for a node with the replica resource free; one joins, and it serves there
    assert backend.replacing == 1 and len(backend.load()) == 1
    fresh = worker(cluster)
    deadline = time.monotonic() + 300
    while backend.replacing and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(backend.load()) == 2 and fresh.node_id in backend.nodes().values()
    gen = EdgeClient(make_drafter(), address, TreeShape(1, 4, 4)).generate(prompts[2], max_new_tokens=16).result()
    assert len(gen.tokens) == 16
