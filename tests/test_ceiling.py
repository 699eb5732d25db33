"""The oracle of bench.ceiling: acceptance runs, the schedule programme against brute force, the hull floor, and
chain matching against a scripted drafter."""
import json
import math
from functools import lru_cache

import pytest
from hypothesis import given, settings, strategies as st

from bench.ceiling import (LAMBDAS, Costs, dual_floor, accept_runs, calibration, ceilings, chain_runs, cut_ceilings,
                           cut_lengths, cut_schedule, measured_ratios, oracle, paced_on, replay_chain)
from tandem.core.tree import DraftTree
from tandem.edge.drafting import BuiltTree


def flat(ms):
    return lambda n: ms


def cpu_like(n):  # verifying more tokens costs more, as on a CPU core
    return 100.0 + 40.0 * (n - 1)


@pytest.mark.parametrize("agree, runs", [
    ([], []),
    ([True], [1]),
    ([False], [0]),
    ([True, True, False, True], [2, 1, 0, 1]),
    ([False, True, True, True], [0, 3, 2, 1]),
])
def test_accept_runs(agree, runs):
    assert accept_runs(agree) == runs


@pytest.mark.parametrize("runs, costs, family, lam, want", [
    # worked by hand: a depth-2 chain at 0 commits 3 (12 ms), then one cloud-only token (10 ms)
    ([2, 1, 0, 0], Costs(flat(10.0), [0, 1, 2, 3], 0.0), "lockstep", 0.0, (22.0, 20.0, 1, {2: 1})),
    # nothing agrees: every chain commits one token at more than a cloud-only step costs
    ([0, 0, 0], Costs(cpu_like, [0, 30, 60], 20.0), "lockstep", 0.0, (300.0, 300.0, 3, {})),
    # everything agrees, flat verify, drafting free: one depth-3 round per 4 tokens
    ([8, 7, 6, 5, 4, 3, 2, 1], Costs(flat(10.0), [0, 0, 0, 0], 0.0), "overlapped", 0.0, (20.0, 20.0, 0, {3: 2})),
    # the round trip makes lock-step chains lose where overlapped ones win
    ([1, 0, 1, 0], Costs(flat(10.0), [0, 5], 30.0), "lockstep", 0.0, (40.0, 40.0, 4, {})),
    ([1, 0, 1, 0], Costs(flat(10.0), [0, 5], 30.0), "overlapped", 0.0, (20.0, 20.0, 0, {1: 2})),
    # a high price on verifier time buys fewer forwards with more wall time
    ([1, 0, 1, 0], Costs(flat(10.0), [0, 50], 0.0), "lockstep", 0.0, (40.0, 40.0, 4, {})),
    ([1, 0, 1, 0], Costs(flat(10.0), [0, 50], 0.0), "lockstep", 10.0, (120.0, 20.0, 0, {1: 2})),
    # proactive: every round here accepts its chain and the drafter's next token (run > 1), so after the first the
    # next chain is drafted during the flight: max(8, 0 + 10) = 10 a round instead of 8 + 10
    ([6, 5, 4, 3, 2, 1], Costs(flat(10.0), [0, 8], 0.0), "proactive", 0.0, (38.0, 30.0, 0, {1: 3})),
    ([6, 5, 4, 3, 2, 1], Costs(flat(10.0), [0, 8], 0.0), "lockstep", 0.0, (54.0, 30.0, 0, {1: 3})),
    # ... and where the first round's guess fails (run 1 = its depth), the second is drafted after its verdict
    ([1, 0, 3, 2, 1, 0], Costs(flat(10.0), [0, 8], 0.0), "proactive", 0.0, (46.0, 30.0, 0, {1: 3})),
])
def test_oracle_table(runs, costs, family, lam, want):
    p = oracle(runs, costs, family, lam, max_depth=len(costs.draft_ms) - 1)
    assert (p.time_ms, p.verifier_ms, p.plain_tokens, p.rounds) == pytest.approx(want)
    assert p.tokens == len(runs)


def brute(runs, costs, family, lam, depths, plain):
    """Every schedule, by recursion: the programme must find the same optimum."""
    n = len(runs)

    @lru_cache(None)
    def best(i, ready):
        if i >= n:
            return 0.0
        opts = [costs.verify_ms(1) * (1 + lam) + best(i + 1, False)] if plain else []
        for k in depths:
            if family == "proactive":
                t = costs.round_ms("lockstep", k)
                if ready:  # drafted during the last flight
                    t = max(costs.draft_ms[k], costs.rtt_ms + costs.verify_ms(k + 1))
                nxt = runs[i] > k
            else:
                t, nxt = costs.round_ms(family, k), False
            opts.append(t + lam * costs.verify_ms(k + 1) + best(i + min(min(runs[i], k) + 1, n - i), nxt))
        return min(opts)
    return best(0, False)


@settings(max_examples=150, deadline=None)
@given(agree=st.lists(st.booleans(), min_size=1, max_size=9), rtt=st.sampled_from([0.0, 20.0, 80.0]),
       d=st.floats(1, 60), slope=st.floats(0, 50), family=st.sampled_from(["lockstep", "proactive", "overlapped"]),
       lam=st.sampled_from([0.0, 0.3, 5.0]), plain=st.booleans())
def test_oracle_is_the_brute_force_optimum(agree, rtt, d, slope, family, lam, plain):
    runs = accept_runs(agree)
    costs = Costs(lambda n: 50.0 + slope * (n - 1), [0.0] + [d * k for k in range(1, 5)], rtt)
    p = oracle(runs, costs, family, lam, max_depth=4, plain=plain)
    assert p.time_ms + lam * p.verifier_ms == pytest.approx(brute(runs, costs, family, lam, range(1, 5), plain))
    if not plain:
        assert p.plain_tokens == 0


@pytest.mark.parametrize("sweep, limit, want", [
    # (lambda, T, V): at lambda 1 the optimum is T 10 + V 10 = 20, so T <= 15 needs V >= 10 + (10 - 15) / 1 = 5
    ([(0.0, 5.0, 30.0), (1.0, 10.0, 10.0)], 15.0, 5.0),
    ([(0.0, 5.0, 30.0), (1.0, 10.0, 10.0), (4.0, 20.0, 4.0)], 10.0, 10.0),  # lambda 4: 4 + 10 / 4 = 6.5 < 10
    ([(0.0, 5.0, 30.0)], 15.0, 0.0),  # no price of verifier time: no bound beyond 0
    ([(0.0, 5.0, 30.0), (1.0, 10.0, 10.0)], 4.0, None),  # nothing that fast
])
def test_dual_floor(sweep, limit, want):
    got = dual_floor(sweep, limit)
    assert got == (None if want is None else pytest.approx(want))


def schedules(runs, costs, depths):
    """(time, verifier time) of every lock-step schedule."""
    n = len(runs)

    @lru_cache(None)
    def from_(i):
        if i >= n:
            return frozenset({(0.0, 0.0)})
        out = {(t + costs.verify_ms(1), v + costs.verify_ms(1)) for t, v in from_(i + 1)}
        for k in depths:
            adv = min(min(runs[i], k) + 1, n - i)
            out |= {(t + costs.round_ms("lockstep", k), v + costs.verify_ms(k + 1)) for t, v in from_(i + adv)}
        return frozenset(out)
    return from_(0)


@settings(max_examples=80, deadline=None)
@given(agree=st.lists(st.booleans(), min_size=1, max_size=8), d=st.floats(1, 40), slope=st.floats(0, 60),
       rtt=st.sampled_from([0.0, 20.0]), share=st.floats(0.5, 1.2))
def test_no_schedule_beats_the_cost_floor(agree, d, slope, rtt, share):
    runs = accept_runs(agree)
    costs = Costs(lambda n: 50.0 + slope * (n - 1), [0.0] + [d * k for k in range(1, 4)], rtt)
    sweep = [(lam, p.time_ms, p.verifier_ms) for lam, p in
             ((lam, oracle(runs, costs, "lockstep", lam, max_depth=3)) for lam in LAMBDAS)]
    limit = share * len(runs) * 50.0
    floor = dual_floor(sweep, limit)
    feasible = [v for t, v in schedules(runs, costs, range(1, 4)) if t <= limit + 1e-9]
    if floor is None:
        assert not feasible or min(t for t, _ in schedules(runs, costs, range(1, 4))) > limit - 1e-6
    else:
        assert feasible and min(feasible) >= floor - 1e-6


@settings(max_examples=60, deadline=None)
@given(agree=st.lists(st.lists(st.booleans(), min_size=1, max_size=30), min_size=1, max_size=3),
       rtt=st.sampled_from([0.0, 20.0, 80.0]), d=st.floats(5, 60), slope=st.floats(0, 80))
def test_ceilings_bound_each_other(agree, rtt, d, slope):
    runs = [accept_runs(a) for a in agree]
    c = ceilings(runs, Costs(lambda n: 60.0 + slope * (n - 1), [0.0] + [d * k for k in range(1, 9)], rtt))
    lo, pro, ov = c["lockstep"], c["proactive"], c["overlapped"]
    # cloud-only decoding is one of the oracle's schedules; drafting during the flight, then hiding the round trip,
    # can only help; a fixed chain is one schedule among the oracle's
    assert 1.0 - 1e-3 <= lo["speed"] <= pro["speed"] + 1e-3 <= ov["speed"] + 2e-3
    for f in (lo, pro, ov):
        assert f["speed"] >= f["fixed_speed"] - 1e-3
    assert lo["cost_floor_at_1x"] is not None and lo["cost_floor_at_1x"] <= 1.0 + 1e-3
    assert ov["cost_floor_at_1x"] <= pro["cost_floor_at_1x"] + 1e-3 <= lo["cost_floor_at_1x"] + 2e-3


class ScriptedDrafter:
    """Drafts the true continuation, except a wrong token wherever ``wrong`` says (by absolute position)."""

    def __init__(self, prompt_len, truth, wrong):
        self.p, self.truth, self.wrong, self.history = prompt_len, truth, set(wrong), []

    def start(self, prompt):
        self.history = list(prompt)

    def draft(self, shape):
        i = len(self.history) - self.p
        toks = tuple(-1 if i + j in self.wrong else (self.truth[i + j] if i + j < len(self.truth) else 7)
                     for j in range(shape.d))
        return BuiltTree(DraftTree(toks, tuple(range(-1, shape.d - 1))), tuple(range(shape.d)), (0.0,) * shape.d)

    def commit(self, built, accepted, tokens):
        pass


def test_chain_runs_matches_prefixes_and_caps():
    truth = [10, 11, 12, 13, 14, 15]
    d = ScriptedDrafter(3, truth, wrong=[2])
    assert chain_runs(d, [1, 2, 3], truth, depth=3) == [2, 1, 0, 3, 2, 1]  # capped at 3, clipped at the end


def lps(*ps):
    """Path log-probabilities of a chain whose nodes have these path probabilities."""
    return [math.log(p) for p in ps]


@pytest.mark.parametrize("min_p, depth, want", [
    (0.0, 3, [3, 2, 3]),  # no cut: the depth (or the chain, where shorter)
    (0.5, 3, [2, 1, 3]),  # ends at the first node below 0.5, kept
    (0.95, 3, [1, 1, 3]),  # the first node always goes; a sure chain runs to its depth
    (0.5, 1, [1, 1, 1]),
])
def test_cut_lengths(min_p, depth, want):
    chains = [lps(0.9, 0.4, 0.3), lps(0.2, 0.1), lps(0.99, 0.98, 0.97, 0.2)]
    assert cut_lengths(chains, min_p, depth) == want


@pytest.mark.parametrize("runs, lengths, family, want", [
    # worked by hand, flat verify 10 ms, drafting 5 ms a token, no round trip: a chain of 2 at 0 commits 3 (20 ms),
    # a chain of 1 at 3 commits 1 (15 ms), then a chain of 2 at 4 commits the last 2 (clipped; 20 ms)
    ([3, 2, 1, 0, 5, 4], [2, 2, 2, 1, 2, 2], "lockstep", (55.0, 30.0)),
    # proactive: the first round held past its chain (3 > 2), so the next (a chain of 1) was drafted in flight:
    # max(5, 15 - 5) = 10; that one did not hold (0 = 1 - 1), so the third pays in full
    ([3, 2, 1, 0, 5, 4], [2, 2, 2, 1, 2, 2], "proactive", (50.0, 30.0)),
])
def test_cut_schedule(runs, lengths, family, want):
    costs = Costs(flat(10.0), [0, 5, 10], 0.0)
    assert cut_schedule(runs, lengths, costs, family) == pytest.approx(want)
    with pytest.raises(ValueError):
        cut_schedule(runs, lengths, costs, "overlapped")


def test_a_cut_where_the_drafter_knows_when_it_fails_wins():
    # runs of 4 and of none alternate; the drafter is sure of every token that holds and unsure of the first that
    # fails: cut at 0.5, each chain is what holds plus one, so on a CPU-like curve it is faster and cheaper than
    # any fixed depth (lock-step uncut never even reaches cloud-only speed here)
    runs = [4, 3, 2, 1, 0, 0] * 10
    chains = [lps(*[0.95 ** (j + 1) if j < run else 0.2 * 0.5 ** j for j in range(5)]) for run in runs]
    got = cut_ceilings([runs], [chains], Costs(cpu_like, [0, 20, 40, 60, 80], 0.0), max_depth=4)
    for family in ("lockstep", "proactive"):
        x = got[family]
        uncut, cut = x["fastest_by_min_p"][0], max(x["fastest_by_min_p"], key=lambda r: r["speed"])
        assert uncut["min_p"] == 0.0 and uncut["speed"] <= 1.0
        assert cut["k"] == 4 and (cut["speed"], cut["cost"]) == pytest.approx((1.2, 0.667), abs=1e-3)
        assert 0 < x["cheapest_at_1x"]["min_p"] and x["cheapest_at_1x"]["cost"] == pytest.approx(0.667, abs=1e-3)
    assert got["lockstep"]["cheapest_at_1x_no_cut"] is None
    assert got["proactive"]["cheapest_at_1x_no_cut"]["cost"] > 0.9  # a chain of 1, every round


def test_calibration_bins():
    runs = [[2, 0], [1]]
    chains = [[lps(0.95, 0.6), lps(0.15, 0.05)], [lps(0.95, 0.6)]]
    bins = {(b["p_from"], b["p_to"]): b for b in calibration(runs, chains)}
    assert bins[0.9, 1.0]["nodes"] == 2 and bins[0.9, 1.0]["accepted"] == 1.0
    assert bins[0.5, 0.7]["nodes"] == 2 and bins[0.5, 0.7]["accepted"] == 0.5  # held at [0], failed at [1]
    assert bins[0.1, 0.2]["accepted"] == 0.0 and bins[0.0, 0.1]["nodes"] == 1
    assert bins[0.2, 0.3]["nodes"] == 0 and bins[0.2, 0.3]["accepted"] is None


def test_measured_ratios(tmp_path):
    rows = [{"profile": "metro", "method": "cloud_ar",
             "by_dataset": {"humaneval": {"edge_tokens_per_s": 5.0, "verifier_ms_per_token": 140.0}}},
            {"profile": "metro", "method": "adaptive",
             "by_dataset": {"humaneval": {"edge_tokens_per_s": 6.0, "verifier_ms_per_token": 70.0}}}]
    f = tmp_path / "n.json"
    f.write_text(json.dumps({"results": rows, "simulation": {"curve": "c.json"}, "max_new_tokens": 64}))
    got = measured_ratios(f)
    assert got["ratios"] == {"metro": {"adaptive": {"humaneval": {"speed": 1.2, "speed_of": "edge_tokens_per_s",
                                                                  "cost": 0.5}}}}
    # the steady state where the run has it
    rows[0]["by_dataset"]["humaneval"]["decode_tokens_per_s"] = 7.0
    rows[1]["by_dataset"]["humaneval"]["decode_tokens_per_s"] = 10.5
    f.write_text(json.dumps({"results": rows}))
    assert measured_ratios(f)["ratios"]["metro"]["adaptive"]["humaneval"]["speed"] == 1.5
    assert got["simulation"]["curve"] == "c.json"


@pytest.mark.parametrize("runs, depth, start, want", [
    ([0, 3, 2, 1, 0, 0], 2, 1, (3, 2)),  # at 1: 2 accepted -> 4: 0 -> 5: 0
    ([0, 3, 2, 1, 0, 0], 4, 0, (3, 3)),  # at 0: 0 -> 1: 3 -> 5: 0
    ([5, 4, 3, 2, 1], 8, 5, (0, 0)),  # streamed to the end
])
def test_replay_chain(runs, depth, start, want):
    assert replay_chain(runs, depth, start) == want


def test_paced_on_never_faster_than_either():
    xeon = {1: 139.0, 4: 232.0, 8: 442.0}.get
    epyc = {1: 77.0, 4: 277.0, 8: 612.0}.get
    c = paced_on(xeon, epyc)
    assert [c(n) for n in (1, 4, 8)] == [139.0, 277.0, 612.0]


def test_where_drafting_never_pays_the_floor_is_cloud_only():
    # a drafter far slower than the verifier (the tuned-GPU regime): the oracle decodes alone, at cost 1.0
    c = ceilings([accept_runs([True] * 40)], Costs(flat(10.3), [0.0] + [28.0 * k for k in range(1, 9)], 20.0))
    for f in ("lockstep", "proactive", "overlapped"):
        assert c[f]["speed"] == 1.0 and c[f]["cost_floor_at_1x"] == 1.0 and c[f]["plain_share"] == 1.0
