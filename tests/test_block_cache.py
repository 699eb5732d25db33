"""Block-hashed prefix cache (cloud/caches/block_cache.py): chained block matching, shared prefixes stored once, LRU
eviction of leaves under a token budget. Payloads are literal strings naming the block they were copied from."""
import pytest

from tandem.cloud.caches.block_cache import BlockCache

B = 4


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def store(cache: BlockCache, tokens: list[int], tag: str) -> tuple[int, list[int]]:
    """Store with payloads f"{tag}{i}"; returns (blocks added, the block indices whose payload was asked for)."""
    asked = []

    def payload(i):
        asked.append(i)
        return f"{tag}{i}"
    return cache.store(tokens, payload), asked


@pytest.mark.parametrize("prompt,payloads,n", [
    (seq(0, 13), ["a0", "a1", "a2"], 12),  # 3 full blocks; the partial 4th is never cached
    (seq(0, 12), ["a0", "a1", "a2"], 12),
    (seq(0, 10) + [99, 98], ["a0", "a1"], 8),  # a miss in block 2 ends the chain
    (seq(0, 7), [], 0),  # one full block (4 tokens) is under min_tokens = 8
    ([99] + seq(1, 12), [], 0),  # the first block differs: nothing after it can match (its KV saw token 99)
])
def test_lookup_reuses_the_longest_chain_of_whole_blocks(prompt, payloads, n):
    c = BlockCache(budget_tokens=64, block_tokens=B, min_tokens=8)
    assert store(c, seq(0, 14), "a") == (3, [0, 1, 2])
    assert c.peek(prompt) == n
    assert c.lookup(prompt) == (payloads, n)


def test_a_block_matches_only_under_the_same_prefix():
    c = BlockCache(budget_tokens=64, block_tokens=B, min_tokens=4)
    store(c, [1, 1, 1, 1, 7, 7, 7, 7], "a")
    # block [7, 7, 7, 7] is cached, but after [1, 1, 1, 1]; under [2, 2, 2, 2] it is another block
    assert c.lookup([2, 2, 2, 2, 7, 7, 7, 7, 0]) == ([], 0)
    assert c.lookup([1, 1, 1, 1, 7, 7, 7, 7, 0]) == (["a0", "a1"], 8)


def test_a_shared_prefix_is_stored_once_and_only_new_blocks_are_copied():
    c = BlockCache(budget_tokens=64, block_tokens=B, min_tokens=8)
    system = seq(100, 8)
    assert store(c, system + seq(0, 8), "a") == (4, [0, 1, 2, 3])
    assert store(c, system + seq(50, 9), "b") == (2, [2, 3])  # the system prompt's two blocks are shared
    assert len(c) == 6 and c.cached_tokens == 24
    assert c.lookup(system + seq(50, 8) + [1]) == (["a0", "a1", "b2", "b3"], 16)
    assert store(c, system + seq(0, 8), "c") == (0, [])  # all cached already
    assert store(c, seq(0, 7), "d") == (0, [])  # under min_tokens
    assert (c.stats.stored, c.stats.hits, c.stats.reused_tokens) == (6, 1, 16)


def test_least_recently_used_leaves_go_first_and_a_chain_is_never_stranded():
    c = BlockCache(budget_tokens=24, block_tokens=B, min_tokens=8)  # 6 blocks
    x, y, z = seq(0, 12), seq(100, 12), seq(200, 8)
    store(c, x, "x")
    store(c, y, "y")
    c.lookup(x)  # x used last: y's chain is the oldest
    assert store(c, z, "z") == (2, [0, 1])
    # y's two newest blocks went, leaf first; x is whole; y's first block stays (6 = x's 3 + z's 2 + 1)
    assert c.lookup(y) == ([], 0)
    assert c.lookup(x)[1] == 12 and c.lookup(z)[1] == 8
    assert len(c) == 6 and c.stats.evicted == 2
    store(c, y[:8], "w")  # y's second block comes back under its cached first one: only it is copied
    assert c.stats.stored == 3 + 3 + 2 + 1


def test_the_chain_being_stored_is_kept_and_a_sequence_over_the_budget_keeps_its_first_blocks():
    c = BlockCache(budget_tokens=16, block_tokens=B, min_tokens=8)  # 4 blocks
    store(c, seq(0, 12), "a")
    assert store(c, seq(0, 40), "a") == (1, [3])  # extends its own chain: only one block fits, none evicted
    assert c.lookup(seq(0, 40))[1] == 16
    assert store(c, seq(500, 40), "b") == (4, [0, 1, 2, 3])  # evicts the whole older chain, leaves first
    assert c.lookup(seq(0, 16)) == ([], 0) and c.lookup(seq(500, 40))[1] == 16
    assert c.clear() == 4 and len(c) == 0 and c.lookup(seq(500, 40)) == ([], 0)


def test_bad_block_size_is_refused():
    with pytest.raises(ValueError, match="block_tokens"):
        BlockCache(budget_tokens=64, block_tokens=0)
