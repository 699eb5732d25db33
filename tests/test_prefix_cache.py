"""Prefix cache: the bookkeeping on literal token lists, then the llama.cpp engine reusing a finished session's KV
for the next turn (token-exact against decoding without the cache, up to near-ties), and the edge seeing it."""
import pytest

from tandem.cloud.caches.prefix_cache import PrefixCache
from tandem.core.tree import common_prefix

A = list(range(100, 140))  # 40 tokens


@pytest.mark.parametrize("a,b,n", [([], [1], 0), ([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2),
                                   ([5], [6], 0), ([7, 8], [7, 8], 2)])
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == common_prefix(b, a) == n


def test_lookup_finds_the_longest_shared_prefix():
    c = PrefixCache(slots=[200, 201], budget_tokens=1000, min_tokens=32)
    assert c.lookup(A) == (None, 0)  # empty
    assert c.store(A[:10]) == (None, [])  # under min_tokens: not worth a slot
    assert c.store(A) == (200, [])
    assert c.lookup(A + [1, 2]) == (200, 40)  # the next turn: all of A reused
    assert c.lookup(A[:35] + [999]) == (200, 35)
    assert c.lookup(A[:20] + [999] * 30) == (None, 0)  # shares only 20 < 32
    assert (c.stats.lookups, c.stats.hits, c.stats.reused_tokens) == (4, 2, 75)


def test_a_longer_history_replaces_its_prefix_and_a_prefix_adds_nothing():
    c = PrefixCache(slots=[200, 201], budget_tokens=1000, min_tokens=32)
    c.store(A)
    slot, dropped = c.store(A + [1, 2, 3])  # turn 2 extends turn 1
    assert dropped == [200] and slot == 200 and len(c) == 1
    assert c.store(A[:38]) == (None, [])  # already covered
    assert c.lookup(A + [1, 2, 3, 4]) == (200, 43)


def test_least_recently_used_goes_first_by_slots_and_by_budget():
    x, y, z = [list(range(s, s + 40)) for s in (1000, 2000, 3000)]
    c = PrefixCache(slots=[200, 201], budget_tokens=1000, min_tokens=32)
    assert c.store(x) == (200, [])
    assert c.store(y) == (201, [])
    c.lookup(x + [5])  # x used last: y is the oldest
    assert c.store(z) == (201, [201])
    assert c.lookup(y) == (None, 0) and c.lookup(x)[0] == 200 and c.lookup(z)[0] == 201
    c = PrefixCache(slots=[200, 201, 202], budget_tokens=90, min_tokens=32)
    c.store(x)
    c.store(y)
    assert c.store(z) == (200, [200])  # 120 tokens over 90: x (oldest) goes, slots were not the limit
    assert c.cached_tokens == 80
    assert c.store(list(range(5000, 5100))) == (None, [])  # more than the whole budget: not kept
    assert sorted(c.clear()) == [200, 201] and len(c) == 0 and c.lookup(z) == (None, 0)


@pytest.fixture(scope="module")
def cached_engine(target_path):
    """The target with a prefix cache, as `tandem serve` runs it (the suite's shared engine has none)."""
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    return LlamaVerifierEngine(target_path, n_ctx=2048, max_sessions=2, prefix_cache_tokens=2048)


@pytest.fixture(scope="module")
def cached_server(cached_engine):
    from tandem.cloud.backend import LocalBackend
    from tandem.cloud.server import serve
    backend = LocalBackend(cached_engine, max_sessions=2)
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    yield f"127.0.0.1:{port}"
    srv.stop(grace=None)
    backend.scheduler.stop()


@pytest.fixture(scope="module")
def chat_turns(cached_engine, humaneval_chats):
    """Turn 1: a HumanEval prompt and 24 greedy tokens (decoded on the cached engine, so turn 1 is cached);
    turn 2: that history plus a new user message."""
    from tandem.cloud import reference
    tok = cached_engine.model
    turn1 = tok.tokenize(tok.chat_prompt(humaneval_chats[0]))
    answer = reference.greedy(cached_engine, turn1, 24).tokens
    turn2 = turn1 + answer + tok.tokenize("<|im_end|>\n<|im_start|>user\nNow add type hints.<|im_end|>\n"
                                          "<|im_start|>assistant\n", special=True)
    return turn1, answer, turn2


def test_engine_reuses_the_last_turn_and_decodes_the_same(cached_engine, engine, chat_turns, noise):
    """The session that decoded turn 1 is cached when released; turn 2's prefill copies all of it (prompt and
    answer but the last token) and computes only the new message; its greedy continuation equals decoding turn 2
    on an engine without a cache, up to near-ties."""
    from tandem.cloud import reference
    turn1, answer, turn2 = chat_turns
    seq = cached_engine.new_sequence()
    try:
        reused = cached_engine.prefill(seq, turn2[:-1])
    finally:
        cached_engine.release(seq)
    assert reused >= len(turn1) + len(answer) - 1
    cached = reference.greedy(cached_engine, turn2, 24).tokens
    assert engine.prefix_cache is None
    verdict = reference.classify(cached, reference.greedy(engine, turn2, 24), noise)
    assert verdict.ok, str(verdict)
    assert cached_engine.sequences_in_use() == 0


def test_speculative_turns_with_the_cache_are_lossless(cached_server, cached_engine, drafter, chat_turns, noise):
    """Through gRPC with trees (lock-step and streamed), turn after turn: the second turn's Opened says how much of
    its prompt came from the cache, the generation's stats carry it (REST: usage.prompt_tokens_details), and every
    answer equals target-only decoding on the same engine, up to near-ties. The reference's prefill copies the
    cells the answer was verified on, so only batch shape differs, as in the other lossless tests; that the cache
    itself changes nothing but rounding is the test above."""
    from tandem.cloud import reference
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    turn1, answer, _ = chat_turns
    tok = cached_engine.model
    for shape, stream, ask in ((TreeShape(4, 16, 6), False, "Explain it."), (TreeShape(1, 6, 6), True, "Test it.")):
        client = EdgeClient(drafter, cached_server, shape, stream=stream)
        follow = f"<|im_end|>\n<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n"
        prompt = turn1 + answer + tok.tokenize(follow, special=True)  # a turn 2 no earlier test used
        first = client.generate(prompt, max_new_tokens=24).result()
        assert first.stats.cached_tokens >= len(turn1) + len(answer) - 1  # turn 1 was cached by the fixture
        nxt = prompt + first.tokens + tok.tokenize("<|im_end|>\n<|im_start|>user\nThanks.<|im_end|>\n"
                                                   "<|im_start|>assistant\n", special=True)
        second = client.generate(nxt, max_new_tokens=24).result()
        client.close()
        # every committed token but the last is in the cache (the last is the root of a forward that never ran)
        assert len(prompt) + len(first.tokens) - 1 <= second.stats.cached_tokens < len(nxt)
        assert cached_engine.sequences_in_use() == 0  # both answers' cells are in the cache now
        for turn, gen, p in (("first", first, prompt), ("second", second, nxt)):
            verdict = reference.classify(gen.tokens, reference.greedy(cached_engine, p, 24), noise)
            assert verdict.ok, (shape, stream, turn, str(verdict))
    assert len(cached_engine.prefix_cache) > 0
    cached_engine.reset_prefix_cache()
    assert len(cached_engine.prefix_cache) == 0 and cached_engine.sequences_in_use() == 0
