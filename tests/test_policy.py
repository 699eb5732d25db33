"""Draft policy: deterministic choices on literal estimates, and learning from observed rounds."""
import pytest

from orchestrator.policy import (DraftPolicy, Estimates, PolicyConfig, Round, decode_ms_per_token, expected_tokens,
                                 round_ms)


def est(rtt=5.0, alpha=0.9, draft_node=8.0, depth=12, **kw):
    """An edge drafter at ~10 ms per level, a GPU verifier at 25 ms + 1 ms per token."""
    return Estimates(rtt_ms=rtt, draft_base_ms=kw.get("draft_base", 2.0), draft_node_ms=draft_node,
                     verify_base_ms=kw.get("verify_base", 25.0), verify_token_ms=kw.get("verify_token", 1.0),
                     alpha=[alpha] * depth)


def decode_run(policy, verify_ms=27.0):
    """Feed the policy the verdicts of the decode run it asked for (one token each, streamed after the first)."""
    for i in range(policy.decode_steps):
        policy.observe(Round(width=0, depth=0, nodes=0, accepted=0, chain_accepted=0, draft_ms=0.0,
                             verify_ms=verify_ms, round_ms=verify_ms + (2.0 if i == 0 else 0.1), streamed=i > 0))


def test_expected_tokens_maths():
    assert expected_tokens([], 1, 0, 0.5) == 1.0
    assert expected_tokens([1.0, 1.0, 1.0], 1, 3, 0.5) == 4.0
    assert expected_tokens([0.5, 0.5], 1, 2, 0.0) == pytest.approx(1 + 0.5 + 0.25)
    # two tries per level: a = 1 - 0.5^2 = 0.75
    assert expected_tokens([0.5, 0.5], 2, 2, 0.0) == pytest.approx(1 + 0.75 + 0.75 ** 2)
    assert round_ms(est(rtt=10), 2, 3, 6) == pytest.approx(3 * (2 + 8 * 2) + 25 + 1 * 7 + 10)
    # no drafting: one-token forwards streamed behind one round trip per run
    assert decode_ms_per_token(est(rtt=80), 16) == pytest.approx(25 + 1 + 80 / 16)
    assert decode_ms_per_token(est(rtt=80), 1) == pytest.approx(25 + 1 + 80)


SCENARIOS = [
    # name, estimates, check on the chosen shape (None = no drafting)
    ("fast link, good acceptance: drafts", est(rtt=2), lambda s: s is not None and 2 <= s.d <= 8),
    ("slow link: deep drafts", est(rtt=60, alpha=0.95), lambda s: s is not None and s.d >= 10),
    ("low acceptance: no drafting", est(alpha=0.05), lambda s: s is None),
    ("slow edge: no drafting", est(draft_node=400.0, draft_base=100.0), lambda s: s is None),
    ("mediocre acceptance: a chain, not wide", est(alpha=0.6, rtt=2), lambda s: s is not None and s.k <= 2),
]


@pytest.mark.parametrize("name,estimates,check", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_choices(name, estimates, check):
    shape = DraftPolicy(PolicyConfig(), estimates).choose()
    assert check(shape), shape


def test_slower_link_never_drafts_less_until_streaming_wins():
    """Deeper drafts as the RTT grows; on a very slow link a streamed decode run (one round trip per run) beats
    any tree (one round trip per round)."""
    depths = []
    for rtt in (1, 10, 40):
        s = DraftPolicy(PolicyConfig(), est(rtt=rtt, alpha=0.9)).choose()
        depths.append(s.d if s else 0)
    assert depths == sorted(depths) and depths[-1] > depths[0] > 0
    assert DraftPolicy(PolicyConfig(), est(rtt=400, alpha=0.9)).choose() is None


def test_deterministic():
    a = [DraftPolicy(PolicyConfig(), est(rtt=r)).choose() for r in (3, 30, 300)]
    b = [DraftPolicy(PolicyConfig(), est(rtt=r)).choose() for r in (3, 30, 300)]
    assert a == b


def test_recovers_when_acceptance_returns():
    policy = DraftPolicy(PolicyConfig(probe_tokens=32), est(alpha=0.05, rtt=20))
    assert policy.choose() is None and policy.decode_steps == 32  # a decode run ...
    assert policy.choose() is None  # ... goes on until its tokens came back ...
    decode_run(policy, verify_ms=30.0)
    probe = policy.choose()
    assert probe is not None and probe.d == 2  # ... then a probe
    for _ in range(40):  # the drafter is good again: every probe / chain is fully accepted
        s = policy.choose()
        if s is None:
            decode_run(policy, verify_ms=30.0)
            continue
        policy.observe(Round(width=s.k, depth=s.d, nodes=s.n, accepted=s.d, chain_accepted=s.d, draft_ms=s.d * 8.0,
                             verify_ms=30.0, round_ms=50.0))
    s = policy.choose()
    assert s is not None and s.d >= 4


def test_acceptance_drop_shrinks_drafts():
    policy = DraftPolicy(PolicyConfig(), est(alpha=0.95, rtt=20))
    before = policy.choose()
    for _ in range(30):
        s = policy.choose() or before
        policy.observe(Round(width=s.k, depth=s.d, nodes=s.n, accepted=0, chain_accepted=0, draft_ms=s.d * 20.0,
                             verify_ms=30.0, round_ms=50.0))
    after = policy.choose()
    assert after is None or after.d < before.d


def test_observe_learns_rtt_and_alpha():
    policy = DraftPolicy(PolicyConfig(ewma=0.5), Estimates(rtt_ms=0.0))
    for _ in range(12):
        policy.observe(Round(width=1, depth=4, nodes=4, accepted=2, chain_accepted=2, draft_ms=40.0,
                             verify_ms=30.0, round_ms=110.0))
    assert policy.est.rtt_ms == pytest.approx(80.0, rel=1e-3)
    # depths 1 and 2 always accepted, depth 3 always tried and rejected, depth 4 never reached
    assert policy.est.alpha[0] == pytest.approx(1.0, abs=1e-3) and policy.est.alpha[1] == pytest.approx(1.0, abs=1e-3)
    assert policy.est.alpha[2] == pytest.approx(0.0, abs=1e-3) and len(policy.est.alpha) == 3


def test_cost_estimates_from_measurements():
    e = Estimates(verify_base_ms=20.0, verify_token_ms=5.0, draft_base_ms=2.0, draft_node_ms=8.0)
    assert e.verify_ms(4) == 40.0 and e.draft_level_ms(2) == 18.0  # priors
    e.verify_ms_at[1] = 30.0
    assert e.verify_ms(3) == 40.0  # one point: the prior slope from it
    e.verify_ms_at[5] = 70.0
    assert e.verify_ms(5) == 70.0 and e.verify_ms(3) == pytest.approx(50.0)  # measured / fitted line
    e.draft_level_ms_at[1] = 20.0
    assert e.draft_level_ms(1) == 20.0 and e.draft_level_ms(2) == pytest.approx(20.0 * 18.0 / 10.0)


def test_policy_learns_that_local_drafting_pays():
    """On one CPU host (drafter 12 ms per level, verify 40 ms + 10 ms per extra token, no link: about what
    ANCHORS.md measured) chains at high acceptance beat plain decoding; the policy must find that out itself."""
    policy = DraftPolicy(PolicyConfig(widths=(1,)))  # no estimates given: it explores first
    for _ in range(30):
        s = policy.choose()
        d = s.d if s else 0
        assert d or policy.decode_steps == 1, "a decode run was chosen"
        policy.observe(Round(width=1 if d else 0, depth=d, nodes=d, accepted=d, chain_accepted=d,
                             draft_ms=12.0 * d, verify_ms=40.0 + 10.0 * d, round_ms=40.0 + 10.0 * d + 1.0))
    s = policy.choose()
    assert s is not None and s.d >= 4  # E[tau] = d + 1 for 38 d + 40 ms: deeper is better here


def test_probes_back_off_while_drafting_does_not_pay():
    """Decode runs between probes double (64, 128, ..., 1024) while every probe is rejected, and return to 64 as
    soon as drafting wins again."""
    policy = DraftPolicy(PolicyConfig(probe_tokens=64, probe_max_tokens=1024), est(alpha=0.05, rtt=2))
    runs = []
    for _ in range(6):
        assert policy.choose() is None
        runs.append(policy.decode_steps)
        decode_run(policy)
        s = policy.choose()
        assert s is not None and s.d == 2  # the probe after each run
        policy.observe(Round(width=1, depth=s.d, nodes=s.n, accepted=0, chain_accepted=0, draft_ms=s.d * 10.0,
                             verify_ms=27.0, round_ms=29.0))
    assert runs == [64, 128, 256, 512, 1024, 1024]
    policy.est.alpha = [0.99] * 12  # the drafter got good (say, a repetitive document)
    assert policy.choose() is not None
    policy.est.alpha = [0.05] * 12  # and bad again: runs start over at 64
    assert policy.choose() is None and policy.decode_steps == 64


def test_streamed_verdicts_do_not_teach_rtt():
    """Later verdicts of a decode run arrive one verify apart: they carry no round trip of their own."""
    policy = DraftPolicy(PolicyConfig(ewma=0.5), Estimates(rtt_ms=60.0))
    for _ in range(10):
        policy.observe(Round(width=0, depth=0, nodes=0, accepted=0, chain_accepted=0, draft_ms=0.0, verify_ms=30.0,
                             round_ms=30.5, streamed=True))
    assert policy.est.rtt_ms == 60.0 and policy.est.verify_ms_at[1] == pytest.approx(30.0)
    policy.observe(Round(width=0, depth=0, nodes=0, accepted=0, chain_accepted=0, draft_ms=0.0, verify_ms=30.0,
                         round_ms=110.0))
    assert policy.est.rtt_ms == pytest.approx(70.0)


def test_slow_link_prefers_decode_runs_over_one_token_rounds_when_drafts_fail():
    """With a 200 ms RTT and useless drafts, plain decoding is streamed: per token it costs verify + RTT / run
    length, where a one-token round would pay the whole RTT."""
    assert DraftPolicy(PolicyConfig(), est(rtt=200, alpha=0.02)).choose() is None


@pytest.mark.parametrize("pending,catch_up_ms_per_token,probes", [
    (10, 2.0, True),  # 20 ms of catch-up after a 64 x 27 ms run: within 5 %
    (400, 2.0, False),  # a long new prompt: 800 ms > 5 % of the run, decode on
    (400, 0.01, True),  # ... unless the drafter catches up that fast
])
def test_probe_waits_while_the_drafter_catch_up_costs_too_much(pending, catch_up_ms_per_token, probes):
    e = est(alpha=0.05, rtt=2)
    e.catch_up_ms_per_token = catch_up_ms_per_token
    policy = DraftPolicy(PolicyConfig(probe_tokens=64, probe_budget=0.05), e)
    assert policy.choose() is None
    decode_run(policy)
    s = policy.choose(pending_tokens=pending)
    assert (s is not None) == probes
    if not probes:
        assert policy.decode_steps == 64  # another run, then it asks again


def test_catch_up_rate_is_learnt():
    policy = DraftPolicy()
    policy.observe_catch_up(100, 800.0)  # the first measurement replaces the prior
    assert policy.est.catch_up_ms_per_token == pytest.approx(8.0)
    policy.observe_catch_up(2, 100.0)  # too short to say anything about the rate
    policy.observe_catch_up(100, 300.0)  # then a moving average
    assert policy.est.catch_up_ms_per_token == pytest.approx(8.0 + 0.5 * (3.0 - 8.0))


def test_peek_leaves_the_state_alone():
    """Proactive drafting asks what the next round will be; asking must not advance runs or probes."""
    a, b = DraftPolicy(PolicyConfig(probe_tokens=8)), DraftPolicy(PolicyConfig(probe_tokens=8))
    for _ in range(12):
        a.peek(5)
        assert a.choose(5) == b.choose(5) and a.decode_steps == b.decode_steps
        r = Round(width=0, depth=0, nodes=0, accepted=0, chain_accepted=0, draft_ms=0.0, verify_ms=30.0,
                  round_ms=31.0)
        a.observe(r)
        b.observe(r)
