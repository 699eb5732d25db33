"""The teacher signal (cloud/learning/teacher.py): the target's top-k at an opted-in tenant's committed positions, kept
per partition, bounded in bytes and age; through the verifier on a tiny stack, only the opted-in key's sessions are
kept, under its own partition, and the answers are the same as without collection."""
import time

import numpy as np
import pytest

from tandem.cloud.learning.teacher import TeacherStore, top_k_logprobs
from tandem.core import tenancy
from tandem.core.auth import ApiKeys


@pytest.mark.parametrize("row, k, ids", [
    ([0.0, 3.0, 1.0, 2.0], 2, [1, 3]),
    ([1.0, 3.0, 3.0, 0.0], 3, [1, 2, 0]),  # a tie: the lower id first
    ([5.0, 1.0], 4, [0, 1]),  # k past the vocabulary: all of it
])
def test_top_k_is_the_likeliest_ids_with_their_log_softmax(row, k, ids):
    got_ids, got_lp = top_k_logprobs(np.array([row], np.float32), k)
    x = np.array(row)
    lse = np.log(np.exp(x).sum())
    assert got_ids[0].tolist() == ids
    np.testing.assert_allclose(got_lp[0], x[ids] - lse, rtol=1e-6)


def rows(tokens, vocab=8):
    """Logits whose argmax is each of ``tokens``."""
    out = np.zeros((len(tokens), vocab), np.float32)
    out[np.arange(len(tokens)), tokens] = 4.0
    return out


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_session_keeps_its_text_and_each_positions_top_k_under_its_partition():
    store = TeacherStore(k=2)
    s = store.session("tenant-a", [1, 2, 3])
    s.record([4, 5], rows([4, 5]))
    s.record([6], rows([6, 0, 0]))  # (a verdict's rows past its committed tokens are not kept)
    store.flush()
    [sample] = store.samples("tenant-a")
    assert (sample.tokens, sample.first) == ([1, 2, 3, 4, 5, 6], 3)
    assert [ids[0] for ids in sample.top_ids] == [4, 5, 6] and len(sample.top_logprobs) == 3
    assert store.samples("tenant-b") == [] and store.nbytes("tenant-b") == 0


def test_the_byte_budget_drops_a_partitions_oldest_sessions_and_never_another_partitions():
    one = TeacherStore(k=4).session("p", [1]), [2, 3, 4, 5]
    one[0].record(one[1], rows(one[1]))
    one[0].store.flush()
    per_session = one[0].store.nbytes("p")
    store = TeacherStore(k=4, max_bytes=2 * per_session)
    other = store.session("q", [1])
    other.record([2, 3, 4, 5], rows([2, 3, 4, 5]))
    for first in (10, 20, 30):
        store.session("p", [first]).record([2, 3, 4, 5], rows([2, 3, 4, 5]))
    store.flush()
    assert [s.tokens[0] for s in store.samples("p")] == [20, 30]  # the oldest went
    assert [s.tokens[0] for s in store.samples("q")] == [1]


def test_samples_older_than_the_age_limit_are_gone_and_a_continuing_session_starts_anew_at_its_text():
    clock = Clock()
    store = TeacherStore(k=2, max_age_s=60, clock=clock)
    s = store.session("p", [1, 2])
    s.record([3], rows([3]))
    store.flush()
    clock.t = 61
    assert store.samples("p") == []
    s.record([4, 5], rows([4, 5]))
    store.flush()
    [sample] = store.samples("p")
    assert (sample.tokens, sample.first, len(sample.top_ids)) == ([1, 2, 3, 4, 5], 3, 2)


def test_a_full_queue_drops_positions_instead_of_waiting():
    store = TeacherStore(k=2, max_pending=1)
    sessions = [store.session("p", [1]) for _ in range(5)]
    with store._lock:  # the worker blocks filing the first verdict it takes; the queue holds one more
        for s in sessions:
            s.record([2], rows([2]))
    store.flush()
    assert store.dropped >= 3 and len(store.samples("p")) == 5 - store.dropped


def one_sample_bytes(k=4):
    store = TeacherStore(k=k)
    store.session("p", [1]).record([2, 3, 4, 5], rows([2, 3, 4, 5]))
    store.flush()
    return store.nbytes("p")


def test_the_sweep_expires_an_idle_partition_that_nothing_touches():
    """Past ``max_age_s`` an idle tenant's samples go by the worker's own sweep: no read, no write, no call on the
    partition (``partitions`` and the byte counts expire nothing themselves)."""
    clock = Clock()
    store = TeacherStore(k=2, max_age_s=60, clock=clock, sweep_s=0.01)
    store.session("idle", [1], tenant="t1").record([2], rows([2]))
    store.flush()
    clock.t = 50
    store.session("busy", [1], tenant="t2").record([2], rows([2]))
    store.flush()
    clock.t = 61  # idle's sample is past the age, busy's is not
    deadline = time.monotonic() + 5
    while "idle" in store.partitions() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.partitions() == ["busy"]
    assert store.tenant_nbytes("t1") == 0 and store.tenant("idle") == "" and store.recorded("idle") == 0
    assert store.total_nbytes() == store.tenant_nbytes("t2") > 0


# (writes: (partition, tenant, first token) in order, one session each; caps in samples; what each partition keeps)
CAPS = [
    pytest.param([("p1", "a", 1), ("p2", "a", 2), ("p3", "a", 3), ("p4", "a", 4), ("q", "b", 5)],
                 dict(tenant=3), {"p2": [2], "p3": [3], "p4": [4], "q": [5]}, id="a tenant over its cap loses its "
                                                                                   "least recently written partition"),
    pytest.param([("p1", "a", 1), ("p1", "a", 2), ("p2", "a", 3), ("p1", "a", 4)],
                 dict(tenant=3), {"p1": [1, 2, 4]}, id="least recently written partition first, not oldest sample"),
    pytest.param([("p1", "a", 1), ("p1", "a", 2), ("p1", "a", 3), ("p1", "a", 4)],
                 dict(tenant=3), {"p1": [2, 3, 4]}, id="one partition: its oldest sample first"),
    pytest.param([("shared", "b", 2), ("shared", "a", 1), ("p2", "a", 3)],
                 dict(tenant=1), {"shared": [2], "p2": [3]}, id="a tenant over its cap never evicts another's"),
    pytest.param([("p1", "a", 1), ("q1", "b", 2), ("r1", "c", 3), ("p2", "a", 4)],
                 dict(total=3), {"q1": [2], "r1": [3], "p2": [4]}, id="the whole store over: least recently written"),
    pytest.param([("p1", "a", 1), ("p1", "a", 2), ("p1", "a", 3)],
                 dict(partition=2), {"p1": [2, 3]}, id="a partition over its cap: its oldest"),
]


@pytest.mark.parametrize("writes, caps, kept", CAPS)
def test_past_a_cap_the_least_recently_written_partitions_oldest_samples_go_within_the_scope_over(writes, caps, kept):
    per = one_sample_bytes()
    store = TeacherStore(k=4, max_bytes=caps.get("partition", 100) * per,
                         max_tenant_bytes=caps.get("tenant", 100) * per, max_total_bytes=caps.get("total", 100) * per)
    for partition, tenant, first in writes:
        store.session(partition, [first], tenant=tenant).record([2, 3, 4, 5], rows([2, 3, 4, 5]))
        store.flush()
    assert {p: [s.tokens[0] for s in store.samples(p)] for p in store.partitions()} == kept
    tenants = {t for _, t, _ in writes}
    assert sum(store.tenant_nbytes(t) for t in tenants) == store.total_nbytes() == per * sum(map(len, kept.values()))


def test_default_caps_are_multiples_of_the_partitions_and_each_must_be_positive():
    store = TeacherStore(max_bytes=1000)
    assert (store.max_tenant_bytes, store.max_total_bytes) == (4000, 16000)
    for bad in (dict(max_tenant_bytes=0), dict(max_total_bytes=0), dict(sweep_s=0)):
        with pytest.raises(ValueError, match="teacher store"):
            TeacherStore(**bad)


# -- through the verifier on a tiny stack ------------------------------------------------------------------------------
torch = pytest.importorskip("torch")

from tandem.cloud.server import serve  # noqa: E402
from tandem.cloud.engines.torch_engine import TorchVerifierEngine  # noqa: E402
from tandem.core.messages import Limits  # noqa: E402
from tandem.core.tree import TreeShape  # noqa: E402
from tandem.edge.client import EdgeClient  # noqa: E402

from tinystack import TinyDrafter, tiny_model  # noqa: E402

PROMPT = [(5 * i) % 11 + 1 for i in range(24)]


def answers(store, keys=("key-a", "key-b"), withhold=False):
    engine = TorchVerifierEngine(model=tiny_model(), n_ctx=128, device="cpu", max_sessions=2)
    srv, port = serve(backend=None, engine=engine, address="127.0.0.1:0", keys=ApiKeys.of(keys),
                      server_max=Limits(0, 8, 4), teacher=store, teach=ApiKeys.of(["key-a"]) if store else ApiKeys())
    out = []
    try:
        for key in keys:
            client = EdgeClient(TinyDrafter(tiny_model()), f"127.0.0.1:{port}", TreeShape(2, 4, 2), api_key=key)
            try:
                out.append(client.generate(PROMPT, max_new_tokens=12, withhold_from_teacher=withhold).result().tokens)
            finally:
                client.close()
    finally:
        srv.stop(grace=None)
    return out


def test_only_the_opted_in_keys_sessions_are_kept_under_its_partition_and_the_answers_do_not_change():
    store = TeacherStore(k=4)
    with_store = answers(store)
    store.flush()
    assert with_store == answers(None)
    [sample] = store.samples(tenancy.partition("", "key-a"))
    assert sample.tokens == PROMPT + with_store[0] and sample.first == len(PROMPT)
    # what it keeps counts against the key's tenant (the backend passes the Open's tenant to the store)
    assert store.tenant(tenancy.partition("", "key-a")) == tenancy.tenant("key-a") != ""
    assert store.tenant_nbytes(tenancy.tenant("key-a")) == store.nbytes(tenancy.partition("", "key-a")) > 0
    assert [int(ids[0]) for ids in sample.top_ids] == with_store[0]  # temperature 0: the target's argmax
    assert all(np.all(np.diff(lp) <= 0) and lp[0] <= 0 for lp in sample.top_logprobs)
    assert store.samples(tenancy.partition("", "key-b")) == [] and store.samples(tenancy.SHARED) == []
    with pytest.raises(ValueError, match="teacher store"):
        serve(backend=object(), teacher=store)


def test_a_session_that_withholds_its_text_keeps_nothing_even_under_an_opted_in_key():
    """``withhold_from_teacher`` (what a gateway sets for tenants that did not opt in) can only take a session out:
    under the opted-in key-a nothing is kept, and the answers are the same."""
    store = TeacherStore(k=4)
    assert answers(store, withhold=True) == answers(None)
    store.flush()
    assert store.samples(tenancy.partition("", "key-a")) == [] and store.partitions() == []
