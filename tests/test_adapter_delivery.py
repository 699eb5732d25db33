"""Drafter adapters through the real stack (the pinned pair): the verifier names a partition's adapter in its
Opened, the edge fetches it and drafts that partition's next generation with it, and with no other partition's;
another partition's caller cannot fetch it; a drafter that is not the adapter's base ignores it; an adapter that
wrecks the drafts changes no token of the output (greedy, token-exact against target-only decoding)."""
import grpc
import numpy as np
import pytest

from tandem.cloud.backend import LocalBackend
from tandem.cloud.learning.lora_gguf import lora_gguf
from tandem.cloud.learning.online import AdapterStore
from tandem.cloud.server import serve
from tandem.core import tenancy
from tandem.core.auth import ApiKeys
from tandem.core.model_id import file_sha256
from tandem.core.tree import TreeShape
from tandem.edge.client import EdgeClient
from tandem.protos import verifier_pb2 as pb

pytest.importorskip("gguf")
KEY, SALT_A, SALT_B = "delivery-key", "tenant-a", "tenant-b"
SHAPE = TreeShape(1, 4, 4)


def wrecking_adapter(base: str, hidden=896, rank=4, seed=0) -> bytes:
    """A LoRA on every layer's attention output of the 0.5B drafter, large enough to change its choices."""
    rng = np.random.default_rng(seed)
    lora = {f"model.layers.{i}.self_attn.o_proj": (rng.standard_normal((rank, hidden)).astype(np.float32) * 0.5,
                                                    rng.standard_normal((hidden, rank)).astype(np.float32) * 0.5)
            for i in range(24)}
    return lora_gguf(lora, alpha=rank, model_type="qwen2", n_blocks=24, base=base, version=1)


@pytest.fixture(scope="module")
def stack(engine, drafter_path, make_drafter, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("TANDEM_CACHE", str(tmp_path_factory.mktemp("cache")))  # (the edge's adapter cache)
    adapters = AdapterStore()
    backend = LocalBackend(engine, max_sessions=2, adapters=adapters)
    server, port = serve(backend=backend, address="127.0.0.1:0", keys=ApiKeys.of([KEY]))
    data = wrecking_adapter(file_sha256(drafter_path))
    info = adapters.publish(tenancy.partition(SALT_A, KEY), data, file_sha256(drafter_path), 1)
    client = EdgeClient(make_drafter(), f"127.0.0.1:{port}", SHAPE, stream=False, api_key=KEY)
    yield client, info, port
    client.close()
    server.stop(grace=None)
    backend.scheduler.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_the_partitions_next_generation_drafts_with_its_adapter_and_the_output_stays_the_targets(stack, engine,
                                                                                                 humaneval_chats,
                                                                                                 target_greedy):
    client, info, _ = stack
    prompt = client.prompt_tokens(humaneval_chats[0])
    ref = target_greedy(engine, prompt, 24)
    first = client.generate(prompt, 24, cache_salt=SALT_A).result()  # its Opened names the adapter
    client.adapters.wait()
    assert client.adapters.applied is None and client.adapters.path(info.sha256) is not None
    second = client.generate(prompt, 24, cache_salt=SALT_A).result()
    assert client.adapters.applied == (SALT_A, info.sha256)
    assert first.tokens == ref.tokens[:len(first.tokens)] and second.tokens == first.tokens
    # the wrecked drafter's chains are mostly rejected: fewer tokens per verify forward than the base drafter's
    assert second.stats.tau < first.stats.tau
    third = client.generate(prompt, 24, cache_salt=SALT_B).result()  # another partition: the base drafter again
    assert client.adapters.applied is None and third.tokens == first.tokens
    assert third.stats.tau == pytest.approx(first.stats.tau)


def test_another_partitions_caller_cannot_fetch_the_adapter(stack):
    client, info, _ = stack
    own = client._fetch_adapter(info, SALT_A)
    assert len(own) == info.size_bytes
    with pytest.raises(grpc.RpcError) as e:
        client._fetch_adapter(info, SALT_B)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        list(client._stub.DrafterAdapter(pb.AdapterRequest(sha256=info.sha256, cache_salt=SALT_A), timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED  # (no key: no partition at all)


def test_a_drafter_that_is_not_the_adapters_base_leaves_it(stack, make_drafter, humaneval_chats):
    from dataclasses import replace

    from tandem.edge.adapters import DrafterAdapters
    client, info, _ = stack
    fetched = []
    other = DrafterAdapters(client.drafter, lambda i, s: fetched.append(i) or b"")
    other.offer(replace(info, base="0" * 64), SALT_A)
    other.wait()
    assert fetched == [] and not other.before_generation(SALT_A) and other.applied is None
