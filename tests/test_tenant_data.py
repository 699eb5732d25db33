"""Tenant data bounded in time and size, without models: training time shared round-robin across partitions
(``cloud.learning.online.next_round``), adapters and training state capped per tenant and in all, least recently used
first (``over_caps``, ``OnlineDistillation.sweep``), swept past their lifetime with no traffic and nothing due; and the
edge's adapter cache: a name from the verifier checked before it names a file, a cached file hashed again before
use, stale copies pruned (``edge.adapters``), and a vocabulary fingerprint checked before it names a file."""
import hashlib
import os
from types import SimpleNamespace

import grpc
import pytest

from tandem.cloud.learning.adapter_dir import partition_dir
from tandem.cloud.learning.online import (AdapterStore, OnlineConfig, OnlineDistillation, _Partition, next_round,
                                          over_caps)
from tandem.cloud.learning.teacher import TeacherStore
from tandem.core.messages import AdapterInfo


def part_id(name: str) -> str:
    """A partition id (a digest) named for the reader."""
    return hashlib.sha256(name.encode()).hexdigest()


# -- training time: round-robin ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("due, interrupted, started, want", [
    (["a", "b"], set(), {}, "a"),  # none trained yet: in due's order
    (["a", "b"], set(), {"a": 5}, "b"),  # a had a round: b's turn
    (["a", "b", "c"], set(), {"a": 7, "b": 3, "c": 9}, "b"),  # the least recently started
    (["a", "b"], {"b"}, {"a": 1, "b": 9}, "b"),  # an interrupted round goes on, however recent
    (["hog", "quiet"], set(), {"hog": 4, "quiet": 2}, "quiet"),  # traffic keeps hog due; quiet still has its turn
    ([], set(), {"a": 1}, None),
])
def test_the_next_round_is_an_interrupted_one_else_the_least_recently_started(due, interrupted, started, want):
    assert next_round(due, interrupted, started) == want


# -- training's caps: least recently used first -----------------------------------------------------------------------
@pytest.mark.parametrize("held, per_tenant, total, evicted", [
    ([("a1", "A", 1), ("a2", "A", 2)], 2, 10, []),
    ([("a1", "A", 3), ("a2", "A", 1), ("a3", "A", 2), ("b1", "B", 0)], 2, 10, ["a2"]),  # A's least recently used
    ([("a1", "A", 5), ("b1", "B", 1), ("c1", "C", 3)], 4, 2, ["b1"]),  # all over: whoever's least recent
    ([("a1", "A", 1), ("a2", "A", 2), ("a3", "A", 3), ("b1", "B", 4)], 1, 2, ["a1", "a2"]),  # tenant, then total
    ([("a1", "A", 9), ("a2", "A", 8), ("b1", "B", 1), ("b2", "B", 2)], 1, 1, ["b1", "a2", "b2"]),
])
def test_past_a_cap_the_least_recently_used_partitions_training_goes(held, per_tenant, total, evicted):
    assert over_caps(held, per_tenant, total) == evicted


def online(tmp_path, clock, teacher=None, **caps):
    adapters = AdapterStore(tmp_path, max_age_s=100, clock=clock)
    return OnlineDistillation(teacher or TeacherStore(k=2), adapters, drafter_source="tiny", idle=lambda: True,
                              config=OnlineConfig(**caps))


def test_past_the_caps_adapters_and_training_state_go_least_recently_used_first_from_memory_and_disk(tmp_path):
    now = [0.0]
    o = online(tmp_path, lambda: now[0], max_tenant_adapters=2, max_adapters=3)
    a1, a2, a3, b1, c1 = (part_id(n) for n in ("a1", "a2", "a3", "b1", "c1"))
    for p, tenant in ((a1, "A"), (a2, "A"), (b1, "B")):
        o.adapters.publish(p, b"GGUF " + p.encode(), "base", 1, tenant=tenant)
        (partition_dir(tmp_path, p) / "state.pt").write_bytes(b"its training state")
    o.adapters.info(a1)  # a1 named in an Opened: used after a2
    o._parts[a3] = _Partition(state={"lora": {}}, tenant="A", used=o.adapters.stamp())  # a round's state, no adapter
    o.sweep()
    assert set(o.adapters.held()) == {a1, b1} and not partition_dir(tmp_path, a2).exists()  # A: a2 least recent
    assert o._parts[a3].state is not None
    o.adapters.publish(c1, b"GGUF c1", "base", 1, tenant="C")  # four held, three allowed: b1 is least recent
    o.sweep()
    assert set(o.adapters.held()) == {a1, c1} and o._parts[a3].state is not None
    assert not partition_dir(tmp_path, b1).exists() and partition_dir(tmp_path, a1).is_dir()


def test_a_sweep_runs_every_tick_with_no_traffic_and_nothing_due(tmp_path):
    """An adapter past its lifetime goes, from memory and disk with its training state, on the next tick even when
    no Opened asks for it and no partition is due; so does an interrupted round holding text the teacher store
    has expired, and the bookkeeping of partitions that hold nothing."""
    now, text_now = [0.0], [0.0]
    teacher = TeacherStore(k=2, max_age_s=50, clock=lambda: text_now[0])
    o = online(tmp_path, lambda: now[0], teacher)
    a, b, c = part_id("a"), part_id("b"), part_id("c")
    o.adapters.publish(a, b"GGUF a", "base", 1, tenant="A")
    (partition_dir(tmp_path, a) / "state.pt").write_bytes(b"its training state")
    o._parts[a] = _Partition(lineage_s=0.0, state={"lora": {}}, rounds=1)
    o._parts[b] = _Partition(round=object(), text_s=10.0, state={"lora": {}})  # a round holding text from t=10
    o._parts[c] = _Partition(trained_at=600)  # trained once; its text and adapter long gone
    now[0], text_now[0] = 99.0, 59.0
    assert o.tick() is None and a in o.adapters.held() and o._parts[b].round is not None
    now[0], text_now[0] = 100.0, 60.0
    assert o.due() == [b]  # (b's round; nothing else)
    o.idle = lambda: False  # busy: no round runs, the sweep still does
    assert o.tick() is None
    assert o.adapters.held() == {} and not partition_dir(tmp_path, a).exists()
    assert o._parts[b].round is None and o._parts[b].state is not None  # (what it trained stays)
    assert a not in o._parts and c not in o._parts  # (holding nothing, with no text in the store: forgotten)


def test_a_partition_whose_text_all_went_and_came_back_is_due_on_its_new_positions(tmp_path):
    """The teacher store forgets a partition that holds nothing, its filed count with it: the count starts again
    from 0, and the positions filed since are what makes it due."""
    import numpy as np
    store = TeacherStore(k=2)
    o = online(tmp_path, lambda: 0.0, store, min_positions=10)
    p = part_id("p")
    o._parts[p] = _Partition(trained_at=600)  # (its last round began at 600 positions, before its text went)
    store.session(p, [1], tenant="A").record(list(range(12)), np.zeros((12, 16), np.float32))
    store.flush()
    assert store.recorded(p) == 12 and o.due() == [p]


def test_a_restart_keeps_the_tenant_an_adapter_counts_against(tmp_path):
    p = part_id("p")
    AdapterStore(tmp_path).publish(p, b"GGUF p", "base", 2, tenant="A")
    assert AdapterStore(tmp_path).held()[p][0] == "A"


# -- the edge's adapter cache -----------------------------------------------------------------------------------------
class Drafter:
    base_sha256 = "b" * 64

    def __init__(self):
        self.loaded = []

    def set_adapter(self, path):
        self.loaded.append(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    return tmp_path


def info_of(data: bytes) -> AdapterInfo:
    return AdapterInfo(hashlib.sha256(data).hexdigest(), 1, Drafter.base_sha256, len(data))


BAD_NAMES = ["../../etc/passwd", "A" * 64, "0" * 63, "0" * 65, "0" * 63 + "g", "", "0" * 64 + "/", "0" * 64 + "\n"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_an_adapter_name_that_is_not_a_sha256_never_names_a_file_nor_is_fetched(cache, name):
    from tandem.edge.adapters import DrafterAdapters, adapter_path
    with pytest.raises(ValueError, match="not an adapter sha256"):
        adapter_path(name)
    fetched = []
    adapters = DrafterAdapters(Drafter(), lambda i, s: fetched.append(i) or b"")
    adapters.offer(AdapterInfo(name, 1, Drafter.base_sha256, 4), "salt")
    adapters.wait()
    assert fetched == [] and adapters.failures == 1 and list(cache.iterdir()) == []
    with pytest.raises(ValueError, match="not an adapter sha256"):
        adapters.path(name)


def test_a_cached_adapter_is_hashed_again_and_one_that_does_not_match_is_fetched_again(cache):
    from tandem.edge.adapters import DrafterAdapters, adapter_path
    data = b"GGUF the adapter"
    info = info_of(data)
    path = adapter_path(info.sha256)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF something else")  # (a file under the right name, not the right bytes)
    fetched, drafter = [], Drafter()
    adapters = DrafterAdapters(drafter, lambda i, s: fetched.append(i) or data)
    adapters.offer(info, "salt")
    adapters.wait()
    assert fetched == [info] and path.read_bytes() == data and adapters.failures == 0
    again = DrafterAdapters(drafter, lambda i, s: fetched.append(i) or data)  # (a new process: the cache has it)
    again.offer(info, "salt")
    again.wait()
    assert len(fetched) == 1 and again.before_generation("salt") and drafter.loaded == [path]
    # changed on disk after it was taken: checked again before the drafter loads it, refused and deleted
    third = DrafterAdapters(drafter, lambda i, s: fetched.append(i) or data)
    third.offer(info, "salt")
    third.wait()
    path.write_bytes(b"GGUF tampered")
    assert third.before_generation("salt") and third.applied is None and third.failures == 1
    assert drafter.loaded[-1] is None and not path.exists()


def copy(x):
    """The cache's file of an adapter whose sha256 is ``x`` repeated."""
    return x * 64 + ".gguf"


def tmp(x):
    return f".{copy(x)}.1.2.tmp"


@pytest.mark.parametrize("files, keep, gone", [
    ([(copy("a"), 0), (copy("b"), 50)], set(), [copy("a")]),  # not taken for max_age_s (100 at t=100)
    ([(copy("a"), 90), (copy("b"), 80), (copy("c"), 70), (copy("d"), 95)], set(), [copy("b"), copy("c")]),  # count
    ([(copy("a"), 0), (copy("b"), 99)], {copy("a")}, []),  # kept: this process may load it next
    ([(tmp("a"), 0), (tmp("b"), 50), ("notes.txt", 0), ("x" * 64 + ".gguf", 0)], set(), [tmp("a")]),  # not ours
])
def test_stale_copies_are_those_not_taken_for_the_age_and_those_past_the_count(files, keep, gone):
    from tandem.edge.adapters import stale
    assert sorted(stale(files, now=100, max_age_s=100, max_files=2, keep=keep)) == sorted(gone)


def test_the_cache_prunes_stale_copies_when_opened_and_a_partitions_superseded_copy_after_a_take(cache):
    from tandem.edge.adapters import DrafterAdapters, adapter_path
    old, new, other = b"GGUF old", b"GGUF new", b"GGUF other"
    (cache / "adapters").mkdir()
    for data, age in ((old, 10), (other, 10), (b"GGUF stale", 2 * 86400)):
        p = adapter_path(info_of(data).sha256)
        p.write_bytes(data)
        os.utime(p, (p.stat().st_atime, p.stat().st_mtime - age))
    (cache / "adapters" / "README").write_text("not a copy")
    blobs = {info_of(data).sha256: data for data in (old, new, other)}
    adapters = DrafterAdapters(Drafter(), lambda i, s: blobs[i.sha256], max_age_s=86400)
    assert not adapter_path(info_of(b"GGUF stale").sha256).exists()  # opened: older than a day is gone
    for data, salt in ((old, "salt-a"), (other, "salt-b")):
        adapters.offer(info_of(data), salt)
        adapters.wait()
    adapters.offer(info_of(new), "salt-a")  # salt-a's next adapter
    adapters.wait()
    assert adapter_path(info_of(new).sha256).is_file() and not adapter_path(info_of(old).sha256).exists()
    assert adapter_path(info_of(other).sha256).is_file() and (cache / "adapters" / "README").is_file()


# -- the target's tokenizer -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fingerprint", ["../../x", "A" * 64, "0" * 32, "0" * 64 + "/.."])
def test_a_vocabulary_fingerprint_that_is_not_a_sha256_never_names_a_file(cache, fingerprint):
    from tandem.edge.client import EdgeClient, RemoteError
    from tandem.edge.translate import tokenizer_cache
    from tandem.protos import verifier_pb2 as pb
    with pytest.raises(ValueError, match="not a vocabulary fingerprint"):
        tokenizer_cache(fingerprint, "gguf-vocab")
    calls = []
    client = SimpleNamespace(health=lambda: pb.HealthResponse(vocab_fingerprint=fingerprint, vocab_size=8),
                             _stub=SimpleNamespace(Tokenizer=lambda *a, **kw: calls.append(a) or []), _metadata=())
    with pytest.raises(RemoteError, match="not a sha256") as e:
        EdgeClient.target_tokenizer_file(client)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and calls == [] and list(cache.iterdir()) == []
    assert tokenizer_cache("0" * 64).name == "0" * 32 + ".gguf"
