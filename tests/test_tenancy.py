"""Tenants sharing a verifier: every cache is partitioned (prefix caches of both engines, cache-aware placement,
n-grams, a drafter's kept cells), and the gRPC plane limits each verifier key (sessions at once, prefill tokens a
minute, session lifetime) and pushes back on a client that floods its stream. The stack runs on a tiny random-weight
model (torch engine with its block prefix cache), the same code paths as the real pair."""
import queue
import threading
import time

import grpc
import pytest

from tandem.cloud.caches.block_cache import BlockCache
from tandem.cloud.caches.prefix_cache import PrefixCache
from tandem.core import tenancy, wire
from tandem.core.auth import ApiKeys
from tandem.core.messages import DraftRequest, Limits, OpenRequest
from tandem.core.tree import DraftTree, TreeShape
from tandem.edge.ngram import NgramDrafter
from tandem.orchestrator.pool.placement import Placement
from tandem.protos import verifier_pb2 as pb
from tandem.protos import verifier_pb2_grpc as pb_grpc

A = list(range(100, 140))  # 40 tokens


def test_partitions_are_digests_of_salt_or_key():
    a, b = tenancy.partition("", "key-a"), tenancy.partition("", "key-b")
    assert a != b and "key-a" not in a and len(a) == 64 and tenancy.tenant("key-a") == a
    # a salt names a partition within its key only: a guessable salt joins nobody else's
    assert tenancy.partition("team", "key-a") != tenancy.partition("team", "key-b")
    assert tenancy.partition("team", "key-a") != a and tenancy.partition("", "") == tenancy.SHARED
    assert tenancy.partition("b", "a") != tenancy.partition("", "a\0b")  # (fields, not a concatenation)
    # the gateway's salts: per key, unguessable without the secret, a request's own salt within its key
    s1, s2 = b"secret-1", b"secret-2"
    assert tenancy.gateway_salt(s1, "a") != tenancy.gateway_salt(s1, "b") != tenancy.gateway_salt(s2, "b")
    assert tenancy.gateway_salt(s1, "a", "team") != tenancy.gateway_salt(s1, "b", "team")
    assert tenancy.gateway_salt(s1, "a", "team") != tenancy.gateway_salt(s2, "a", "team")
    assert tenancy.gateway_salt(s1, "a", "team") != tenancy.partition("team", "")  # not nameable over gRPC
    # a device's salt: per key and scope, never a REST salt of its key
    d = tenancy.device_salt(s1, "digest-a", "token:1")
    assert d != tenancy.device_salt(s1, "digest-a", "token:2") != tenancy.device_salt(s2, "digest-a", "token:2")
    assert d not in {tenancy.gateway_salt(s1, "digest-a"), tenancy.gateway_salt(s1, "digest-a", "token:1")}
    with pytest.raises(tenancy.SaltError):
        tenancy.check_salt("x" * (tenancy.MAX_SALT_CHARS + 1))


def test_prefix_cache_entries_belong_to_their_partition():
    c = PrefixCache(slots=[200, 201, 202], budget_tokens=1000, min_tokens=32)
    assert c.store(A, "p") == (200, [])
    assert c.lookup(A + [1], "q") == (None, 0) and c.peek(A, "q") == 0  # the same tokens, another tenant
    assert c.store(A + [1, 2], "q") == (201, [])  # extends nothing of q's: p's entry stays
    assert c.lookup(A + [5], "p") == (200, 40) and c.lookup(A + [1, 2, 3], "q") == (201, 42)
    assert c.store(A + [7], "p") == (200, [200])  # p's own entry is extended in place


def test_block_cache_chains_start_at_their_partition():
    c = BlockCache(budget_tokens=1000, block_tokens=8, min_tokens=16)
    assert c.store(A, lambda i: f"p{i}", "p") == 5
    assert c.lookup(A, "q") == ([], 0) and c.peek(A, "q") == 0
    assert c.store(A, lambda i: f"q{i}", "q") == 5  # stored again: other blocks, other payloads
    assert c.lookup(A, "p") == ([f"p{i}" for i in range(5)], 40)
    assert c.lookup(A, "q")[0] == [f"q{i}" for i in range(5)]


def test_placement_routes_by_prefixes_of_the_same_partition_only():
    p = Placement({"r0": 4, "r1": 4})
    p.place("s0", A, "victim")  # least loaded: r0
    p.opened("r0", A, "victim")  # r0 now holds the victim's prompt; r1 is the least loaded
    for who, expected_routed in (("victim", True), ("prober", False)):
        before = p.prefix_routed
        p.place(f"next-{who}", A + [1], who)
        assert (p.prefix_routed > before) is expected_routed, who
        p.release(f"next-{who}")


def test_ngram_cache_is_partitioned():
    d = NgramDrafter(n_min=3, n_max=3)
    d.start([1, 2], "p")
    d.extend([3, 4, 5, 6, 7])
    d.finish()
    d.start([9, 3, 4, 5], "q")
    assert d.propose() == []  # p's continuation of 3 4 5 is p's alone
    d.start([9, 3, 4, 5], "p")
    assert d.propose() == [6, 7]


# -- through gRPC on a tiny stack ----------------------------------------------------------------------------------
torch = pytest.importorskip("torch")

from tandem.cloud.backend import LocalBackend  # noqa: E402
from tandem.cloud.engines.pacing import CostCurve, PacedEngine  # noqa: E402
from tandem.cloud.server import StreamLimits, serve  # noqa: E402
from tandem.cloud.engines.torch_engine import TorchVerifierEngine  # noqa: E402
from tandem.edge.client import EdgeClient  # noqa: E402

from tinystack import TinyDrafter, tiny_model  # noqa: E402

PROMPT = [(7 * i) % 11 + 1 for i in range(64)]  # 64 tokens of the tiny vocabulary


def stack(keys=("key-a", "key-b"), limits=StreamLimits(), ms_per_forward=0.0, **kw):
    engine = TorchVerifierEngine(model=tiny_model(), n_ctx=160, device="cpu", max_sessions=4,
                                 prefix_cache_tokens=1024, prefix_block_tokens=16)
    served = PacedEngine(engine, CostCurve("slow", (1,), (ms_per_forward,))) if ms_per_forward else engine
    backend = LocalBackend(served, Limits(0, 8, 4), max_sessions=4)
    srv, port = serve(backend=backend, address="127.0.0.1:0", keys=ApiKeys.of(keys), limits=limits, **kw)
    return srv, backend, f"127.0.0.1:{port}", engine


def generate(address, key, prompt=PROMPT, salt="", n=4):
    client = EdgeClient(TinyDrafter(tiny_model()), address, TreeShape(1, 3, 3), api_key=key)
    try:
        return client.generate(prompt, max_new_tokens=n, cache_salt=salt).result()
    finally:
        client.close()


def wait_idle(backend):
    deadline = time.monotonic() + 10
    while backend.active_sessions() and time.monotonic() < deadline:  # the session is stored when it closes
        time.sleep(0.02)


def test_another_key_finds_nothing_of_a_prompt_and_the_same_salt_shares_nothing_across_keys():
    """Key a's conversation is cached when it ends. Key b sends the same 64-token prompt: nothing is reused
    (cached_tokens 0, and the engine computed every token: no faster prefill); key a again reuses it. Two keys
    sending the same cache_salt share nothing (a salt is a partition within its key); one key's salt is its own."""
    srv, backend, address, engine = stack()
    stats = engine.prefix_cache.stats
    try:
        generate(address, "key-a")
        wait_idle(backend)
        hits = (stats.hits, stats.reused_tokens)
        other = generate(address, "key-b")
        assert other.stats.cached_tokens == 0 and (stats.hits, stats.reused_tokens) == hits
        wait_idle(backend)
        again = generate(address, "key-a")
        assert again.stats.cached_tokens >= 48 and stats.hits == hits[0] + 1
        wait_idle(backend)
        team = [generate(address, key, salt="team-secret-1") for key in ("key-a", "key-b")]
        assert team[0].stats.cached_tokens == 0 and team[1].stats.cached_tokens == 0
        wait_idle(backend)
        assert generate(address, "key-a", salt="team-secret-1").stats.cached_tokens >= 48
        assert other.tokens == again.tokens == team[0].tokens  # partitions change what is reused, never the output
    finally:
        srv.stop(None)
        backend.scheduler.stop()


def open_stream(address, key, prompt=PROMPT, **open_kw):
    """A raw session stream: (responses iterator, request queue, channel); the Open is sent."""
    ch = grpc.insecure_channel(address)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    requests.put(wire.open_to_wire(OpenRequest(tuple(prompt), limits=Limits(8, 4, 4), **open_kw)))
    responses = pb_grpc.VerifierStub(ch).Session(iter(requests.get, None), timeout=30,
                                                 metadata=(("authorization", f"Bearer {key}"),))
    return responses, requests, ch


def refusal(responses) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        next(responses)
    return e.value


def test_each_verifier_key_has_its_own_session_and_prefill_limits():
    srv, backend, address, _ = stack(keys=("key-a", "key-b", "gateway"), exempt=ApiKeys.of(["gateway"]),
                                     limits=StreamLimits(key_sessions=1, key_prefill_tokens_per_minute=100))
    streams = []
    try:
        first = open_stream(address, "key-a")
        streams.append(first)
        assert next(first[0]).WhichOneof("kind") == "opened"
        second = open_stream(address, "key-a")
        streams.append(second)
        err = refusal(second[0])
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--key-sessions" in err.details()
        b = open_stream(address, "key-b")  # another key still opens
        streams.append(b)
        assert next(b[0]).WhichOneof("kind") == "opened"
        for _ in range(2):  # a gateway's key is outside the per-key limits
            g = open_stream(address, "gateway")
            streams.append(g)
            assert next(g[0]).WhichOneof("kind") == "opened"
        b[1].put(None)  # key b ends its session: its 64 prefill tokens stay charged (36 of 100 left)
        for _ in b[0]:
            pass
        again = open_stream(address, "key-b")
        streams.append(again)
        err = refusal(again[0])
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--key-prefill-tokens-per-minute" in err.details()
        short = open_stream(address, "key-b", prompt=PROMPT[:30])  # what the budget still covers
        streams.append(short)
        assert next(short[0]).WhichOneof("kind") == "opened"
    finally:
        for _, requests, ch in streams:
            requests.put(None)
            ch.close()
        srv.stop(None)
        backend.scheduler.stop()


def silent_stream(address, key):
    """A session stream that never sends its Open: (responses, requests, channel)."""
    ch = grpc.insecure_channel(address)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    responses = pb_grpc.VerifierStub(ch).Session(iter(requests.get, None), timeout=30,
                                                 metadata=(("authorization", f"Bearer {key}"),))
    return responses, requests, ch


def test_one_key_cannot_hold_every_stream_before_its_open():
    srv, backend, address, _ = stack(keys=("key-a", "key-b", "gateway"), exempt=ApiKeys.of(["gateway"]),
                                     limits=StreamLimits(key_pending_streams=2))
    streams = []
    try:
        streams += [silent_stream(address, "key-a") for _ in range(2)]
        time.sleep(0.3)  # (both are in the servicer)
        third = silent_stream(address, "key-a")
        streams.append(third)
        err = refusal(third[0])
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "have not sent their Open" in err.details()
        b = open_stream(address, "key-b")  # another key still opens
        streams.append(b)
        assert next(b[0]).WhichOneof("kind") == "opened"
        streams += [silent_stream(address, "gateway") for _ in range(3)]  # a gateway's key limits its own callers
        opened = open_stream(address, "gateway")
        streams.append(opened)
        assert next(opened[0]).WhichOneof("kind") == "opened"
        streams[0][1].put(None)  # one silent stream of key a ends: a new one is admitted and opens
        time.sleep(0.3)
        again = open_stream(address, "key-a")
        streams.append(again)
        assert next(again[0]).WhichOneof("kind") == "opened"
    finally:
        for _, requests, ch in streams:
            requests.put(None)
            ch.close()
        srv.stop(None)
        backend.scheduler.stop()


def test_downloads_are_charged_to_the_key():
    """A Tokenizer (or DrafterAdapter) call holds a session slot while it streams and costs prefill tokens: a key
    cannot download without limit."""
    from tandem.cloud.server import DOWNLOAD_COST_TOKENS
    srv, backend, address, _ = stack(limits=StreamLimits(key_prefill_tokens_per_minute=DOWNLOAD_COST_TOKENS + 100))
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.VerifierStub(ch)

            def download(key):
                try:
                    return len(b"".join(c.data for c in stub.Tokenizer(
                        pb.TokenizerRequest(), timeout=30, metadata=(("authorization", f"Bearer {key}"),))))
                except grpc.RpcError as e:
                    return e.code()

            first = download("key-a")
            assert first not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED)
            assert download("key-a") == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert download("key-b") == first  # another key's budget
    finally:
        srv.stop(None)
        backend.scheduler.stop()


def test_a_second_verifier_on_a_port_in_use_fails_naming_it():
    from tandem.cloud.engines.scripted_engine import ScriptedEngine
    from tandem.cloud.server import PortInUse, serve as serve_scripted
    first, port = serve_scripted(ScriptedEngine(), "127.0.0.1:0")
    try:
        with pytest.raises(PortInUse, match=f"127.0.0.1:{port}.*in use"):
            serve_scripted(ScriptedEngine(), f"127.0.0.1:{port}")
        assert first.servicer.streams == 0 and grpc.insecure_channel(f"127.0.0.1:{port}")  # the first still serves
    finally:
        first.stop(None)


def test_a_session_outliving_its_lifetime_is_ended_and_freed():
    srv, backend, address, _ = stack(limits=StreamLimits(session_lifetime_s=0.5))
    responses, requests, ch = open_stream(address, "key-a")
    try:
        opened = next(responses).opened
        time.sleep(0.7)
        requests.put(pb.SessionRequest(draft=pb.Draft(session_id=opened.session_id, committed_len=len(PROMPT),
                                                      seq=1)))
        err = refusal(responses)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--session-lifetime-s" in err.details()
        wait_idle(backend)
        assert backend.active_sessions() == 0
    finally:
        requests.put(None)
        ch.close()
        srv.stop(None)
        backend.scheduler.stop()


def test_a_client_that_floods_its_stream_is_pushed_back(monkeypatch):
    """10,000 drafts sent without reading a verdict: the verifier takes at most its inbox's worth ahead of what it
    has verified, and gRPC's flow control holds the rest (its window: bounded whatever the client sends), so the
    server's memory does not grow with the flood."""
    from tandem.cloud import server as server_module
    reads = [0]
    real_read = server_module._read

    async def counting_read(request_iterator, inbox):
        async def counted():
            async for req in request_iterator:
                reads[0] += 1
                yield req
        await real_read(counted(), inbox)

    monkeypatch.setattr(server_module, "_read", counting_read)
    srv, backend, address, _ = stack(ms_per_forward=50.0, limits=StreamLimits(inbox_messages=4))
    pulled = 0
    sent_all = threading.Event()
    ch = grpc.insecure_channel(address)
    first: queue.SimpleQueue = queue.SimpleQueue()
    sid: list[str] = []

    def requests():
        nonlocal pulled
        yield wire.open_to_wire(OpenRequest(tuple(PROMPT[:8]), limits=Limits(0, 8, 4)))
        first.get()  # the session id, once Opened arrived
        tree = DraftTree(tuple(1 + i % 10 for i in range(8)), (-1, 0, 1, 2, -1, 4, 5, 6))
        for i in range(10_000):
            pulled += 1
            yield wire.draft_to_wire(sid[0], DraftRequest(8, tree, seq=i + 1, node_logp=(-0.5,) * 8))
        sent_all.set()

    responses = pb_grpc.VerifierStub(ch).Session(requests(), timeout=60,
                                                 metadata=(("authorization", "Bearer key-a"),))
    try:
        sid.append(next(responses).opened.session_id)
        first.put(True)
        time.sleep(3.0)  # ~60 verify forwards' worth (the session has room for ~140); no verdict is read
        verified = backend.scheduler.stats.forwards
        assert 10 < verified and reads[0] <= verified + 4 + 3, (reads[0], verified, pulled)  # Open + in flight
    finally:
        responses.cancel()
        ch.close()
        srv.stop(None)
        backend.scheduler.stop()


def test_a_drafter_keeps_its_cells_only_for_the_partition_that_filled_them():
    """A gateway's drafter serves one API key after another: the cells it kept from one key's conversation are
    dropped before another key's generation (they would draft that text faster for the wrong tenant)."""
    srv, backend, address, _ = stack()

    class Recording(TinyDrafter):
        def start(self, prompt):
            self.starts.append(list(prompt))
            super().start(prompt)

    drafter = Recording(tiny_model())
    drafter.starts = []
    client = EdgeClient(drafter, address, TreeShape(1, 3, 3), api_key="key-a")
    try:
        from tandem.edge.client import wait_idle
        forgets = []
        for salt in ("tenant-a", "tenant-a", "tenant-b", "tenant-b"):
            client.generate(PROMPT[:40], max_new_tokens=2, cache_salt=salt).result()
            wait_idle(drafter)  # (a short generation may end before its drafter's jobs run: they are dropped)
            forgets.append(drafter.starts.count([]))
        assert forgets == [1, 1, 2, 2]  # dropped before the first (its cells were nobody's) and at the change only
    finally:
        client.close()
        srv.stop(None)
        backend.scheduler.stop()


def test_health_fails_a_verifier_with_no_live_replica():
    """`tandem health --grpc` (the container and k8s probes) fails when the verifier answers but can take no
    session: every replica of its pool lost."""
    from tandem.cloud.backend import BackendInfo
    from tandem.orchestrator import cli

    class NoReplica:
        info = BackendInfo("torch x0 (ray)", "m", 12, "", 128, 0)

        def active_sessions(self):
            return 0

    srv, port = serve(backend=NoReplica(), address="127.0.0.1:0")
    try:
        assert cli.main(["health", "--grpc", f"127.0.0.1:{port}"]) == 1
        NoReplica.info = BackendInfo("torch x1 (ray)", "m", 12, "", 128, 8)
        assert cli.main(["health", "--grpc", f"127.0.0.1:{port}"]) == 0
    finally:
        srv.stop(None)
