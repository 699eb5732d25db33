"""Acceptance maths on made-up logits: greedy table cases and a seeded distribution test for sampling."""
import numpy as np
import pytest
from scipy import stats

from cloud.acceptance import Acceptance, Sampling, accept, accept_greedy, warp
from cloud.tree import DraftTree

V = 8


def rows(*argmaxes):
    """One logits row per entry, peaked at that token (gap 5 to the runner-up)."""
    out = np.zeros((len(argmaxes), V), dtype=np.float32)
    for r, t in enumerate(argmaxes):
        out[r, t] = 5.0
    return out


# tree used by several cases:   root ─ 0:a=3 ─ 2:c=1 ─ 4:e=6
#                                    └ 1:b=4 ─ 3:d=2
TREE = DraftTree(tokens=(3, 4, 1, 2, 6), parents=(-1, -1, 0, 1, 2))

GREEDY_CASES = [
    # name, tree, argmax per row (root, node0, node1, ...), expected accepted, expected bonus
    ("perfect chain", DraftTree.chain([5, 6, 7]), (5, 6, 7, 1), (0, 1, 2), 1),
    ("first token mismatch", DraftTree.chain([5, 6, 7]), (2, 6, 7, 1), (), 2),
    ("mid chain mismatch", DraftTree.chain([5, 6, 7]), (5, 0, 7, 1), (0,), 0),
    ("leaf reached on first branch", TREE, (3, 1, 0, 6, 0, 7), (0, 2, 4), 7),
    ("second sibling accepted", TREE, (4, 0, 2, 0, 0, 0), (1, 3), 0),
    ("mid tree mismatch", TREE, (3, 5, 0, 0, 0, 0), (0,), 5),
    ("empty tree is one plain step", DraftTree(), (6,), (), 6),
]


@pytest.mark.parametrize("name,tree,argmaxes,accepted,bonus", GREEDY_CASES, ids=[c[0] for c in GREEDY_CASES])
def test_greedy_table(name, tree, argmaxes, accepted, bonus):
    got = accept_greedy(tree, rows(*argmaxes))
    assert got == Acceptance(accepted, bonus)
    # tau = accepted + 1: the committed tokens are exactly the argmax chain
    committed = got.committed_tokens(tree)
    assert len(committed) == len(accepted) + 1


def test_greedy_ignores_sibling_order():
    """At temperature 0 the argmax child is taken wherever it stands among its siblings."""
    a = DraftTree(tokens=(3, 4), parents=(-1, -1))
    b = DraftTree(tokens=(4, 3), parents=(-1, -1))
    logits = rows(4, 0, 0)
    assert accept_greedy(a, logits).committed_tokens(a) == accept_greedy(b, logits).committed_tokens(b) == [4, 0]


def test_warp_top_k_top_p():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert np.allclose(warp(logits, Sampling(temperature=1.0)), [0.5, 0.2, 0.15, 0.1, 0.05])
    assert np.allclose(warp(logits, Sampling(temperature=1.0, top_k=2)), [5 / 7, 2 / 7, 0, 0, 0])
    # top-p 0.8: smallest prefix reaching 0.8 is {0.5, 0.2, 0.15} (0.85)
    assert np.allclose(warp(logits, Sampling(temperature=1.0, top_p=0.8)), np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    hot = warp(logits, Sampling(temperature=2.0))
    assert np.allclose(hot, np.sqrt([0.5, 0.2, 0.15, 0.1, 0.05]) / np.sqrt([0.5, 0.2, 0.15, 0.1, 0.05]).sum())


def _empirical(tree, logits, sampling, trials, seed, n_tokens):
    rng = np.random.default_rng(seed)
    counts = {}
    for _ in range(trials):
        toks = tuple(accept(tree, logits, sampling, rng).committed_tokens(tree)[:n_tokens])
        if len(toks) == n_tokens:
            counts[toks] = counts.get(toks, 0) + 1
    return counts


def _chi2_pvalue(counts, expected_probs, trials):
    keys = sorted(expected_probs)
    assert set(counts) <= set(keys), f"sampled outside support: {set(counts) - set(keys)}"
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    exp = np.array([expected_probs[k] for k in keys]) * obs.sum()
    return stats.chisquare(obs, exp).pvalue


def test_sampling_first_token_distribution_equals_target():
    """Root children drafted in an order unrelated to p: the committed token is still distributed as p."""
    p = np.array([0.05, 0.3, 0.02, 0.25, 0.1, 0.08, 0.15, 0.05])
    logits = np.tile(np.log(p), (4, 1))
    tree = DraftTree(tokens=(2, 3, 6), parents=(-1, -1, -1))  # first child unlikely, then likely ones
    trials = 30000
    counts = _empirical(tree, logits, Sampling(temperature=1.0), trials, seed=1234, n_tokens=1)
    emp = np.array([counts.get((t,), 0) for t in range(V)]) / trials
    assert 0.5 * np.abs(emp - p).sum() < 0.015  # total variation
    assert _chi2_pvalue(counts, {(t,): p[t] for t in range(V)}, trials) > 1e-3


def test_sampling_two_token_joint_distribution_equals_target():
    """Depth-2 tree with warping: the first two committed tokens follow p(x1) * p(x2 | x1) of the target."""
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(6, V)) * 1.5
    tree = DraftTree(tokens=(1, 4, 0, 5, 2), parents=(-1, -1, 0, 0, 1))
    sampling = Sampling(temperature=0.8, top_k=6, top_p=0.95)
    p_root = warp(logits[0], sampling)
    # row of the position after token x1: a drafted node's row if x1 is a root child, else no row is needed
    # because then x1 was the bonus and only one token is committed. So the joint is only over drafted x1.
    joint = {}
    for node, x1 in ((0, 1), (1, 4)):
        p2 = warp(logits[node + 1], sampling)
        for x2 in range(V):
            if p_root[x1] * p2[x2] > 0:
                joint[(x1, x2)] = p_root[x1] * p2[x2]
    total = sum(joint.values())
    joint = {k: v / total for k, v in joint.items()}
    counts = _empirical(tree, logits, sampling, 40000, seed=99, n_tokens=2)
    assert _chi2_pvalue(counts, joint, sum(counts.values())) > 1e-3
    # and the marginal share of rounds that accept a root child equals p(1) + p(4)
    accepted_share = sum(counts.values()) / 40000
    assert abs(accepted_share - (p_root[1] + p_root[4])) < 0.015


def test_sampling_point_mass_is_always_accepted():
    logits = np.full((3, V), -1e9)
    logits[:, 5] = 0.0
    tree = DraftTree.chain([5, 5])
    rng = np.random.default_rng(0)
    for _ in range(50):
        assert accept(tree, logits, Sampling(temperature=1.0), rng) == Acceptance((0, 1), 5)


def test_sampling_is_reproducible_with_seed():
    logits = np.random.default_rng(3).normal(size=(4, V))
    tree = DraftTree.chain([1, 2, 3])
    a = [accept(tree, logits, Sampling(temperature=1.0), np.random.default_rng(11)) for _ in range(3)]
    assert a[0] == a[1] == a[2]
