"""The lossless check itself (cloud/reference.py: classify) on made-up references: a divergence is excused only where
the reference's logit of the emitted token is within batch-shape noise of its best, every divergence after the first
is checked against the reference resumed from the output's own tokens, there may be no more near-ties than the
measured noise explains, and a failure says what it saw; a sampled output (classify_sampled) may diverge only where
the position's draw sits at an edge of the token's CDF interval, to the token across that edge."""
import numpy as np
import pytest

from tandem.cloud.reference import Noise, Reference, classify, classify_sampled, near_ties_explained

NOISE = 0.1


def ref(tokens, tops, resume=None):
    """A greedy reference whose position i has the (token, logit) pairs ``tops[i]``, best first."""
    gaps = [t[0][1] - t[1][1] for t in tops]
    return Reference(list(tokens), gaps, 0.0, top=[tuple(t) for t in tops], resume=resume)


TIGHT = ((5, 10.0), (6, 9.95), (7, 2.0))  # 5 and 6 within noise; 7 far below


def test_exact_and_a_true_near_tie():
    r = ref([5, 5], [TIGHT, TIGHT])
    assert tuple(classify([5, 5], r, NOISE)) == ("exact", None)
    c = classify([6], ref([5], [TIGHT]), NOISE)
    assert (c.kind, c.at, c.near_ties) == ("near_tie", 0, (0,)) and c.ok


def test_a_small_top2_gap_does_not_excuse_a_token_far_below_the_best():
    """The reference's best two are a near-tie, but the output emitted a third token 8 logits down: a bug. (The old
    rule looked at the top-2 gap only and called it a near-tie.)"""
    c = classify([7], ref([5], [TIGHT]), NOISE)
    assert c.kind == "other" and c.at == 0 and not c.ok
    assert "emitted 7" in c.detail and "reference 5" in c.detail and "8.0000 below" in c.detail and "0.1" in c.detail
    c = classify([42], ref([5], [TIGHT]), NOISE)  # not even among the reference's best
    assert c.kind == "other" and "not among" in c.detail


def test_divergences_after_a_near_tie_are_checked_against_the_resumed_reference():
    resumed = []

    def resume(prefix):
        resumed.append(list(prefix))
        return ref([8, 9], [((8, 5.0), (1, 1.0)), ((9, 5.0), (3, 1.0))])  # the target's own path after "6"

    r = ref([5, 5, 5], [TIGHT] * 3, resume)
    assert tuple(classify([6, 8, 9], r, NOISE)) == ("near_tie", 0)
    assert resumed == [[6]]
    c = classify([6, 8, 3], r, NOISE)  # after the near-tie the output left the target's path: a bug
    assert (c.kind, c.at) == ("other", 2) and "emitted 3, reference 9" in c.detail
    c = classify([6, 8], r, NOISE)  # the output stopped early
    assert (c.kind, c.at) == ("other", 2) and "lengths differ" in c.detail


def test_an_output_that_ends_on_a_near_tie_end_of_generation_ends_the_comparison():
    """The target's best and its end-of-generation token (2) within noise: an output that took the end token ended
    there, and must end there; resuming the reference past it would compare text no target decodes."""
    def resume(prefix):
        raise AssertionError(f"resumed after an end-of-generation token: {prefix}")

    eog_tie = ((5, 10.0), (2, 9.95), (7, 2.0))
    r = Reference([5, 5, 5], [0.05] * 3, 0.0, top=[TIGHT, eog_tie, TIGHT], resume=resume, is_eog=lambda t: t == 2)
    c = classify([5, 2], r, NOISE)
    assert (c.kind, c.at, c.near_ties) == ("near_tie", 1, (1,)) and "ended on it" in c.detail
    c = classify([5, 2, 5], r, NOISE)  # a token after the end: a bug
    assert (c.kind, c.at) == ("other", 2) and "after the output's end-of-generation token 2" in c.detail
    # without the engine's end test (a hand-made reference) the old rule holds: the resumed reference judges
    r = Reference([5, 5], [0.05] * 2, 0.0, top=[TIGHT, eog_tie], resume=lambda p: Reference([], [], 0.0))
    assert classify([5, 2], r, NOISE).kind == "near_tie"


def test_a_longer_reference_cut_to_n_tokens_judges_as_one_decoded_for_n():
    def resume(prefix):
        return ref([8, 9, 9], [((8, 5.0), (1, 1.0)), ((9, 5.0), (3, 1.0)), ((9, 5.0), (3, 1.0))])

    long = ref([5, 5, 5, 5], [TIGHT] * 4, resume)
    short = long.head(2)
    assert (short.tokens, short.top2_gap, short.top) == ([5, 5], long.top2_gap[:2], long.top[:2])
    assert long.head(4) is long and long.tokens == [5, 5, 5, 5]
    assert classify([5, 5], short, NOISE).kind == "exact"
    assert classify([5, 5, 5], short, NOISE).kind == "other"  # longer than 2 tokens
    assert short.resume([6]).tokens == [8]  # the resumed reference ends where the cut one does
    assert tuple(classify([6, 8], short, NOISE)) == ("near_tie", 0)


def test_a_reference_without_rows_excuses_nothing():
    """Its top-2 gap says the best two are close, not that the emitted token is one of them."""
    c = classify([6], Reference([5], [0.05], 0.0), NOISE)
    assert c.kind == "other" and "kept no row" in c.detail
    assert classify([5], Reference([5], [0.05], 0.0), NOISE).kind == "exact"


@pytest.mark.parametrize("expected, most", [(0.0, 0), (1e-5, 0), (0.01, 1), (0.1, 3), (1.0, 6), (5.0, 15)])
def test_near_ties_explained_is_the_poisson_tail_bound(expected, most):
    assert near_ties_explained(expected) == most


def test_measured_swaps_set_how_often_a_gap_is_overturned():
    swaps = np.r_[np.zeros(880), np.full(100, 0.1), np.full(10, 0.2), np.full(10, 0.28)]  # 1000: 12 % > 0.05
    noise = Noise(0.3, swaps[::-1])
    assert float(noise) == 0.3 and noise.swaps.tolist() == sorted(noise.swaps.tolist())
    assert noise.swap_probability(0.05) == pytest.approx(0.12)  # the bulk: as measured
    q90, q99 = np.quantile(swaps, (0.9, 0.99))
    tail = lambda g: 0.1 * np.exp(-(g - q90) * np.log(10) / (q99 - q90))  # noqa: E731
    assert noise.swap_probability(0.4) == pytest.approx(tail(0.4)) and tail(0.4) > 0  # past every sample: fitted
    assert noise.swap_probability(0.25) == pytest.approx(max(0.01, tail(0.25)))
    # a plain bound: each logit uniform within +-noise, so a gap of 2 * noise or more is never overturned
    assert Noise(0.1).swap_probability(0.2) == 0.0 and Noise(0.1).swap_probability(0.0) == pytest.approx(0.5)


def test_more_near_ties_than_noise_explains_is_a_bug():
    """A lenient acceptor that takes the drafter's runner-up whenever it is within the window: each divergence
    alone is a near-tie, their number is not. Measured swaps that rarely reach the gaps allow one."""
    rare = Noise(NOISE, np.r_[np.zeros(9999), [0.06]])  # one swap in 10,000 reaches a gap of 0.05 (no tail)
    tokens = [5] * 40

    def at(start):  # the reference from position ``start`` on; its resume continues from there
        return ref(tokens[start:], [TIGHT] * (40 - start), lambda prefix: at(start + len(prefix)))

    r = at(0)
    one = [5] * 10 + [6] + [5] * 29
    assert classify(one, r, rare).kind == "near_tie"
    many = [6 if i % 10 == 3 else 5 for i in range(40)]  # four runners-up in 40 tokens
    c = classify(many, r, rare)
    assert c.kind == "other" and c.at == 13 and "near-ties at [3, 13]" in c.detail and "at most 1" in c.detail
    # where noise often overturns such gaps, the same output is explained
    assert classify(many, r, Noise(NOISE, [0.06] * 10)).kind == "near_tie"


def test_a_real_divergence_says_which_side_a_fresh_decode_agrees_with():
    r = ref([5], [TIGHT], resume=lambda prefix: ref([5], [TIGHT]))
    c = classify([7], r, NOISE)
    assert c.kind == "other" and "gives 5, the reference's token again: the verifier's row differed" in c.detail
    r = ref([5], [TIGHT], resume=lambda prefix: ref([7], [((7, 9.0), (5, 1.0))]))
    assert "gives 7, the output's token: the reference's row was wrong" in classify([7], r, NOISE).detail


def sampled(tokens, margins, neighbours, resume=None):
    return Reference(list(tokens), [1.0] * len(tokens), 0.0, cdf_margin=list(margins),
                     cdf_neighbour=list(neighbours), resume=resume)


@pytest.mark.parametrize("spec, margins, kind, at", [
    ([5, 6, 7], [0.3, 0.3, 0.3], "exact", None),
    ([5, 9, 7], [0.3, 0.01, 0.3], "near_tie", 1),  # the draw sat 0.01 from the edge to 9: noise can move it there
    ([5, 8, 7], [0.3, 0.01, 0.3], "other", 1),  # ... but only to 9, the token across that edge
    ([5, 9, 7], [0.3, 0.2, 0.3], "other", 1),  # far from every edge: a real divergence
    ([5, 6], [0.3, 0.3, 0.3], "other", 2),  # shorter than the reference
])
def test_a_sampled_output_diverges_only_where_the_draw_sits_at_a_cdf_edge(spec, margins, kind, at):
    got = classify_sampled(spec, sampled([5, 6, 7], margins, [4, 9, 8], resume=lambda p: sampled([7], [0.3], [1])))
    assert (got.kind, got.at) == (kind, at), str(got)


def test_a_sampled_output_is_checked_past_each_near_tie():
    resumed = []

    def resume(prefix):
        resumed.append(list(prefix))
        return sampled([11, 12], [0.3, 0.3], [1, 1])  # the target's own draws after "9"

    r = sampled([5, 6, 7], [0.3, 0.01, 0.3], [4, 9, 8], resume)
    assert tuple(classify_sampled([5, 9, 11, 12], r)) == ("near_tie", 1) and resumed == [[5, 9]]
    c = classify_sampled([5, 9, 11, 3], r)  # a wrong token after the near-tie: a bug, not the end of the check
    assert (c.kind, c.at) == ("other", 3) and "emitted 3, reference 12" in c.detail
