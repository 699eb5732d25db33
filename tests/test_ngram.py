"""N-gram drafts (prompt lookup + cross-session cache) and grafting a proposal onto a model tree, on literal data."""
import pytest

from tandem.core.tree import DraftTree, validate
from tandem.edge.drafting import graft
from tandem.edge.ngram import NgramDrafter


@pytest.mark.parametrize("history,limit,expected", [
    ([1, 2, 3, 4, 9, 1, 2, 3], 8, [4, 9, 1, 2, 3]),  # suffix 1 2 3 seen before: what followed it
    ([1, 2, 3, 4, 9, 1, 2, 3], 2, [4, 9]),
    ([5, 6, 7, 8], 8, []),  # nothing repeats
    ([1, 2, 7, 1, 2, 8, 1, 2], 8, [8, 1, 2]),  # most recent occurrence wins
    ([3, 1, 2, 9, 4, 1, 2], 8, [9, 4, 1, 2]),  # a shorter (n = 2) match when the longer one fails
    ([7, 7, 7, 7], 3, [7]),  # the suffix never matches itself; the overlapping earlier one does
])
def test_prompt_lookup(history, limit, expected):
    d = NgramDrafter(n_max=3, n_min=2)
    d.start(history)
    assert d.propose(limit) == expected


def test_extend_matches_start_and_cache_carries_across_sessions():
    a, b = NgramDrafter(n_max=3, n_min=2), NgramDrafter(n_max=3, n_min=2)
    a.start([1, 2, 3, 4, 9, 1, 2])
    b.start([1, 2])
    b.extend([3, 4, 9, 1, 2])
    assert a.propose() == b.propose() == [3, 4, 9, 1, 2]
    d = NgramDrafter(n_max=3, n_min=2, max_tokens=4)
    d.start([100, 101])  # prompt
    d.extend([10, 11, 12, 13, 14, 15])  # generated
    d.finish()
    d.start([50, 10, 11])  # a new session whose own history has no earlier 10 11
    assert d.propose() == [12, 13, 14, 15]
    d.extend([12, 99])
    assert d.propose() == []


def test_cache_is_bounded():
    d = NgramDrafter(n_max=2, n_min=2, cache_entries=3)
    d.start([])
    d.extend(range(50))
    d.finish()
    assert len(d._cache) == 3


CHAIN = DraftTree.chain([10, 11, 12])  # the drafter's chain
TREE = DraftTree((10, 20, 11, 21), (-1, -1, 0, 0))  # root -> 10 (-> 11, 21), 20


@pytest.mark.parametrize("tree,proposal,max_nodes,max_depth,expected_tokens,expected_parents,added", [
    (CHAIN, [10, 11, 12, 13, 14], 16, 8, (10, 11, 12, 13, 14), (-1, 0, 1, 2, 3), 2),  # extends the chain
    (CHAIN, [10, 11, 30, 31], 16, 8, (10, 11, 12, 30, 31), (-1, 0, 1, 1, 3), 2),  # branches where they part
    (CHAIN, [40, 41], 16, 8, (10, 11, 12, 40, 41), (-1, 0, 1, -1, 3), 2),  # a new root branch, after 10
    (CHAIN, [10, 11, 12, 13, 14], 4, 8, (10, 11, 12, 13), (-1, 0, 1, 2), 1),  # node budget
    (CHAIN, [10, 11, 12, 13, 14], 16, 4, (10, 11, 12, 13), (-1, 0, 1, 2), 1),  # depth limit
    (CHAIN, [10, 11], 16, 8, (10, 11, 12), (-1, 0, 1), 0),  # already in the tree
    (TREE, [10, 21, 5], 16, 8, (10, 20, 11, 21, 5), (-1, -1, 0, 0, 3), 1),  # follows the second-ranked child
    (DraftTree(), [7, 8], 16, 8, (7, 8), (-1, 0), 2),  # no model draft: the proposal alone
])
def test_graft(tree, proposal, max_nodes, max_depth, expected_tokens, expected_parents, added):
    out, n = graft(tree, proposal, max_nodes, max_depth)
    assert (out.tokens, out.parents, n) == (expected_tokens, expected_parents, added)
    assert out.tokens[:len(tree)] == tree.tokens and out.parents[:len(tree)] == tree.parents  # indices stable
    validate(out, vocab_size=100, max_nodes=max_nodes, max_depth=max_depth)  # a valid tree, within limits
