"""Acceptance maths on made-up logits: greedy table cases, position-keyed draws, and distribution tests of the
sampled rule (one function here; the whole stack in tests/test_distribution.py)."""
import numpy as np
import pytest
from scipy import stats

from tandem.cloud.acceptance import Acceptance, accept
from tandem.core.sampling import Draws, Sampling, SamplingError, inverse_cdf, target_token, warp
from tandem.core.tree import DraftTree

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
    got = accept(tree, rows(*argmaxes), Sampling())
    assert got == Acceptance(accepted, bonus)
    # tau = accepted + 1: the committed tokens are exactly the argmax chain
    committed = got.committed_tokens(tree)
    assert len(committed) == len(accepted) + 1


def test_greedy_ignores_sibling_order():
    """At temperature 0 the argmax child is taken wherever it stands among its siblings."""
    a = DraftTree(tokens=(3, 4), parents=(-1, -1))
    b = DraftTree(tokens=(4, 3), parents=(-1, -1))
    logits = rows(4, 0, 0)
    assert accept(a, logits, Sampling()).committed_tokens(a) == accept(b, logits, Sampling()).committed_tokens(b) \
        == [4, 0]


def test_warp_top_k_top_p():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert np.allclose(warp(logits, Sampling(temperature=1.0)), [0.5, 0.2, 0.15, 0.1, 0.05])
    assert np.allclose(warp(logits, Sampling(temperature=1.0, top_k=2)), [5 / 7, 2 / 7, 0, 0, 0])
    # top-p 0.8: smallest prefix reaching 0.8 is {0.5, 0.2, 0.15} (0.85)
    assert np.allclose(warp(logits, Sampling(temperature=1.0, top_p=0.8)), np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    # min-p 0.3: keep p >= 0.3 * 0.5 = 0.15 -> {0.5, 0.2, 0.15}; after top-k 2 only the top two are left anyway
    assert np.allclose(warp(logits, Sampling(temperature=1.0, min_p=0.3)), np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    assert np.allclose(warp(logits, Sampling(temperature=1.0, top_k=2, min_p=0.3)), [5 / 7, 2 / 7, 0, 0, 0])
    assert np.allclose(warp(logits, Sampling(temperature=1.0, min_p=1.0)), [1, 0, 0, 0, 0])  # the top token stays
    hot = warp(logits, Sampling(temperature=2.0))
    assert np.allclose(hot, np.sqrt([0.5, 0.2, 0.15, 0.1, 0.05]) / np.sqrt([0.5, 0.2, 0.15, 0.1, 0.05]).sum())


@pytest.mark.parametrize("p, u, token", [
    ([0.5, 0.5], 0.0, 0), ([0.5, 0.5], 0.4999, 0), ([0.5, 0.5], 0.5, 1), ([0.5, 0.5], 0.9999, 1),
    ([0.0, 0.3, 0.0, 0.7], 0.0, 1),  # zero-probability tokens own empty intervals
    ([0.0, 0.3, 0.0, 0.7], 0.3, 3), ([0.2, 0.0, 0.0], 0.9999, 0),
])
def test_inverse_cdf_table(p, u, token):
    assert inverse_cdf(np.array(p), u) == token


@pytest.mark.parametrize("bad, field", [
    (Sampling(temperature=float("nan")), "temperature"), (Sampling(temperature=float("inf")), "temperature"),
    (Sampling(temperature=-0.5), "temperature"), (Sampling(1.0, top_p=float("nan")), "top_p"),
    (Sampling(1.0, top_p=1.5), "top_p"), (Sampling(1.0, top_k=-1), "top_k"), (Sampling(seed=-1), "seed"),
    (Sampling(seed=1 << 64), "seed"), (Sampling(1.0, min_p=-0.1), "min_p"), (Sampling(1.0, min_p=1.5), "min_p"),
    (Sampling(1.0, min_p=float("nan")), "min_p"),
])
def test_sampling_values_that_cannot_be_honoured(bad, field):
    with pytest.raises(SamplingError, match=field):
        bad.check()
    assert Sampling(0.7, top_p=0.0).check().top_p == 1.0  # the wire's unset top_p means "off"


def test_draws_are_keyed_by_seed_and_position():
    a, b, c = Draws.pinned(7), Draws.pinned(7), Draws.pinned(8)
    us = [a.uniform(t) for t in range(1000)]
    assert us == [b.uniform(t) for t in range(1000)]  # a pinned seed reproduces
    assert us != [c.uniform(t) for t in range(1000)]
    assert len(set(us)) == 1000 and all(0.0 <= u < 1.0 for u in us)
    assert stats.kstest(us, "uniform").pvalue > 1e-3
    # consecutive positions are uncorrelated (a stream restart would make u_t and u_{t+k} equal)
    assert abs(np.corrcoef(us[:-1], us[1:])[0, 1]) < 0.1
    assert Draws.fresh().uniform(5) != Draws.fresh().uniform(5)


def _joint(tree, logits, sampling, trials, n_tokens, seed):
    """Counts of the first ``n_tokens`` committed tokens over ``trials`` sessions with independent draws."""
    counts: dict = {}
    for i in range(trials):
        draws = Draws.pinned(seed * 1_000_003 + i)
        acc = accept(tree, logits, sampling, lambda d, draws=draws: draws.uniform(100 + d))
        toks = tuple(acc.committed_tokens(tree)[:n_tokens])
        if len(toks) == n_tokens:
            counts[toks] = counts.get(toks, 0) + 1
    return counts


def _chi2_pvalue(counts, expected_probs):
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
    trials = 20000
    counts = _joint(tree, logits, Sampling(temperature=1.0), trials, 1, seed=1234)
    emp = np.array([counts.get((t,), 0) for t in range(V)]) / trials
    assert 0.5 * np.abs(emp - p).sum() < 0.015  # total variation
    assert _chi2_pvalue(counts, {(t,): p[t] for t in range(V)}) > 1e-3


def test_sampling_two_token_joint_distribution_equals_target():
    """Depth-2 tree with warping: the first two committed tokens follow p(x1) * p(x2 | x1) of the target, and a
    root child is accepted exactly as often as the point-mass multi-draft rule would: p(1) + p(4)."""
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(6, V)) * 1.5
    tree = DraftTree(tokens=(1, 4, 0, 5, 2), parents=(-1, -1, 0, 0, 1))
    sampling = Sampling(temperature=0.8, top_k=6, top_p=0.95)
    p_root = warp(logits[0], sampling)
    joint = {}  # only drafted x1 give a second token in the same forward
    for node, x1 in ((0, 1), (1, 4)):
        p2 = warp(logits[node + 1], sampling)
        for x2 in range(V):
            if p_root[x1] * p2[x2] > 0:
                joint[(x1, x2)] = p_root[x1] * p2[x2]
    total = sum(joint.values())
    counts = _joint(tree, logits, sampling, 30000, 2, seed=99)
    assert _chi2_pvalue(counts, {k: v / total for k, v in joint.items()}) > 1e-3
    assert abs(sum(counts.values()) / 30000 - (p_root[1] + p_root[4])) < 0.015


def test_the_committed_token_does_not_depend_on_the_tree():
    """With the same draws, any tree commits the target's own token at each position (that is what makes trees
    drafted from earlier output, shared caches or guesses harmless): only how many tokens one forward settles
    changes."""
    rng = np.random.default_rng(5)
    logits = np.tile(rng.normal(size=V) * 2, (8, 1))  # the same distribution at every position
    s = Sampling(temperature=1.0)
    draws = Draws.pinned(42)
    own = [target_token(logits[0], s, draws.uniform(10 + d)) for d in range(5)]
    for tree in (DraftTree(), DraftTree.chain(own[:3]), DraftTree.chain([own[0], (own[1] + 1) % V]),
                 DraftTree(tokens=((own[0] + 3) % V, own[0]), parents=(-1, -1))):
        got = accept(tree, logits, s, lambda d: draws.uniform(10 + d)).committed_tokens(tree)
        assert got == own[:len(got)]


def test_point_mass_is_always_accepted():
    logits = np.full((3, V), -1e9)
    logits[:, 5] = 0.0
    tree = DraftTree.chain([5, 5])
    for i in range(50):
        draws = Draws.pinned(i)
        uniform = draws.uniform
        assert accept(tree, logits, Sampling(temperature=1.0), uniform) == Acceptance((0, 1), 5)
