"""Counting drafting on a request's own chains: one streamed cycle of a chain rebased onto the verifier's own
tokens and one lock-step round (table cases), replaying a recorded chain at another depth, the speed-up of a text's
cycles, the chains the plans find (``DraftPolicy._draft_plan``, ``_rounds_plan``), what the streamed mode's trees
saved (``draft_saved``), and the decisions built on them."""
import pytest

from tandem.edge.planner import Round
from tandem.orchestrator.costmodel import (Estimates, expected_tokens, lockstep_cycle, lockstep_plans, replayed_cycle,
                                           stream_cycle, stream_speedup, streamed_plan)
from tandem.orchestrator.policy import DraftPolicy, PolicyConfig

# a CPU-core verifier like the Xeon curve's: a forward of 4 tokens costs 2x one of 1 (and one of 2 nearly as much)
CPU = {1: 100.0, 2: 165.0, 3: 210.0, 4: 200.0, 5: 280.0, 6: 300.0, 7: 330.0, 8: 360.0, 9: 390.0}
# a GPU-like verifier: a forward costs the same whatever its size (up to dozens of tokens)
GPU = {n: 20.0 + 0.2 * n for n in range(1, 10)}

CYCLES = [
    # matched, depth, rebase -> tokens committed, verifier ms (t1 = 100, the CPU curve)
    ("all held, one token decoded alone first", 4, 4, 1, (5, 100.0 + 200.0)),
    ("first choice wrong: stale, costs nothing extra", 0, 4, 1, (2, 200.0)),
    ("two held: the rebased one and one more", 2, 4, 1, (3, 100.0 + 200.0)),
    ("every level rebased: nothing left to verify", 1, 1, 1, (2, 200.0)),
    ("not rebased, nothing held: a lost forward", 0, 3, 0, (1, 200.0)),
    ("rebased by 2, only 1 held: stale", 1, 4, 2, (3, 300.0)),
    ("rebased by 2, all held", 6, 6, 2, (7, 200.0 + 280.0)),
]


@pytest.mark.parametrize("name,matched,depth,rebase,expect", CYCLES, ids=[c[0] for c in CYCLES])
def test_stream_cycle(name, matched, depth, rebase, expect):
    assert stream_cycle(Estimates(verify_ms_at=dict(CPU)), matched, depth, rebase, 100.0) == pytest.approx(expect)


REPLAYS = [
    # run (its depth, matched), replayed depth, hold -> the cycle (t1 = 100, rebase 1, the CPU curve)
    ("failed within its depth, replayed deeper: the deeper forward, the same tokens", (3, 2), 6, 0.5,
     stream_cycle(Estimates(verify_ms_at=dict(CPU)), 2, 6, 1, 100.0)),
    ("replayed shallower: cut at the replayed depth", (8, 5), 3, 0.5,
     stream_cycle(Estimates(verify_ms_at=dict(CPU)), 3, 3, 1, 100.0)),
    ("held to its end, levels below always hold", (3, 3), 6, 1.0,
     stream_cycle(Estimates(verify_ms_at=dict(CPU)), 6, 6, 1, 100.0)),
    ("held to its end, levels below never hold", (3, 3), 6, 0.0,
     stream_cycle(Estimates(verify_ms_at=dict(CPU)), 3, 6, 1, 100.0)),
    ("held to its end, one level below half the time", (3, 3), 4, 0.5,
     tuple(0.5 * a + 0.5 * b for a, b in zip(stream_cycle(Estimates(verify_ms_at=dict(CPU)), 3, 4, 1, 100.0),
                                              stream_cycle(Estimates(verify_ms_at=dict(CPU)), 4, 4, 1, 100.0)))),
]


@pytest.mark.parametrize("name,run,depth,hold,expect", REPLAYS, ids=[r[0] for r in REPLAYS])
def test_replayed_cycle(name, run, depth, hold, expect):
    e = Estimates(verify_ms_at=dict(CPU))
    assert replayed_cycle(run, depth, hold, lambda m: stream_cycle(e, m, depth, 1, 100.0)) == pytest.approx(expect)


def lockstep(matched, depth, guessed=False):
    # a 15 ms drafted level, a 20 ms round trip, the CPU curve
    e = Estimates(verify_ms_at=dict(CPU), rtt_ms=20.0, draft_level_ms_at={1: 15.0})
    return lockstep_cycle(e, matched, depth, guessed)


LOCKSTEP = [
    # matched, depth, proactive -> tokens, round ms
    ("all held: the nodes and the bonus, drafting + trip + forward", 3, 3, False, (4, 45.0 + 20.0 + 200.0)),
    ("none held: the bonus alone, the round as dear", 0, 3, False, (1, 45.0 + 20.0 + 200.0)),
    ("held past the chain, proactive: the drafting hid in the last flight", 4, 3, True, (4, 220.0)),
    ("held the chain but not the next token, proactive: no hit", 3, 3, True, (4, 265.0)),
    ("held past it, but not proactive", 4, 3, False, (4, 265.0)),
]


@pytest.mark.parametrize("name,matched,depth,guessed,expect", LOCKSTEP, ids=[c[0] for c in LOCKSTEP])
def test_lockstep_cycle(name, matched, depth, guessed, expect):
    assert lockstep(matched, depth, guessed) == pytest.approx(expect)


def test_a_replayed_lock_step_round_looks_one_level_past_its_chain():
    """A proactive round needs the chain and the drafter's next first choice held: a run that held exactly its
    depth says nothing of that level, which then holds with the text's acceptance."""
    def cycle(m):
        return lockstep(m, 3, True)
    half = replayed_cycle((3, 3), 3, 0.5, cycle)
    assert half == pytest.approx(tuple(0.5 * a + 0.5 * b for a, b in zip(cycle(3), cycle(4))))
    assert replayed_cycle((8, 8), 3, 0.0, cycle) == pytest.approx(cycle(4))  # seen to hold past it


def test_stream_speedup_is_cloud_only_time_over_the_cycles_time():
    assert stream_speedup([(5, 300.0), (2, 200.0)], 100.0) == pytest.approx(700 / 500)
    assert stream_speedup([(2, 200.0)] * 3, 100.0) == pytest.approx(1.0)  # stale trees: cloud-only's pace
    assert stream_speedup([(1, 200.0)], 100.0) == pytest.approx(0.5)  # a lost forward
    assert stream_speedup([], 100.0) == 1.0


def test_plans_cost_one_forward_a_round_and_t1_over_the_speedup():
    """Lock-step rounds of chains that always held (a guess never drafted): each round commits depth + 1 tokens
    for one forward of depth + 1 tokens; the streamed mode costs cloud-only decoding's token over its speed-up."""
    e = Estimates(verify_ms_at=dict(CPU), rtt_ms=20.0, draft_level_ms_at={1: 15.0})
    plans = lockstep_plans(e, [(9, 9)] * 4, hold=0.9, largest=9, max_depth=12, guessed=False)
    assert [p.shape.d for p in plans] == list(range(1, 10))  # no forward past the largest measured
    for p in plans:
        d = p.shape.d
        assert p.verifier_ms_per_token == pytest.approx(CPU[d + 1] / (d + 1) if d < 9 else e.verify_ms(10) / 10)
        assert p.value == pytest.approx(1000 * (d + 1) / (d * 15.0 + 20.0 + e.verify_ms(d + 1)))
    streamed = streamed_plan(e, [(8, 8)] * 4, 100.0, hold=0.9, largest=9, max_depth=12)
    assert streamed.value > 1 and streamed.verifier_ms_per_token == pytest.approx(100.0 / streamed.value)
    assert streamed_plan(e, [(8, 0)] * 4, 100.0, 0.1, 9, 12) == (1.0, None, 100.0)  # nothing held: no chain


def policy(curve, runs, rtt=20.0, level=15.0, solo=None, **kw):
    """A policy that measured ``curve``, this link and drafter, and scored ``runs`` (depth, matched) in this
    request."""
    e = Estimates(verify_ms_at=dict(curve), solo_ms=[solo or curve[1]] * 8, rtt_ms=rtt,
                  draft_level_ms_at={1: level})
    p = DraftPolicy(PolicyConfig(**kw), e)
    p.req.runs = list(runs)
    return p


def test_no_plan_without_this_requests_chains():
    assert policy(CPU, [(8, 8)] * 3)._draft_plan() is None  # shadow_min = 4
    assert policy(CPU, [(8, 8)] * 4)._draft_plan() is not None


PLANS = [
    # name, curve, runs (depth, matched), rtt, drafter ms a level, check on (speed-up, shape)
    ("code on a CPU verifier: a deep chain", CPU, [(8, 8)] * 8, 20.0, 15.0,
     lambda s, sh: s > 1.6 and sh.k == 1 and sh.d >= 4),
    ("nothing ever held: no chain pays", CPU, [(8, 0)] * 8, 20.0, 15.0, lambda s, sh: s == 1.0 and sh is None),
    ("chat (some held): a chain still pays", CPU, [(8, 2), (8, 0), (8, 3), (8, 1)] * 2, 20.0, 15.0,
     lambda s, sh: 1.0 < s < 1.5 and sh is not None),
    ("one held at most: every chain's held level is the one rebased", CPU, [(8, 1), (8, 0)] * 4, 20.0, 15.0,
     lambda s, sh: s == 1.0 and sh is None),
    ("code on a GPU verifier, a drafter 10x faster a token: deep", GPU, [(12, 12)] * 8, 5.0, 2.0,
     lambda s, sh: sh.d >= 8 and s > 3.0),
    ("code on a GPU verifier, a drafter slower a token: its levels are rebased away", GPU, [(12, 12)] * 8, 5.0,
     15.0, lambda s, sh: s < 1.3),
]


@pytest.mark.parametrize("name,curve,runs,rtt,level,check", PLANS, ids=[p[0] for p in PLANS])
def test_draft_plan(name, curve, runs, rtt, level, check):
    speedup, shape, _ = policy(curve, runs, rtt, level)._draft_plan()
    assert check(speedup, shape), (speedup, shape)


def test_a_longer_trip_rebases_further_and_saves_less():
    runs = [(8, 4), (8, 6), (8, 2), (8, 8)] * 2
    near, far = policy(CPU, runs, rtt=20.0)._draft_plan(), policy(CPU, runs, rtt=180.0)._draft_plan()
    assert far[0] < near[0] and far[1].d > near[1].d  # two tokens decoded alone before the tree lands


def test_a_drafter_that_slows_the_verifier_is_charged_for_it():
    runs = [(8, 8)] * 8
    free, slowing = policy(CPU, runs), policy(CPU, runs)
    slowing.est.overlap_ms = [150.0] * 8  # one-token forwards 1.5x slower while the drafter works
    assert slowing._draft_plan()[0] < free._draft_plan()[0]


def streamed(p, ms, forward_ms=None):
    p.observe(Round(0, 0, 0, 0, 0, 0.0, ms, ms, streamed=True, tokens=1, gap_ms=ms, forward_ms=forward_ms))


def tree(p, accepted, forward_ms, rebased=1, depth=3, queue_ms=60.0):
    """A streamed tree's verdict: rebased by one token, ``depth`` levels below, ``accepted`` of them held; it waited
    ``queue_ms`` for the token in progress."""
    p.observe(Round(1, depth, depth, accepted, accepted, 40.0, forward_ms + queue_ms, forward_ms + queue_ms + 20.0,
                    rebased=rebased, forward_tokens=1 + depth, tokens=accepted + 1, gap_ms=forward_ms,
                    forward_ms=forward_ms))


def in_draft(curve):
    p = DraftPolicy(PolicyConfig(explore_every=64, explore_max=64), Estimates(verify_ms_at=dict(curve)),
                    modes=("plain", "draft"))
    for _ in range(p.config.phase_tokens):  # cloud-only decoding first: 10 tokens/s, 100 ms forwards, drafter idle
        streamed(p, 100.0)
    p.est.overlap_ms = [100.0] * 8  # a drafter on its own device: measured not to slow the forwards
    assert p.mode == "draft"
    return p


def test_a_streamed_probe_priced_by_its_chains_is_checked_by_the_clock_until_the_slowdown_is_known():
    """Its chains' replay prices forwards as timed with no drafter beside them. Where that was never measured (a
    cloud-cost client that does not stream alone) and the drafter shares the verifier's cores, the replay says it
    pays while the clock reads a third of cloud-only decoding: the probe ends at ``probe_tokens``."""
    p = policy(CPU, [(8, 4), (8, 6), (8, 2), (8, 8)] * 2, solo=100.0, explore_every=64, explore_max=64,
               phase_tokens=32)
    p.est.solo_ms = [100.0]  # one forward timed alone (a cloud-cost client seldom streams alone)
    p.rates["plain"].tokens_per_s, p.rates["plain"].measured_ms = 10.0, 5000.0
    assert p._draft_plan()[0] > 1.1 and p.interference is None
    p.mode = "draft"  # a probe, cloud-only decoding the favourite
    n = 0
    while p.mode == "draft":  # every forward 3x slower with the drafter working
        p.observe(Round(0, 0, 0, 0, 0, 0.0, 300.0, 300.0, streamed=True, tokens=1, gap_ms=300.0, overlapped=True))
        n += 1
    assert n == p.config.probe_tokens and p.favourite == "plain"
    q = policy(CPU, [(8, 4), (8, 6), (8, 2), (8, 8)] * 2, solo=100.0, explore_every=64, explore_max=64)
    q.est.overlap_ms = [100.0] * 8  # measured: the drafter does not slow the forwards ...
    q.rates["plain"].tokens_per_s, q.rates["plain"].measured_ms = 10.0, 5000.0
    q.mode = "draft"
    for _ in range(2 * q.config.probe_tokens):  # ... so a slow window of the clock (the link, a burst) is not it
        q.observe(Round(0, 0, 0, 0, 0, 0.0, 100.0, 300.0, streamed=True, tokens=1, gap_ms=300.0, overlapped=True))
    assert q.mode == "draft" and q.interference == pytest.approx(1.0)


@pytest.mark.parametrize("overlap_ms, bounded", [(150.0, True), (100.0, False)])
def test_where_the_drafter_slows_the_verifier_the_streamed_mode_is_no_faster_than_its_clock(overlap_ms, bounded):
    """The count takes the verifier's forwards alone; beside a working drafter on the same cores the verifier also
    loses time between them. On one host it priced the streamed mode at 1.4-1.65x cloud-only decoding, request
    after request, where it ran at 0.9-1.0x. Measured to slow the verifier, the mode is priced no higher than its
    clock; measured free, the count stands."""
    p = policy(CPU, [(8, 4), (8, 6), (8, 2), (8, 8)] * 2, solo=100.0)
    p.est.overlap_ms = [overlap_ms] * 8
    p.rates["plain"].add(10.0, 100.0, 5000.0, 1.0)
    counted = 10.0 * p._draft_plan()[0]
    assert counted > 12.0  # its chains say it pays, the slowdown counted in
    assert p.rate_now("draft") == pytest.approx(counted)  # no clock yet
    p.rates["draft"].add(9.0, 80.0, 3000.0, 1.0)  # its clock on earlier requests
    assert p.rate_now("draft") == pytest.approx(9.0 if bounded else counted)
    p.rates["rounds"].add(1.0, 100.0, 3000.0, 1.0)  # (measured, a clear loser: not probed next)
    p._favourite = p.mode = "draft"
    for _ in range(2 * p.config.probe_tokens):  # and its clock here: 7 tokens/s, cloud-only decoding 10
        p.observe(Round(0, 0, 0, 0, 0, 0.0, overlap_ms, 142.9, streamed=True, tokens=1, gap_ms=142.9, overlapped=True))
    assert (p.favourite == "draft") is not bounded  # slowed: it falls back on its clock; free: the count holds


@pytest.mark.parametrize("runs, plain_after", [
    ([(8, 0)] * 8, 7.5),  # no chain pays: nothing drafted, the verifier decoded alone (10 tokens/s), as in plain
    ([(8, 8)] * 8, 5.0),  # chains pay: its trees, not cloud-only decoding, made its clock
])
def test_a_streamed_phase_that_sent_no_tree_is_a_measure_of_cloud_only_decoding(runs, plain_after):
    """The cloud-cost client measures cloud-only decoding in probes of 8 tokens, the first after a switch of mode,
    which read low; a phase of the streamed mode whose chains say no tree pays decoded exactly as it does."""
    p = policy(CPU, runs, explore_every=64, explore_max=64)
    p.rates["plain"].tokens_per_s, p.rates["plain"].measured_ms = 5.0, 1000.0
    p._favourite = p.mode = "draft"
    for _ in range(p.config.phase_tokens):
        streamed(p, 100.0)
    assert p.rates["plain"].tokens_per_s == pytest.approx(plain_after)


def test_what_the_streamed_modes_trees_saved_is_counted_on_the_forwards_alone():
    p = in_draft(CPU)
    for _ in range(2 * p.config.shadow_min):  # a token decoded alone (100 ms), then a tree of 3 (200 ms) that
        assert p.draft_saved() is None  # committed 3
        streamed(p, 100.0)
        tree(p, 2, 200.0)
    # 32 tokens for 2400 ms of forwards, where cloud-only decoding takes 100 ms a token (queue waits not counted)
    assert p.draft_saved() == pytest.approx(32 * 100.0 / 2400.0)
    assert p.rate_now("draft") == pytest.approx(10.0 * 32 / 24)


def test_a_streamed_mode_whose_trees_lose_falls_back_to_cloud_only_decoding():
    p = in_draft(CPU)
    for _ in range(8):  # trees of 3 that hold nothing: 2 tokens for 300 ms
        streamed(p, 100.0)
        tree(p, 0, 200.0)
    assert p.draft_saved() == pytest.approx(2 / 3)
    assert p.rate_now("draft") < 10.0
    while p.mode == "draft":
        streamed(p, 100.0)
        tree(p, 0, 200.0)
    assert p.favourite == "plain"


def test_after_lock_step_rounds_collapse_the_streamed_mode_its_chains_say_pays_takes_over():
    """Chat after code: rounds collapsed on the chat (lock-step rounds lose where most chains fail), and no
    streamed tree ran yet in this request; its chains say streamed trees would pay: the streamed mode is not ruled
    out by the collapse (its plan is a count on this text, not the model), and it beats cloud-only decoding."""
    p = policy(CPU, [(8, 2), (8, 0), (8, 3), (8, 4)] * 2)
    p.rates["plain"].tokens_per_s, p.rates["plain"].measured_ms = 10.0, 5000.0
    p.req.collapsed = True
    assert not p._ruled_out("draft") and p._ruled_out("rounds")
    assert p.rate_now("draft") == pytest.approx(10.0 * p._draft_plan()[0]) and p.rate_now("draft") > 10.5
    p._favourite = "plain"
    assert p._best_mode() == "draft"
    p.mode = "draft"
    assert p.shape() == p._draft_plan()[1]  # the chain it priced


def test_a_streamed_favourite_is_judged_by_its_account_not_a_bursty_window_of_the_clock():
    """Chat in the streamed mode: its trees saved a third of the verifier's time so far; then a window of 16 tokens
    arrives at half of cloud-only decoding's rate (a tree commits a burst, then none). The account says it still
    wins: no collapse, the phase runs on; a window of the clock alone would have ended it."""
    p = in_draft(CPU)
    for _ in range(2 * p.config.shadow_min):
        streamed(p, 100.0)
        tree(p, 2, 200.0)
    while p._phase[0]:  # to the start of a phase of the streamed mode, now the favourite
        streamed(p, 100.0)
        tree(p, 2, 200.0)
    assert p.favourite == p.mode == "draft"
    for _ in range(16):  # the clock reads 5 tokens/s: each token 200 ms apart
        p.observe(Round(0, 0, 0, 0, 0, 0.0, 100.0, 200.0, streamed=True, tokens=1, gap_ms=200.0, forward_ms=100.0))
    assert p.mode == "draft" and p._phase[0] == 16 and not p.req.collapsed
    assert p.rate_now("draft") > 10.0


def test_the_streamed_mode_drafts_the_chain_it_priced_not_the_models_tree():
    """On a flat (GPU-like) curve the model prices wide trees; once this request's chains suffice, the streamed
    mode drafts the chain their replay found best, the shape its rate stands on."""
    p = policy(GPU, [(12, 12)] * 8, rtt=5.0, level=2.0)
    p.mode = "draft"
    assert p.best_shape("draft").k > 1
    assert p.shape() == p._draft_plan()[1] and p.shape().k == 1


def test_chains_are_priced_no_deeper_than_one_token_past_the_largest_forward_measured():
    """Code on a CPU verifier whose forwards of 1 and 4 tokens were measured: a chain verifying 5 tokens is
    priced on a line extrapolated one step, none further (the line underprices deep forwards: chat drafted chains
    of 8 that lost)."""
    measured = {1: CPU[1], 4: CPU[4]}
    speedup, shape, _ = policy(measured, [(8, 8)] * 8)._draft_plan()
    assert shape.d <= 6 and speedup > 1.5  # 6 levels rebased by 2 verify 5 tokens (20 + 7 * 15 ms > one forward)
    assert policy(dict(CPU), [(8, 8)] * 8)._draft_plan()[1].d > shape.d  # every size measured: deeper


ROUNDS = [
    # name, runs, proactive, check on (tokens/s, shape)
    ("code: a deep chain, nearly all its tokens", [(8, 8)] * 8, False, lambda r, sh: sh.d >= 5 and r > 15.0),
    ("chat: a short chain", [(8, 2), (8, 0), (8, 3), (8, 1)] * 2, False, lambda r, sh: sh.d <= 3),
    ("code, proactive: faster than without, its guesses holding", [(8, 8)] * 8, True,
     lambda r, sh: r > policy(CPU, [(8, 8)] * 8)._rounds_plan()[0] * 1.1),
]


@pytest.mark.parametrize("name,runs,proactive,check", ROUNDS, ids=[r[0] for r in ROUNDS])
def test_rounds_plan(name, runs, proactive, check):
    p = policy(CPU, runs)
    p._speculates = proactive
    rate, shape, _ = p._rounds_plan()
    assert check(rate, shape), (rate, shape)


def test_lock_step_rounds_draft_and_price_the_chain_their_replay_found():
    """Chat at wan: the chain the replay of this request's chains finds is what is drafted, and what the model
    prices (the shape drafted is the shape priced), not the model's own best shape."""
    runs = [(8, 2), (8, 0), (8, 3), (8, 1)] * 2
    p = policy(CPU, runs, rtt=80.0)
    for _ in runs:
        p._note_chain(0, 8, 1, phase=False)
    p.mode = "rounds"
    chain = p._rounds_plan()[1]
    assert p.shape() == chain and chain.k == 1 and chain.d <= 3
    model = p._est_at(p.req.tries)
    priced = p._model_rate("rounds", p.req.tries)
    drafted = 1000 * expected_tokens(model.alpha, 1, chain.d, 0.7) / p._round_ms(model, 1, chain.d, chain.d)
    assert priced == pytest.approx(drafted)


def cost_policy(runs, plain_rate=None, curve=CPU, **kw):
    """A cloud-cost policy on a request whose chains are ``runs``, cloud-only decoding measured at ``plain_rate``
    (its one-token forwards then as long as its tokens)."""
    p = policy(curve, runs, solo=1000 / plain_rate if plain_rate else None, **kw)
    p.objective = "cloud_cost"
    if plain_rate is not None:
        p.rates["plain"].tokens_per_s, p.rates["plain"].measured_ms = plain_rate, 5000.0
        p.rates["plain"].verifier_ms_per_token = CPU[1]
    for run in runs:  # the request's acceptance by depth, which the model prices a chain at
        p._note_chain(0, run[0], run[1], phase=False)
    return p


def test_the_cloud_cost_rounds_plan_is_the_cheapest_chain_as_fast_as_cloud_only_decoding():
    """A verifier whose forward costs little more per token (100 ms + 5 a token) and a slow drafter (60 ms a level):
    the fastest lock-step chain is a short one; the cloud-cost objective drafts a deeper one, fewer verifier ms a
    token, as long as the model prices it no slower than cloud-only decoding (within the hysteresis)."""
    flat = {n: 100.0 + 5.0 * n for n in range(1, 14)}
    runs = [(12, 6), (12, 12), (12, 4), (12, 9)] * 2
    latency = policy(flat, runs, level=60.0)._rounds_plan()
    assert latency.shape.d == 4

    def cheap(plain_rate):
        p = cost_policy(runs, plain_rate, curve=flat, level=60.0)
        p.mode = "rounds"
        return p, p._rounds_plan()

    p, plan = cheap(10.0)
    assert plan.shape.d == 9 and plan.verifier_ms_per_token < 0.8 * latency.verifier_ms_per_token
    assert p.shape() == plan.shape and 10.0 * 0.95 <= p.predicted_rate("rounds") < latency.value
    p, plan = cheap(12.0)  # the chain of 9 is priced below 0.95x of 12 tokens/s: a shallower one, still cheaper
    assert 4 < plan.shape.d < 9 and p.predicted_rate("rounds") >= 12.0 * 0.95
    assert cheap(1000.0)[1] == latency  # nothing as fast as cloud-only decoding: the fastest


def test_the_cloud_cost_objective_prices_each_mode_on_this_requests_text():
    """Code after chat (2026-12-03): lock-step rounds were last measured on the chat, at more verifier time a token
    than streamed trees; on this code their plan is the cheaper, and the objective takes them."""
    p = cost_policy([(8, 8)] * 8, plain_rate=10.0)
    p.rates["rounds"].tokens_per_s, p.rates["rounds"].measured_ms = 12.0, 5000.0
    p.rates["rounds"].verifier_ms_per_token = 180.0  # the chat's
    p.rates["draft"].tokens_per_s, p.rates["draft"].measured_ms = 15.0, 5000.0
    p.rates["draft"].verifier_ms_per_token = 70.0
    p.calibration["rounds"] = 1.0
    plan = p._rounds_plan()
    assert p.cost_now("rounds") == pytest.approx(plan.verifier_ms_per_token) and plan.verifier_ms_per_token < 70.0
    assert p.cost_now("draft") == pytest.approx(100.0 / p._draft_plan().value)  # t1 over the speed-up
    assert p.cost_now("plain") == p.rates["plain"].verifier_ms_per_token
    p._favourite = "draft"
    assert p.rate_now("rounds") >= 10.0 * 0.95 and p._best_mode() == "rounds"
    # what its rounds cost here, once they ran, beats the plan
    p.req.rates["rounds"] = [16, 1000.0, 16 * 95.0]
    assert p.cost_now("rounds") == pytest.approx(95.0)


def lockstep_round(p, depth, held, gap_ms):
    p.observe(Round(1, depth, depth, held, held, 40.0, 200.0, gap_ms, forward_tokens=1 + depth, tokens=held + 1,
                    gap_ms=gap_ms, forward_ms=200.0))


def test_a_phase_the_recheck_ends_calibrates_but_is_not_this_texts_clock():
    """Chat after code: rounds, the favourite, drafts the code's deep chains until this request's chains suffice;
    the phase the re-check then ends (deep chains failing) calibrates the model, but is not what rounds do on this
    text (a chain of the text's own depth), which the model then prices."""
    p = cost_policy([], plain_rate=7.0)
    p.objective = "latency"
    p.rates["rounds"].tokens_per_s, p.rates["rounds"].measured_ms = 14.0, 5000.0
    p._favourite = p.mode = "rounds"
    lockstep_round(p, 12, 0, 500.0)
    p.observe(Round(0, 0, 0, 0, 0, 0.0, 100.0, 100.0, streamed=True, tokens=1, gap_ms=900.0, first=True))
    for _ in range(p.config.shadow_min):  # deep chains, one token each: 2 tokens/s
        lockstep_round(p, 12, 1, 1000.0)
    assert p.req.rechecked and "rounds" not in p.req.rates and "rounds" in p.calibration
    assert p.rate_now("rounds") == pytest.approx(p.predicted_rate("rounds"))  # the model, not the 2 tokens/s


def test_a_lock_step_chain_is_priced_no_higher_than_its_replay():
    """Chat after code: the calibration the code's deep chains taught (they ran 1.3x the model) would price the
    chat's short chain above what this text's own chains replay to; the replay bounds it."""
    runs = [(8, 2), (8, 0), (8, 3), (8, 1)] * 2
    p = cost_policy(runs)
    p.objective = "latency"
    plan = p._rounds_plan()
    p.calibration["rounds"] = 1.0
    p.mode = "rounds"
    modelled = p._model_rate("rounds", p.req.tries)
    assert p.predicted_rate("rounds") == pytest.approx(min(modelled, plan.value))
    p.calibration["rounds"] = 1.3 * plan.value / modelled
    assert p.predicted_rate("rounds") == pytest.approx(plan.value)
