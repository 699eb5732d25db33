"""Tree structure, validation, and dynamic tree building on made-up drafter distributions."""
import math

import pytest

from tandem.core.tree import DraftTree, TreeError, TreeShape, subtree, validate, walk
from tandem.edge.drafting import build_tree

#   root ─ 0 ─ 2 ─ 4
#        │   └ 3
#        └ 1
T = DraftTree(tokens=(10, 11, 12, 13, 14), parents=(-1, -1, 0, 0, 2))


def test_structure():
    assert T.depths == (1, 1, 2, 2, 3)
    assert T.depth == 3
    assert T.children == ((0, 1), (2, 3), (), (4,), (), ())
    assert T.leaves == (1, 3, 4)
    # leaf branches: b0 = node 1, b1 = node 3, b2 = node 4
    assert T.leaf_sets == ((1, 2), (0,), (2,), (1,), (2,))
    assert T.path_to(4) == [0, 2, 4] and T.path_to(-1) == []
    assert DraftTree.chain([5, 6]).parents == (-1, 0)


def test_leaf_sets_select_exactly_the_ancestors():
    """Any seq id of a node is shared by exactly its ancestors (what llama.cpp's first-seq-id mask relies on)."""
    for i in range(len(T)):
        for b in T.leaf_sets[i]:
            visible = {j for j in range(len(T)) if b in T.leaf_sets[j] and T.depths[j] <= T.depths[i]}
            assert visible == set(T.path_to(i))


VALIDATION_CASES = [
    ("length mismatch", DraftTree((1, 2), (-1,)), "equal length"),
    ("parent out of range", DraftTree((1, 2), (-1, 5)), "parent 5"),
    ("parent below -1", DraftTree((1,), (-2,)), "parent -2"),
    ("not topological", DraftTree((1, 2), (1, -1)), "topological"),
    ("self parent", DraftTree((1,), (0,)), "topological"),
    ("token out of vocab", DraftTree((1, 100), (-1, 0)), "token id 100"),
    ("negative token", DraftTree((-3,), (-1,)), "token id -3"),
    ("duplicate siblings", DraftTree((7, 7), (-1, -1)), "distinct"),
    ("too many nodes", DraftTree.chain(list(range(9))), "negotiated limit of 8"),
    ("too deep", DraftTree.chain(list(range(5))), "depth 5"),
]


@pytest.mark.parametrize("name,tree,message", VALIDATION_CASES, ids=[c[0] for c in VALIDATION_CASES])
def test_validation_rejects(name, tree, message):
    max_depth = 4 if name == "too deep" else 16
    with pytest.raises(TreeError, match=message):
        validate(tree, vocab_size=100, max_nodes=8, max_depth=max_depth)


def test_validation_accepts_good_trees():
    validate(T, vocab_size=100, max_nodes=5, max_depth=3)
    validate(DraftTree(), vocab_size=100, max_nodes=5, max_depth=3)
    validate(DraftTree((7, 7), (-1, 0)), vocab_size=100, max_nodes=5, max_depth=3)  # same token, not siblings


def fake_drafter(children_of):
    """expand() over a table: children_of[(path tokens)] -> [(token, prob)]; records what was evaluated."""
    calls = []

    def path(i, tokens, parents):
        p = []
        while i >= 0:
            p.append(tokens[i])
            i = parents[i]
        return tuple(p[::-1])

    def expand(idx, tokens, parents):
        calls.append([path(i, tokens, parents) for i in idx])
        return [[(t, math.log(q)) for t, q in children_of.get(path(i, tokens, parents), [])] for i in idx]

    return expand, calls


TABLE = {
    (): [(1, 0.6), (2, 0.3), (3, 0.1)],
    (1,): [(4, 0.9), (5, 0.1)],
    (2,): [(6, 0.5), (7, 0.5)],
    (1, 4): [(8, 0.95), (9, 0.05)],
    (2, 6): [(10, 1.0)],
    (1, 4, 8): [(11, 1.0)],
}


def test_chain_is_k1():
    expand, calls = fake_drafter(TABLE)
    built = build_tree([(1, math.log(0.6))], expand, TreeShape(k=1, n=8, d=3))
    assert built.tree.tokens == (1, 4, 8) and built.tree.parents == (-1, 0, 1)
    assert calls == [[(1,)], [(1, 4)]]  # one evaluated node per level, d - 1 levels


def test_tree_keeps_best_n_by_path_probability():
    expand, calls = fake_drafter(TABLE)
    root = [(t, math.log(q)) for t, q in TABLE[()]]
    built = build_tree(root, expand, TreeShape(k=2, n=5, d=3))
    # candidates by path prob: 1:.6, 4:.54, 8:.513, 2:.3, 6:.15, 7:.15, 5:.06, 9:.027 -> best 5 = 1,4,8,2 + 6 (tie
    # with 7 broken by creation order)
    got = {built.tree.tokens[i]: round(math.exp(lp), 3) for i, lp in enumerate(built.logp)}
    assert got == {1: 0.6, 2: 0.3, 4: 0.54, 6: 0.15, 8: 0.513}
    validate(built.tree, vocab_size=20, max_nodes=5, max_depth=3)
    # siblings stay in the drafter's preference order: 1 before 2 under the root
    assert built.tree.children[0] == (0, 1) and built.tree.tokens[:2] == (1, 2)
    # level 2 evaluated the two best frontier nodes; level 3 only nodes still inside the best 5
    assert calls[0] == [(1,), (2,)]
    assert calls[1] == [(1, 4), (2, 6)]


def test_depth_limit_and_dead_ends():
    expand, calls = fake_drafter({(): [(1, 1.0)]})
    built = build_tree([(1, 0.0)], expand, TreeShape(k=3, n=10, d=4))
    assert built.tree.tokens == (1,)  # the drafter proposed no children for (1,)
    assert calls == [[(1,)]]
    assert TreeShape.parse("4,16,6") == TreeShape(4, 16, 6)
    with pytest.raises(ValueError):
        TreeShape.parse("4,16")


def test_first_choice_path_and_subtree():
    from tandem.edge.drafting import first_choice_path
    #   root ─ 0 ─ 2 ─ 4
    #        │   └ 3
    #        └ 1
    assert first_choice_path(T) == [0, 2, 4]
    assert first_choice_path(DraftTree()) == []
    sub, old = subtree(T, 0)  # node 0 becomes the root: its children 2 (-> 4) and 3
    assert old == (2, 3, 4) and sub.tokens == (12, 13, 14) and sub.parents == (-1, -1, 0)
    validate(sub, vocab_size=100, max_nodes=5, max_depth=3)
    assert subtree(T, 1) == (DraftTree(), ())


@pytest.mark.parametrize("tokens, node", [
    ((), -1),  # nothing committed since the draft: the whole tree
    ((3,), 0), ((3, 1), 2), ((3, 1, 6), 4), ((4, 2), 3),  # rebased along either branch
    ((5,), None), ((3, 2), None), ((3, 1, 6, 9), None),  # left the tree, or ran past a leaf
])
def test_walk_rebases_onto_committed_tokens(tokens, node):
    # root ─ 0:3 ─ 2:1 ─ 4:6
    #      └ 1:4 ─ 3:2
    t = DraftTree(tokens=(3, 4, 1, 2, 6), parents=(-1, -1, 0, 1, 2))
    assert walk(t, tokens) == node
    if node is not None:
        sub, old = subtree(t, node)
        assert all(t.parents[old[i]] == (node if p < 0 else old[p]) for i, p in enumerate(sub.parents))
        assert len(sub) == sum(1 for i in range(len(t)) if node in t.path_to(i)[:-1] or node == -1)
