"""Draft policy: the cost-model maths on literal estimates, tree shapes per regime, mode choice by measured rates
(hysteresis, exploration backing off, both objectives), and learning from observed verdicts."""
import pytest

from tandem.core.tree import TreeShape
from tandem.edge.planner import Round
from tandem.orchestrator.costmodel import Estimates, expected_tokens, hit_chance, pipelined_value, round_ms
from tandem.orchestrator.policy import DraftPolicy, PolicyConfig
from tandem.orchestrator.pricing import alpha_by_depth, count_chain


def est(rtt=5.0, alpha=0.9, draft_node=8.0, depth=12, rebase=1.0, **kw):
    """An edge drafter at ~10 ms per level; by default a GPU-like verifier (25 ms + 1 ms per token)."""
    return Estimates(rtt_ms=rtt, draft_base_ms=kw.get("draft_base", 2.0), draft_node_ms=draft_node,
                     verify_base_ms=kw.get("verify_base", 25.0), verify_token_ms=kw.get("verify_token", 1.0),
                     alpha=[alpha] * depth, rebase=rebase)


def test_expected_tokens_and_round_maths():
    assert expected_tokens([], 1, 0, 0.5) == 1.0
    assert expected_tokens([1.0, 1.0, 1.0], 1, 3, 0.5) == 4.0
    assert expected_tokens([0.5, 0.5], 1, 2, 0.0) == pytest.approx(1 + 0.5 + 0.25)
    # two tries per level: a = 1 - 0.5^2 = 0.75
    assert expected_tokens([0.5, 0.5], 2, 2, 0.0) == pytest.approx(1 + 0.75 + 0.75 ** 2)
    assert round_ms(est(rtt=10), 2, 3, 6) == pytest.approx(3 * (2 + 8 * 2) + 25 + 1 * 7 + 10)


HITS = [
    # acceptance by depth, chain depth, chance the guess (every first choice and the bonus) holds
    ([1.0] * 4, 3, 1.0),
    ([0.5] * 4, 1, 0.25),  # the chain's node and the bonus
    ([0.9, 0.8, 0.5], 2, 0.9 * 0.8 * 0.5),
    ([0.9], 2, 0.9 ** 3),  # unobserved depths take the deepest estimate
    ([0.0, 1.0], 3, 0.0),
]


@pytest.mark.parametrize("alpha,depth,chance", HITS)
def test_hit_chance_maths(alpha, depth, chance):
    assert hit_chance(Estimates(alpha=alpha), depth, 0.7) == pytest.approx(chance)


def test_a_held_guess_hides_the_drafting_that_fits_in_the_flight():
    e = est(rtt=20)  # 2 + 8 ms a level at width 1, verify 25 + 1 ms a token: a 49 ms flight for a chain of 3
    assert round_ms(e, 1, 3, 3, hit=1.0) == pytest.approx(49)  # the guessed tree's 4 levels (40 ms) fit in it...
    slow = est(rtt=20, draft_node=18.0)  # ... not at 20 ms a level: 80 ms of drafting, 31 after the flight
    assert round_ms(slow, 1, 3, 3, hit=1.0) == pytest.approx(49 + 31)
    assert round_ms(e, 1, 3, 3, hit=0.5) == pytest.approx(49 + 0.5 * 30)
    assert round_ms(e, 1, 3, 3) == round_ms(e, 1, 3, 3, hit=0.0) == pytest.approx(49 + 30)


def test_pipelined_value_maths():
    e = est(rtt=10, alpha=1.0, rebase=2)  # perfect drafts arriving 2 tokens late
    # depth 6 chain: the first 2 levels are consumed by rebasing, 4 are verified and all accepted
    saved = 4 * 26 - (e.verify_ms(1 + 4) - 26)  # 4 tokens without their own forward, minus the extra verify cost
    cycle = 6 * e.draft_level_ms(1) + 10 + e.verify_ms(5)
    assert pipelined_value(e, 1, 6, 6, 0.7) == pytest.approx(saved / cycle)
    assert pipelined_value(e, 1, 2, 2, 0.7) < pipelined_value(e, 1, 6, 6, 0.7)  # all levels eaten by the rebase
    assert pipelined_value(est(alpha=0.0), 1, 4, 4, 0.7) <= 0  # never survives its rebase: worth nothing
    assert pipelined_value(est(alpha=0.3, verify_token=20.0, rebase=0), 1, 4, 4, 0.7) < 0  # extra verify cost


SHAPES = [
    # name, mode, estimates, check on the chosen shape (None = no tree)
    ("gpu verifier, good drafts: deep", "draft", est(alpha=0.9), lambda s: s is not None and s.d >= 5),
    ("gpu verifier, useless drafts: none", "draft", est(alpha=0.02, verify_token=3.0), lambda s: s is None),
    ("cpu verifier (+20 ms per token on 45), poor drafts: none", "draft",
     est(alpha=0.3, verify_token=20.0), lambda s: s is None),
    ("cpu verifier, good drafts: a chain", "draft", est(alpha=0.9, verify_token=20.0),
     lambda s: s is not None and s.k == 1),
    ("late trees are drafted deeper", "draft", est(alpha=0.9, rebase=5), lambda s: s is not None and s.d >= 7),
    ("rounds: fast link, good acceptance", "rounds", est(rtt=2), lambda s: s is not None and 2 <= s.d <= 8),
    ("rounds: slow link, deep drafts", "rounds", est(rtt=60, alpha=0.95), lambda s: s is not None and s.d >= 10),
    ("rounds: mediocre acceptance, a chain", "rounds", est(alpha=0.6, rtt=2), lambda s: s is not None and s.k <= 2),
]


@pytest.mark.parametrize("name,mode,estimates,check", SHAPES, ids=[s[0] for s in SHAPES])
def test_shapes(name, mode, estimates, check):
    assert check(DraftPolicy(PolicyConfig(), estimates).best_shape(mode))


def run_phase(policy, tokens_per_s, verifier_ms=30.0, tokens=None, pending=0):
    """Feed verdicts at a measured rate until the policy ends the phase (or ``tokens`` of them); returns the mode
    that phase was run in. ``pending``: tokens the drafter has not evaluated at each verdict."""
    mode = policy.mode
    n = tokens or policy.config.phase_tokens
    for _ in range(n):
        policy.observe(verdict(policy, 1000 / tokens_per_s, verifier_ms, pending))
        if policy._phase[0] == 0:
            break
    return mode


def verdict(policy, gap_ms, verifier_ms=30.0, pending=0):
    """One committed token as the mode in force delivers it: in lock-step ``rounds`` a tree's verdict (the
    verifier waits for each tree), otherwise a token decoded alone."""
    streamed = policy.mode != "rounds"
    return Round(0, 0, 0, 0, 0, 0.0, verifier_ms, gap_ms if streamed else verifier_ms, streamed=streamed, tokens=1,
                 gap_ms=gap_ms, pending=pending)


def drive(policy, rates, phases):
    """Run ``phases`` phases where each mode yields its rate from ``rates``; the modes used, in order."""
    return [run_phase(policy, *rates[policy.mode]) for _ in range(phases)]


def drive_tokens(policy, rates, tokens):
    """Feed ``tokens`` verdicts, each at the rate of the mode in force; the time each mode took (ms)."""
    spent = dict.fromkeys(rates, 0.0)
    for _ in range(tokens):
        mode = policy.mode
        gap = 1000 / rates[mode][0]
        spent[mode] += gap
        policy.observe(verdict(policy, gap))
    return spent


def test_latency_objective_keeps_the_faster_mode_and_explores_less_and_less():
    p = DraftPolicy(PolicyConfig(explore_every=2, explore_max=8))
    used = drive(p, {"draft": (30.0,), "rounds": (24.0,), "plain": (20.0,)}, 30)
    assert used[:3] == ["plain", "draft", "rounds"]  # every mode is measured first, cloud-only decoding first
    assert len(used) - used.count("draft") < used.count("draft") / 3
    gaps = [i for i, m in enumerate(used) if m != "draft"]
    assert [b - a for a, b in zip(gaps, gaps[1:])] == sorted(b - a for a, b in zip(gaps, gaps[1:]))  # backs off
    assert p.shape() is not None or p.mode == "plain"


def test_never_slower_than_cloud_only_when_drafting_loses():
    """Measured, not predicted: drafting that the model likes but that runs slower is dropped."""
    p = DraftPolicy(PolicyConfig(explore_every=2), est(alpha=0.95))
    assert p.best_shape("draft") is not None  # the model says drafting pays ...
    used = drive(p, {"draft": (15.0,), "rounds": (14.0,), "plain": (20.0,)}, 18)  # ... the clock disagrees
    assert used[3:].count("plain") >= 11
    assert p.favourite == "plain" and (p.mode != "plain" or p.shape() is None)


@pytest.mark.parametrize("draft_rate, switches", [(20.5, False), (22.0, True)])
def test_hysteresis(draft_rate, switches):
    p = DraftPolicy(PolicyConfig(explore_every=1, hysteresis=0.05))
    p.mode = "plain"
    drive(p, {"plain": (20.0,), "draft": (20.0,), "rounds": (10.0,)}, 3)  # measured: plain stays the favourite
    p._favourite = "plain"
    p.req.rates.clear()  # the rates set below, not this request's own phases, are what is compared
    p.rates["draft"].tokens_per_s = draft_rate
    p.rates["plain"].tokens_per_s = 20.0
    assert (p._best_mode() == "draft") == switches


def test_rates_come_back_when_conditions_change():
    p = DraftPolicy(PolicyConfig(explore_every=2, explore_max=4))
    drive(p, {"draft": (30.0,), "rounds": (25.0,), "plain": (20.0,)}, 8)
    used = drive(p, {"draft": (10.0,), "rounds": (9.0,), "plain": (20.0,)}, 14)  # acceptance collapsed
    assert used[-4:].count("plain") >= 3


def test_cloud_cost_objective_takes_the_cheapest_mode_that_is_not_slower():
    p = DraftPolicy(PolicyConfig(explore_every=3), objective="cloud_cost")
    assert not p.stream and p.mode == "rounds"  # the verifier waits for trees in that mode
    # rounds: as fast as plain, 3x fewer verifier ms per token; draft: faster but pricier
    rates = {"rounds": (20.0, 10.0), "draft": (26.0, 25.0), "plain": (20.0, 30.0)}
    used = drive(p, rates, 15)
    assert used[3:].count("rounds") >= 9
    # rounds too slow: it may not cost latency, so the cheapest of the others
    p2 = DraftPolicy(PolicyConfig(explore_every=3), objective="cloud_cost")
    used = drive(p2, {"rounds": (12.0, 10.0), "draft": (22.0, 25.0), "plain": (20.0, 30.0)}, 15)
    assert used[3:].count("draft") >= 9


def test_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="objective"):
        DraftPolicy(objective="fastest")


@pytest.mark.parametrize("modes", [(), ("draft", "draft"), ("plain", "turbo")])
def test_bad_mode_lists_are_refused(modes):
    with pytest.raises(ValueError, match="modes"):
        DraftPolicy(modes=modes)


def test_a_policy_held_to_one_mode_stays_there():
    p = DraftPolicy(modes=("draft",))
    drive(p, REGIMES["shared cores"], 6)
    stream(p, 31.0, True)  # (the drafter measured free: it warms up on prompts)
    assert p.mode == p.favourite == "draft" and p.drafts and p.explore_loss_ms == 0


def test_first_verdict_of_a_stream_is_not_a_rate():
    """Its gap includes the prompt's prefill: counting it would make whichever mode opened look slow."""
    p = DraftPolicy()
    p.observe(Round(0, 0, 0, 0, 0, 0.0, 30.0, 5000.0, streamed=True, tokens=1, gap_ms=5000.0, first=True))
    assert p._phase == [0, 0.0, 0.0, 0.0]


def test_observe_learns_rtt_alpha_and_rebase():
    policy = DraftPolicy(PolicyConfig(ewma=0.5), Estimates(rtt_ms=0.0, rebase=0.0))
    for _ in range(12):
        policy.observe(Round(width=1, depth=4, nodes=4, accepted=2, chain_accepted=2, draft_ms=40.0, verify_ms=30.0,
                             round_ms=110.0, rebased=2, tokens=3, gap_ms=110.0))
    assert policy.est.rtt_ms == pytest.approx(80.0, rel=1e-3)
    assert policy.est.rebase == pytest.approx(2.0, rel=1e-3)
    # verified levels are depths 3..6 of the drafted tree: 3 and 4 accepted, 5 tried and rejected
    a = policy.est.alpha
    assert a[2] == pytest.approx(1.0, abs=1e-3) and a[3] == pytest.approx(1.0, abs=1e-3)
    assert a[4] == pytest.approx(0.0, abs=1e-3) and len(a) == 5
    assert policy.est.draft_level_ms_at[1] == pytest.approx(40.0 / 6)  # per drafted level, rebased ones too


def test_streamed_verdicts_teach_verify_cost_not_rtt():
    policy = DraftPolicy(PolicyConfig(ewma=0.5), Estimates(rtt_ms=60.0))
    for _ in range(10):
        policy.observe(Round(0, 0, 0, 0, 0, 0.0, 30.0, 30.5, streamed=True, gap_ms=30.5))
    assert policy.est.rtt_ms == 60.0 and policy.est.verify_ms_at[1] == pytest.approx(30.0)


def test_cost_estimates_from_measurements():
    e = Estimates(verify_base_ms=20.0, verify_token_ms=5.0, draft_base_ms=2.0, draft_node_ms=8.0)
    assert e.verify_ms(4) == 40.0 and e.draft_level_ms(2) == 18.0  # priors
    e.verify_ms_at[1] = 30.0
    assert e.verify_ms(3) == 40.0  # one point: the prior slope from it
    e.verify_ms_at[5] = 70.0
    assert e.verify_ms(5) == 70.0 and e.verify_ms(3) == pytest.approx(50.0)  # measured / fitted line
    e.draft_level_ms_at[1] = 20.0
    assert e.draft_level_ms(1) == 20.0 and e.draft_level_ms(2) == pytest.approx(20.0 * 18.0 / 10.0)


def test_catch_up_rate_is_learnt():
    policy = DraftPolicy()
    policy.observe_catch_up(100, 800.0)  # the first measurement replaces the prior
    assert policy.est.catch_up_ms_per_token == pytest.approx(8.0)
    policy.observe_catch_up(2, 100.0)  # too short to say anything about the rate
    policy.observe_catch_up(100, 300.0)  # then a moving average
    assert policy.est.catch_up_ms_per_token == pytest.approx(8.0 + 0.5 * (3.0 - 8.0))


def test_deterministic():
    runs = []
    for _ in range(2):
        p = DraftPolicy(PolicyConfig(explore_every=2))
        runs.append(drive(p, {"draft": (25.0,), "rounds": (23.0,), "plain": (24.0,)}, 12) + [p.shape()])
    assert runs[0] == runs[1]


def test_no_drafter_warm_up_while_cloud_only_decoding_is_the_mode():
    p = DraftPolicy(PolicyConfig(explore_every=64))
    drive(p, {"draft": (10.0,), "rounds": (11.0,), "plain": (20.0,)}, 4)
    assert p.mode == "plain" and not p.drafts and p.shape() is None


# measured rates (tokens/s) of three regimes: drafter and verifier on shared cores (drafting loses badly), a
# metro link where the modes tie, and a GPU verifier where drafting wins
REGIMES = {
    "shared cores": {"plain": (12.5,), "draft": (5.3,), "rounds": (7.6,)},
    "metro, tied": {"plain": (7.6,), "draft": (7.6,), "rounds": (6.9,)},
    "gpu verifier": {"plain": (20.0,), "draft": (34.0,), "rounds": (26.0,)},
}


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("tokens", [256, 1000, 6000])
def test_exploration_loses_at_most_its_budget(regime, tokens):
    """Against always running the best mode, a client loses at most: its first phase of cloud-only decoding,
    one early-ended probe of each other mode, and ``explore_budget`` of the time after that; on short requests
    (256 tokens) as on long lives."""
    rates = REGIMES[regime]
    c = PolicyConfig()
    p = DraftPolicy(c)
    spent = drive_tokens(p, rates, tokens)
    best = max(r[0] for r in rates.values())
    ideal_ms = 1000 * tokens / best
    first_ms = c.phase_tokens * (1000 / rates["plain"][0] - 1000 / best) + \
        2 * c.probe_tokens * (1000 / min(r[0] for r in rates.values()) - 1000 / best)
    assert sum(spent.values()) - ideal_ms <= c.explore_budget * ideal_ms + first_ms
    if regime != "metro, tied":
        assert p.favourite == max(rates, key=lambda m: rates[m][0])


def test_a_clearly_losing_probe_ends_after_probe_tokens():
    p = DraftPolicy(PolicyConfig(probe_tokens=8, abort_ratio=0.85))
    assert p.mode == "plain" and not p.drafts  # a new client starts as cloud-only decoding, drafter cold
    modes = []
    for _ in range(3 * p.config.phase_tokens):
        modes.append(p.mode)
        run_phase(p, *REGIMES["shared cores"][p.mode], tokens=1)
    assert modes.count("plain") >= 2 * p.config.phase_tokens  # measured, then kept
    assert modes.count("draft") == 8 and modes.count("rounds") == 8  # each probe cut at probe_tokens
    assert p.favourite == "plain" and not p.drafts
    # the probes lost 8 * (1/5.3 - 1/12.5) + 8 * (1/7.6 - 1/12.5) seconds against cloud-only decoding
    assert p.explore_loss_ms == pytest.approx(8000 * (1 / 5.3 - 1 / 12.5) + 8000 * (1 / 7.6 - 1 / 12.5))


def test_a_probe_that_does_not_clearly_lose_runs_its_whole_phase():
    p = DraftPolicy(PolicyConfig(probe_tokens=8, abort_ratio=0.85))
    run_phase(p, 20.0)  # plain
    assert p.mode == "draft"
    n = 0
    while p.mode == "draft":
        run_phase(p, 18.0, tokens=1)  # 0.9x plain: within abort_ratio, so measured over a whole phase
        n += 1
    assert n == p.config.phase_tokens


def test_the_drafter_warms_up_on_prompts_once_a_drafting_mode_is_the_favourite_and_measured_free():
    p = DraftPolicy()
    drive(p, REGIMES["gpu verifier"], 3)
    assert p.favourite == "draft" and p.mode == "draft"
    assert p.interference is None and not p.drafts  # its cost to the verifier unknown: after the first token
    stream(p, 31.0, True)  # a drafter on its own device: working costs the verifier nothing (30 ms idle) ...
    assert p.drafts  # ... so it warms up alongside the prefill
    stream(p, 100.0, True, n=16)  # the drafter working doubles the verifier's forwards (shared cores) ...
    assert p.interference > 1.9 and not p.drafts  # ... so it waits for the first token


def test_back_to_back_probes_add_up_in_the_wait():
    """The first measurement probes draft and rounds in a row; the favourite then runs until both losses together
    are within the budget (not just the last one's)."""
    rates = REGIMES["shared cores"]
    p = DraftPolicy()
    while not all(r.measured_ms for r in p.rates.values()):
        run_phase(p, *rates[p.mode], tokens=1)
    assert p.mode == "plain"
    wait_s = p.explore_loss_ms / 1000 / p.config.explore_budget
    assert wait_s > 35  # 1.28 s lost, at 3 %
    plain_s, modes = 0.0, set()
    while plain_s < wait_s * 0.95:
        modes.add(p.mode)
        run_phase(p, *rates[p.mode], tokens=1)
        plain_s += 1 / rates["plain"][0]
    assert modes == {"plain"}
    for _ in range(200):
        run_phase(p, *rates[p.mode], tokens=1)
        modes.add(p.mode)
    assert modes > {"plain"}  # then it looks again


@pytest.mark.parametrize("objective", ["latency", "cloud_cost"])
@pytest.mark.parametrize("good_start", [0, 12])
def test_a_favourite_that_starts_losing_is_dropped_within_its_window(objective, good_start):
    """Code, then chat: drafting won on the code and loses on the chat; the policy goes back to cloud-only
    decoding once the favourite's last 2 * ``probe_tokens`` tokens show it, not a whole phase later, even after a
    good start (the chat's first tokens as predictable as code)."""
    p = DraftPolicy(objective=objective)
    code = {"plain": (7.6, 30.0), "draft": (6.5, 30.0), "rounds": (9.0, 12.0)}
    drive(p, code, 6)
    while p.mode != "rounds":  # (a probe of the others may be running)
        run_phase(p, *code[p.mode])
    assert p.favourite == "rounds"
    for _ in range(good_start):
        run_phase(p, *code["rounds"], tokens=1)
    chat = {"plain": (7.6, 30.0), "draft": (5.0, 30.0), "rounds": (4.5, 40.0)}
    n = 0
    while p.mode == "rounds":
        run_phase(p, *chat["rounds"], tokens=1)
        n += 1
    # one window of chat; after a good start, a first cut on a mixed window may not yet be enough
    assert n == 2 * p.config.probe_tokens if not good_start else n <= 3 * p.config.probe_tokens
    assert p.favourite == "plain"
    assert p.rates["rounds"].tokens_per_s < 7.0  # it recorded the collapse, not the phase's average


def test_a_collapse_falls_back_to_cloud_only_not_to_another_drafting_mode():
    """Code, then chat, where on the code both drafting modes beat cloud-only decoding (metro, split cores): when
    the favourite collapses on the chat, the other drafting mode's code rate is no guide (acceptance fell for it
    too), so the policy decodes alone instead of losing a second window on it."""
    p = DraftPolicy()
    code = {"plain": (7.6, 30.0), "draft": (8.2, 20.0), "rounds": (9.0, 12.0)}
    drive(p, code, 8)
    while p.mode != "rounds":
        run_phase(p, *code[p.mode])
    assert p.favourite == "rounds"
    before = dict(p.tokens_by_mode)
    chat = {"plain": (7.6, 30.0), "draft": (5.0, 35.0), "rounds": (4.5, 40.0)}
    drive_tokens(p, chat, 96)
    used = {m: p.tokens_by_mode[m] - before[m] for m in chat}
    # one window of the collapse, at most one cut probe of the other drafting mode (without the scaling it took
    # over as the favourite and lost a whole window too: 24 tokens)
    assert used["rounds"] == 2 * p.config.probe_tokens and used["draft"] <= p.config.probe_tokens
    assert p.favourite == "plain"
    assert p.rates["rounds"].tokens_per_s == pytest.approx(4.5)  # the window's rate, not a blend with the code's
    assert p.rates["draft"].tokens_per_s < p.rates["plain"].tokens_per_s


def first_verdict(p, pending=0):
    """A request's first token; ``pending``: what the drafter has yet to evaluate then (a cold prompt)."""
    p.observe(Round(0, 0, 0, 0, 0, 0.0, 30.0, 900.0, streamed=True, tokens=1, gap_ms=900.0, first=True,
                    pending=pending))


@pytest.mark.parametrize("tokens,measured", [(20, True), (5, False)])
def test_a_request_ends_the_phase_it_was_in(tokens, measured):
    """A new request is judged from its own start: the last request's partial phase is recorded when it holds
    ``probe_tokens`` or more, else dropped."""
    p = DraftPolicy()
    run_phase(p, 10.0, tokens=tokens)
    first_verdict(p)
    assert p._phase == [0, 0.0, 0.0, 0.0]
    assert (p.rates["plain"].measured_ms > 0) == measured
    assert p.rates["plain"].tokens_per_s == (pytest.approx(10.0) if measured else 0.0)


def test_a_cold_drafters_catch_up_is_not_charged_to_rounds():
    """In lock-step rounds the verifier waits while a cold drafter evaluates the history (1 s here): a one-off
    that overlaps the prefill in steady state, so the mode's rate is the rounds' own."""
    p = DraftPolicy(modes=("rounds",))
    first_verdict(p)
    p.observe_catch_up(200, 1000.0, waited=True)
    p.observe(Round(1, 4, 4, 3, 3, 40.0, 60.0, 1100.0, tokens=4, gap_ms=1100.0))
    assert p._phase[:2] == [4, pytest.approx(100.0)]
    p.observe_catch_up(4, 30.0, waited=True)  # a short catch-up: part of every round
    p.observe(Round(1, 4, 4, 3, 3, 40.0, 60.0, 130.0, tokens=4, gap_ms=130.0))
    assert p._phase[:2] == [8, pytest.approx(230.0)]
    p.observe_catch_up(200, 1000.0, waited=False)  # overlapped the prefill or a streamed run: nothing to credit
    p.observe(Round(1, 4, 4, 3, 3, 40.0, 60.0, 130.0, tokens=4, gap_ms=130.0))
    assert p._phase[:2] == [12, pytest.approx(360.0)]


# -- interference and shadow chains ----------------------------------------------------------------------------------
def stream(policy, verify_ms, overlapped, n=8, gap=100.0):
    for _ in range(n):
        policy.observe(Round(0, 0, 0, 0, 0, 0.0, verify_ms, gap, streamed=True, tokens=1, gap_ms=gap,
                             overlapped=overlapped))


@pytest.mark.parametrize("solo, busy, slowdown, ok", [
    (50.0, 52.0, 1.04, True),  # a drafter on its own device: free
    (50.0, 65.0, 1.30, False),  # cores that share caches or memory: the measured 2-core VM
    (50.0, 40.0, 0.80, True),
])
def test_interference_is_measured_from_streamed_forwards_and_gates_overlap(solo, busy, slowdown, ok):
    p = DraftPolicy(PolicyConfig(shadow_gap=0))
    assert p.interference is None and p.overlap_ok and p.shadow() is None  # the idle pace is measured first ...
    stream(p, solo, False)
    assert p.shadow() == TreeShape(1, 8, 8)  # ... then the drafter may work: unmeasured interference is none
    stream(p, busy, True, n=7)
    assert p.interference is None  # 7 of 8 samples with the drafter working
    stream(p, busy, True, n=1)
    assert p.interference == pytest.approx(slowdown)
    assert p.overlap_ok is ok and (p.shadow() is not None) is ok
    stream(p, 10 * busy, True, n=3)  # a few stalls (a shared host's jitter) do not move a median
    assert p.interference == pytest.approx(slowdown)


def test_shadow_chains_only_in_plain_and_spaced_by_streamed_tokens():
    p = DraftPolicy(PolicyConfig(shadow_gap=2, shadow_depth=5))
    stream(p, 50.0, False)
    assert p.mode == "plain" and p.shadow() == TreeShape(1, 5, 5)
    p.observe_shadow(5, 2, 50.0)
    assert p.shadow() is None
    stream(p, 50.0, False, n=2)
    assert p.shadow() == TreeShape(1, 5, 5)
    p.mode = "rounds"
    assert p.shadow() is None
    assert DraftPolicy(modes=("plain",)).shadow() is None  # no drafting mode to learn for
    assert DraftPolicy(PolicyConfig(shadow_depth=0)).shadow() is None


def test_shadow_chains_teach_acceptance_and_draft_speed():
    p = DraftPolicy()
    for accepted in (8, 8, 8, 8):
        p.observe_shadow(8, accepted, 80.0)
    assert p.est.alpha[:8] == pytest.approx([1.0] * 8, abs=0.25) and min(p.est.alpha[:8]) > 0.75
    assert p.est.draft_level_ms(1) == pytest.approx(10.0)
    q = DraftPolicy()
    for _ in range(4):
        q.observe_shadow(8, 0, 80.0)
    assert q.est.alpha[0] < 0.2 and len(q.est.alpha) == 1  # only depth 1 was tried


def shadowed(policy, accepted, n=8):
    for _ in range(n):
        policy.observe_shadow(8, accepted, 40.0)


def test_a_probe_the_shadow_predicts_to_lose_is_skipped_a_few_times():
    """Plain is the favourite; this request's shadow chains match nothing: probes of drafting modes would only
    cost the user, so they are skipped (counted as lost: the interval doubles), and run after ``gate_skips``."""
    p = DraftPolicy(PolicyConfig(explore_every=1, explore_max=4), est(rtt=20.0, verify_token=20.0),
                    modes=("plain", "rounds"))
    rates = {"plain": (30.0,), "rounds": (15.0,)}  # a CPU verifier: 30 ms a token, +20 a tree node
    assert drive(p, rates, 2) == ["plain", "rounds"]  # no shadow yet: everything is measured
    shadowed(p, 0)
    assert p.predicted_rate("rounds") < 0.9 * 30.0
    skipped_before_probe = []
    for _ in range(60):
        if run_phase(p, *rates[p.mode]) == "rounds":
            skipped_before_probe.append(p.skipped_probes)
    # every time, gate_skips probes are skipped and the next one is measured anyway (the budget's wait between)
    assert skipped_before_probe == [3, 6] and p.skipped_probes == 8


def test_the_pipelined_mode_is_never_predicted_below_plain_without_interference():
    """In ``draft`` a tree only adds tokens to the verifier's own (none is sent where none pays), so only a
    working drafter's slowdown of the verifier, which the shadow measures, can make it lose."""
    p = DraftPolicy(PolicyConfig(explore_every=1), est(rtt=20.0, verify_token=20.0))
    drive(p, {"plain": (30.0,), "draft": (20.0,), "rounds": (15.0,)}, 3)
    shadowed(p, 0)
    assert p.predicted_rate("draft") >= p.rates["plain"].tokens_per_s


def test_a_mode_the_shadow_predicts_to_win_is_probed_at_once_once_per_request():
    """Code after chat: plain won on chat, the new request's shadow chains all match; lock-step rounds, which the
    model then prices above plain, are probed at the next phase end, not after the backed-off interval."""
    p = DraftPolicy(PolicyConfig(explore_every=64, explore_max=64), est(rtt=5.0), modes=("plain", "rounds"))
    rates = {"plain": (30.0,), "rounds": (20.0,)}
    drive(p, rates, 3)
    assert p.favourite == "plain" and p.mode == "plain"
    p.observe(Round(0, 0, 0, 0, 0, 0.0, 30.0, 900.0, streamed=True, tokens=1, gap_ms=900.0, first=True))
    shadowed(p, 8)
    assert p.predicted_rate("rounds") > 30.0 * 1.05
    used = drive(p, rates, 5)
    # called; it loses on the clock: back to the favourite, not called again
    assert used[1] == "rounds" and used[2:] == ["plain"] * 3 and p.called_probes == 1
    # the model promised more than the clock gave: its predictions of that mode are scaled down from now on
    # (to within what its trees taught of the link while the phase ran: the calibration blends the phase's rounds)
    assert p.calibration["rounds"] < 0.5 and p.predicted_rate("rounds") == pytest.approx(20.0, rel=0.02)
    p.observe(Round(0, 0, 0, 0, 0, 0.0, 30.0, 900.0, streamed=True, tokens=1, gap_ms=900.0, first=True))
    assert drive(p, rates, 2) == ["plain"] * 2  # the next request: no shadow evidence of its own yet
    shadowed(p, 8)
    assert drive(p, rates, 2) == ["plain"] * 2 and p.called_probes == 1  # the same text: no more calls


def test_without_shadow_evidence_in_this_request_nothing_is_gated():
    """The last request's shadow chains say nothing about this one: the policy probes exactly as one that never
    saw a shadow chain."""
    def policy():
        return DraftPolicy(PolicyConfig(explore_every=1, explore_max=4), est(rtt=20.0, verify_token=20.0))
    rates = {"plain": (30.0,), "draft": (20.0,), "rounds": (15.0,)}
    p, twin = policy(), policy()
    drive(p, rates, 3), drive(twin, rates, 3)
    shadowed(p, 0)
    new_request = Round(0, 0, 0, 0, 0, 0.0, 30.0, 900.0, streamed=True, tokens=1, gap_ms=900.0, first=True)
    p.observe(new_request), twin.observe(new_request)
    assert p.predicted_rate("rounds") is None
    used = drive(p, rates, 60)
    assert used == drive(twin, rates, 60) and p.skipped_probes == 0 and set(used) > {"plain"}


def test_predictions_use_this_requests_shadow_acceptance_not_the_last_requests():
    """Chat after code: the client's running acceptance still remembers the code (0.95 at depth 3 and below);
    this chat's shadow chains fail at depth 1, and the prediction is built on those alone."""
    def after_code(shadow_accepts):
        p = DraftPolicy(PolicyConfig(explore_every=64, explore_max=64), est(rtt=5.0, alpha=0.95, verify_token=20.0))
        drive(p, {"plain": (30.0,), "draft": (25.0,), "rounds": (20.0,)}, 3)
        p.observe(Round(0, 0, 0, 0, 0, 0.0, 30.0, 900.0, streamed=True, tokens=1, gap_ms=900.0, first=True))
        for accepted in shadow_accepts:
            p.observe_shadow(8, accepted, 40.0)
        return p
    chat, code = after_code((0, 0, 1, 0, 0, 0)), after_code((8,) * 6)
    # what the client-wide estimate still says of depth 3 and below (the lock-step phase's chainless trees faded it
    # towards the 0.7 prior)
    assert min(chat.est.alpha[2:]) > 0.8
    for mode in ("rounds", "draft"):
        assert chat.predicted_rate(mode) < 30.0 < code.predicted_rate(mode)
    assert drive(chat, {"plain": (30.0,), "draft": (25.0,), "rounds": (20.0,)}, 2) == ["plain"] * 2
    assert chat.called_probes == 0


def tree_round(accepted, ms, depth=3):
    """A lock-step tree round: a chain of ``depth`` whose first ``accepted`` nodes held, ``ms`` send to verdict."""
    return Round(1, depth, depth, accepted, accepted, 30.0, ms - 40.0, ms, tokens=accepted + 1, gap_ms=ms + 30.0)


def new_request(policy):
    policy.observe(Round(0, 0, 0, 0, 0, 0.0, 30.0, 900.0, streamed=True, tokens=1, gap_ms=900.0, first=True))


def code_then_chat(chat_accepts):
    """A client that measured plain at 10 tokens/s and lock-step rounds on code (every node accepted, 4 tokens per
    250 ms round: 16 tokens/s), then starts a request whose trees hold ``chat_accepts`` nodes each."""
    p = DraftPolicy(PolicyConfig(explore_every=64, explore_max=64), est(rtt=20.0, verify_token=20.0),
                    modes=("plain", "rounds"))
    run_phase(p, 10.0)
    assert p.mode == "rounds"
    while p._phase[0] or p.favourite != "rounds":  # the probe's phase
        p.observe(tree_round(3, 250.0))
    assert p.favourite == "rounds" and p.calibration["rounds"] > 0
    new_request(p)
    used = []
    for accepted in chat_accepts:
        used.append(p.mode)
        p.observe(tree_round(accepted, 250.0) if p.mode == "rounds" else
                  Round(0, 0, 0, 0, 0, 0.0, 30.0, 100.0, streamed=True, tokens=1, gap_ms=100.0))
    return p, used


def test_a_drafting_modes_rate_follows_this_requests_acceptance():
    """Rounds won on code; a chat's trees hold nothing: the rate rounds measured on code is not held against the
    chat. Once the chat's own trees suffice (shadow_min), the calibrated model says rounds now loses to cloud-only
    decoding, and the policy switches at once, not at the end of a phase of code's favourite."""
    chat, used = code_then_chat([0] * 8)
    n = chat.config.shadow_min
    assert used[:n] == ["rounds"] * n and set(used[n:]) == {"plain"} and chat.favourite == "plain"
    assert chat.rate_now("rounds") < chat.rates["plain"].tokens_per_s
    code, used = code_then_chat([3] * 8)  # more code: rounds stays
    assert set(used) == {"rounds"} and code.rate_now("rounds") > code.rates["plain"].tokens_per_s


def test_every_drafting_phase_calibrates_the_model_at_its_own_acceptance():
    """Lock-step chains of 3 at 280 ms a round, on code (every node held) and then on chat (one node held): the
    clock gives 4 and then 2 tokens a round, and the model at each phase's own acceptance, for the trees it ran,
    predicts both, so both phases calibrate it by the same factor, 1."""
    p = DraftPolicy(PolicyConfig(max_depth=3, widths=(1,), rate_memory=1.0, explore_every=64, explore_max=64),
                    est(rtt=20.0), modes=("rounds",))
    factors = []
    for accepted in (3, 3, 1):
        while True:
            p.observe(tree_round(accepted, 250.0))
            if p._phase[0] == 0:
                break
        factors.append(p.calibration["rounds"])
    # the model is right on both texts (to the prior it counts as one observation per depth)
    assert factors[1] == pytest.approx(1.0, rel=0.1) and factors[2] == pytest.approx(1.0, rel=0.1)


def test_decisions_record_what_ran_what_it_measured_and_what_was_chosen():
    """A losing probe of the pipelined mode, then cloud-only decoding again: the policy's decision log says so,
    with the rates it compared (what a bench keeps per request to explain a mode that ran where it lost)."""
    p = DraftPolicy(PolicyConfig(explore_every=1), modes=("plain", "draft"))
    made = p.decisions_made
    run_phase(p, 10.0)  # plain measured at 10 tokens/s; the unmeasured draft mode is probed next
    run_phase(p, 5.0)  # the probe loses
    phases = [d for d in list(p.decisions) if d["kind"] == "phase"]
    assert p.decisions_made - made == len(p.decisions) >= 2
    first, second = phases[:2]
    assert (first["ran"], first["chose"], first["measured"]) == ("plain", "draft", pytest.approx(10.0))
    assert (second["ran"], second["chose"], second["measured"]) == ("draft", "plain", pytest.approx(5.0))
    assert second["rates_now"]["plain"] == pytest.approx(10.0) and second["favourite"] == "plain"
    mark = p.mark()  # a bench's request: what ran in it, and why
    run_phase(p, 10.0)
    log = p.log_since(mark)
    assert log["tokens_by_mode"] == {"plain": p.config.phase_tokens, "draft": 0}
    assert log["decisions"] == list(p.decisions)[-1:] and log["decisions"][0]["ran"] == "plain"


def test_a_speculating_clients_rounds_are_priced_with_their_held_guesses():
    """Lock-step chains on code where every guess holds: each tree was drafted while the last verdict flew, so a
    round takes only its flight. Once the policy has seen such a free tree it prices rounds that way, so the clock
    calibrates the model by about 1 (the model without the hits is a quarter too slow: a calibration that a chat
    after the code, whose guesses fail, would wrongly inherit)."""
    def calibration(free):
        p = DraftPolicy(PolicyConfig(max_depth=3, widths=(1,), rate_memory=1.0, explore_every=64, explore_max=64),
                        est(rtt=20.0), modes=("rounds",))
        while True:
            draft_ms = 0.0 if free else 30.0
            gap = 250.0 if free else 280.0
            p.observe(Round(1, 3, 3, 3, 3, draft_ms, 210.0, 250.0, tokens=4, gap_ms=gap))
            if p._phase[0] == 0:
                return p.calibration["rounds"]
    assert calibration(free=True) == pytest.approx(1.0, rel=0.1)
    assert calibration(free=False) == pytest.approx(1.0, rel=0.1)


def test_the_tree_drafted_is_the_one_priced_at_this_requests_acceptance():
    """Code (every node held) taught the client deep chains; on a chat whose chains hold nothing, once its own
    chains suffice the policy drafts the shape best at the chat's acceptance, the one it prices the mode by."""
    p = DraftPolicy(PolicyConfig(widths=(1,), explore_every=64, explore_max=64), est(rtt=20.0), modes=("rounds",))
    new_request(p)
    assert p.shape().d >= 3  # the client-wide estimate: 0.9 at every depth
    for _ in range(p.config.shadow_min):
        s = p.shape()  # verify times on the estimate's own line (25 ms + 1 a token)
        p.observe(Round(1, s.d, s.n, 0, 0, 10.0 * s.d, 26.0 + s.n, 46.0 + s.n, tokens=1, gap_ms=56.0 + 11 * s.d))
        p.est.alpha = [0.9] * len(p.est.alpha)  # a client-wide estimate that still remembers the code
    assert p.best_shape("rounds").d >= 3  # what the client-wide estimate alone would draft
    assert p.shape().d == 1  # what the chat's own acceptance calls for


def test_a_collapse_calibrates_the_model_by_what_it_measured():
    """A collapse takes the window's rate as the mode's (not a blend with the code before), and its calibration of
    the model likewise: what the mode is worth now is what it just measured."""
    p = DraftPolicy(PolicyConfig(widths=(1,), max_depth=3, explore_every=64, explore_max=64),
                    est(rtt=20.0), modes=("plain", "rounds"))
    run_phase(p, 6.0)
    while p._phase[0] or p.favourite != "rounds":
        p.observe(tree_round(3, 150.0))
    code = p.calibration["rounds"]
    new_request(p)
    while p.mode == "rounds":  # the same chains, far slower: clearly below cloud-only decoding's 6 tokens/s
        p.observe(tree_round(3, 1200.0))
    assert p.favourite == "plain" and p.rates["rounds"].tokens_per_s < 6.0
    # the calibration is the collapsed window's alone, 0.68 of the code's here (a blend with it kept 0.84)
    assert p.calibration["rounds"] < 0.75 * code


@pytest.mark.parametrize("chains, depth, check", [
    # code: 6 chains of 8, every node held; the deep levels, tried as often as the first, sit at the text's own ~1
    ((8,) * 6, 8, lambda a: min(a) > 0.99),
    # chat: chains that fail early; level 3, tried once (a miss), sits near the text's 0.37 (0.35 with the 0.7
    # prior), and level 2's 1 of 2 at 0.46 (0.57)
    ((0, 0, 1, 0, 2, 0), 8, lambda a: a[0] < 0.35 and a[1] < 0.47 and a[2] < 0.2),
    # nothing held anywhere: the prior alone, one pseudo-observation against 6 misses
    ((0,) * 6, 8, lambda a: a == [pytest.approx(0.1 / 7)]),
])
def test_acceptance_by_depth_shrinks_to_the_texts_pooled_acceptance(chains, depth, check):
    p = DraftPolicy()
    new_request(p)
    for accepted in chains:
        p.observe_shadow(depth, accepted, 40.0)
    assert check(alpha_by_depth(p.req.tries, p.config.alpha_prior))


@pytest.mark.parametrize("chains, tries", [
    # a chain of 4 that held 2: levels 1-3 tried (the third failed), level 4 never
    ([(0, 4, 2)], [[1, 1], [1, 1], [1, 0]]),
    # all held: every level tried and accepted
    ([(0, 3, 3)], [[1, 1], [1, 1], [1, 1]]),
    # the first choice failed: one try, no hit
    ([(0, 5, 0)], [[1, 0]]),
    # below 2 rebased levels (the tokens decoded alone while it was in flight), 1 of 2 held: it tried levels 3-4
    ([(2, 2, 1)], [[0, 0], [0, 0], [1, 1], [1, 0]]),
    # counts add up over chains
    ([(0, 2, 2), (0, 2, 0), (1, 1, 1)], [[2, 1], [2, 2]]),
])
def test_a_chain_counts_the_levels_it_tried_and_those_that_held(chains, tries):
    counted: list[list[int]] = []
    for base, depth, accepted in chains:
        count_chain(counted, base, depth, accepted)
    assert counted == tries


def test_after_a_collapse_lock_step_rounds_do_not_run_again_in_that_request():
    """Chat after code, metro: the pipelined mode (the code's favourite) collapses on the chat. Then the chat's
    shadow chains happen to match, and the model, calibrated on the code, prices lock-step rounds above cloud-only
    decoding; but this request's acceptance already fell once, so they are not probed before the next request,
    which may. (The pipelined mode is judged by the clock here: its phases verified no tree to account for.)"""
    p = DraftPolicy(PolicyConfig(explore_every=64, explore_max=64), est(rtt=5.0))
    code = {"plain": (7.6, 30.0), "draft": (9.0, 12.0), "rounds": (8.2, 20.0)}
    drive(p, code, 8)
    p.est.overlap_ms = list(p.est.solo_ms)  # a drafter on its own device: measured not to slow the forwards
    while p.mode != "draft":
        run_phase(p, *code[p.mode])
    assert p.favourite == "draft"
    new_request(p)
    chat = {"plain": (7.6, 30.0), "draft": (5.0, 35.0), "rounds": (4.5, 40.0)}
    before = dict(p.tokens_by_mode)
    drive_tokens(p, chat, 2 * p.config.probe_tokens)  # the collapse's window
    assert p.mode == "plain" and p.req.collapsed
    shadowed(p, 8)
    assert p.predicted_rate("rounds") > 7.6 * 1.05  # the model alone would call a probe
    drive_tokens(p, chat, 64)
    used = {m: p.tokens_by_mode[m] - before[m] for m in chat}
    assert used["rounds"] == 0 and p.rate_now("rounds") == 0.0
    # the streamed mode, taken again on its chains' replay, verified no tree to count once it ran a phase's
    # tokens in this request (the collapse's window included): from then its clock judges it
    assert used["draft"] == p.config.phase_tokens and used["plain"] == 64 + 2 * p.config.probe_tokens - used["draft"]
    assert p.rate_now("draft") == pytest.approx(5.0)
    new_request(p)  # the next request is judged on its own text: rounds may run again
    shadowed(p, 8)
    assert p.rate_now("rounds") > 0.0 and p._predicts_win("rounds")


def test_an_uncalibrated_model_may_lower_a_rate_measured_on_another_text_but_not_raise_it():
    """Lock-step rounds measured on an earlier request, in phases too short to calibrate the model: 2x cloud-only
    decoding on code, then a chat whose shadow chains fail is not judged by that code rate; measured below it on
    chat, then code whose shadow chains all hold does not take the model's word that it now wins (a called probe
    measures that: the clock makes a favourite)."""
    def after(rounds_rate, shadow_accepts):
        p = DraftPolicy(PolicyConfig(explore_every=64, explore_max=64), est(rtt=5.0, verify_token=20.0),
                        modes=("plain", "rounds"))
        drive(p, {"plain": (10.0,), "rounds": (rounds_rate,)}, 3)
        assert "rounds" not in p.calibration and p.rates["rounds"].tokens_per_s == pytest.approx(rounds_rate)
        new_request(p)
        shadowed(p, shadow_accepts)
        return p
    chat = after(30.0, 0)
    assert chat.rate_now("rounds") == pytest.approx(chat.predicted_rate("rounds")) and chat.rate_now("rounds") < 20.0
    code = after(5.0, 8)
    assert code.predicted_rate("rounds") > 10.0 * 1.05 and code.rate_now("rounds") == pytest.approx(5.0)
    assert code._predicts_win("rounds")


def test_a_request_re_decides_on_its_own_chains_once():
    """In the pipelined mode, trees that arrive too late to use (stale) leave the chain count at ``shadow_min``:
    one re-decision, not one per verdict."""
    p = DraftPolicy(PolicyConfig(explore_every=64, explore_max=64), est(rtt=5.0), modes=("plain", "draft"))
    drive(p, {"plain": (6.5,), "draft": (13.0,)}, 3)
    new_request(p)
    made = len([d for d in p.decisions if d["kind"] == "recheck"])
    shadowed(p, 8, n=p.config.shadow_min)
    assert p.mode == p.favourite == "draft"
    for _ in range(6):
        p.observe(Round(1, 3, 3, 0, 0, 10.0, 30.0, 100.0, stale=True, tokens=1, gap_ms=100.0))
    assert p.mode == "draft" and len([d for d in p.decisions if d["kind"] == "recheck"]) - made == 1


def test_the_prediction_report_compares_each_mode_priced_with_its_rounds():
    """Lock-step trees whose verify took 20 ms more than the model's line, and whose verdicts came back 10 ms
    sooner than its round time: the report shows both, for the mode they were priced in, with the nodes verified."""
    config = PolicyConfig(widths=(1,), max_depth=3, explore_every=64, explore_max=64, alpha_prior=0.9)
    p = DraftPolicy(config, est(rtt=20.0), modes=("rounds",))  # (a request's first tree: priced at the prior)
    for _ in range(5):
        s = p.shape()
        verify = p.est.verify_ms(1 + s.n)
        p.observe(Round(1, s.d, s.n, s.d, s.d, 30.0, verify + 20.0, verify + 10.0, tokens=s.d + 1, gap_ms=verify + 40))
        p.est.verify_ms_at[1 + s.n] = verify  # (the model's line, not what it learnt from this round)
        p.est.rtt_ms = 20.0
    report = p.prediction_report()
    mode = report["by_mode"]["rounds"]
    assert report["trees"] == mode["trees"] == 5 and set(report["by_mode"]) == {"rounds"}
    assert mode["verify_ms_measured"] - mode["verify_ms_predicted"] == pytest.approx(20.0)
    assert mode["round_ms_predicted"] - mode["round_ms_measured"] == pytest.approx(10.0)
    assert mode["nodes_predicted"] == mode["nodes_measured"] == 3
    assert report["verify_ms_predicted"] == mode["verify_ms_predicted"]


def test_a_cloud_cost_probe_of_cloud_only_decoding_is_short():
    """Cloud-only decoding's rate does not depend on the text, and each of its tokens costs a whole forward: under
    the cloud-cost objective a probe of it measures ``probe_tokens`` and ends."""
    p = DraftPolicy(objective="cloud_cost")
    drive(p, {"rounds": (20.0, 10.0), "draft": (26.0, 25.0)}, 2)  # the unmeasured modes first, in order
    assert p.mode == "plain" and p.favourite != "plain"
    n = 0
    while p.mode == "plain":
        run_phase(p, 20.0, 30.0, tokens=1)
        n += 1
    assert n == p.config.probe_tokens and p.rates["plain"].measured_ms


def test_cloud_only_decoding_is_never_rated_above_one_token_a_forward():
    """Tokens arriving in a burst (decoded during the prefill, or while the drafter caught up) read as a rate the
    verifier cannot stream at: the rate is capped at one token per one-token forward."""
    p = DraftPolicy()
    p.rates["plain"].tokens_per_s, p.rates["plain"].measured_ms = 15.0, 2000.0
    assert p.rate_now("plain") == 15.0  # no forward timed yet
    p.est.verify_ms_at[1] = 400.0
    assert p.rate_now("plain") == 15.0  # nor alone (one-token forwards the drafter slowed are no bound)
    p.est.solo_ms = [140.0] * 8
    assert p.rate_now("plain") == pytest.approx(1000 / 140)
    p.req.draft_account = (30, 30 * 140 / 1.5, 8)  # the streamed mode's trees saved a third of the forwards ...
    assert p.rate_now("draft") == pytest.approx(1.5 * 1000 / 140)  # ... on top of the capped rate, not the burst's
    p.rates["plain"].tokens_per_s = 6.0  # slower than its forwards (a slow link): as measured
    assert p.rate_now("plain") == 6.0 and p.rate_now("draft") == pytest.approx(1.5 * 6.0)


def test_a_tree_landing_after_the_switch_to_plain_is_not_its_clock():
    """Lock-step rounds, then a probe of cloud-only decoding: the last tree (13 tokens at once) lands in the probe;
    its tokens are the rounds', and cloud-only decoding is clocked on the tokens it decoded itself."""
    p = DraftPolicy(PolicyConfig(explore_every=64, explore_max=64), objective="cloud_cost")
    p.mode = "plain"
    p.observe(Round(1, 12, 12, 12, 12, 0.0, 400.0, 450.0, forward_tokens=13, tokens=13, gap_ms=150.0))
    for _ in range(p.config.probe_tokens):
        p.observe(Round(0, 0, 0, 0, 0, 0.0, 140.0, 140.0, streamed=True, tokens=1, gap_ms=140.0))
    assert p.rates["plain"].tokens_per_s == pytest.approx(1000 / 140)
    assert p.rates["plain"].verifier_ms_per_token == pytest.approx(140.0)


def test_tokens_decoded_alone_while_the_drafter_catches_up_are_not_lock_step_rounds_clock():
    """A probe of lock-step rounds after cloud-only decoding: the verifier decodes alone (3x slower, the drafter's
    catch-up beside it on one host) until the first tree lands; the mode is clocked on its trees alone."""
    p = DraftPolicy(PolicyConfig(explore_every=64, explore_max=64))
    p.mode = "rounds"
    for _ in range(12):
        p.observe(Round(0, 0, 0, 0, 0, 0.0, 120.0, 120.0, streamed=True, tokens=1, gap_ms=120.0))
    assert p._phase[0] == 0  # nothing clocked: the mode has not run yet
    for _ in range(p.config.probe_tokens // 4):  # chains of 3 all held: 4 tokens a 100 ms round
        p.observe(Round(1, 3, 3, 3, 3, 20.0, 60.0, 100.0, forward_tokens=4, tokens=4, gap_ms=100.0))
    assert p._phase[0] == p.config.probe_tokens and p._phase[1] == pytest.approx(100.0 * p.config.probe_tokens / 4)


@pytest.mark.parametrize("busy_ms, rate", [
    (120.0, 25.0),  # drafter and verifier on the same cores: the shadows' 3x slowdown is theirs, not plain's
    (40.0, 25.0),  # a drafter on its own device: nothing to take out
    (44.0, 25.0),  # a slowdown of 1.1, within the gate: taken out all the same
])
def test_a_plain_phase_is_clocked_at_the_verifiers_pace_with_the_drafter_idle(busy_ms, rate):
    """The first plain phase of a client runs shadow chains until their slowdown of the verifier is measured; the
    tokens decoded meanwhile are not on its clock until then, and taken at the idle pace after, so cloud-only
    decoding is not priced below what it does."""
    p = DraftPolicy(PolicyConfig(shadow_gap=0))
    assert p.mode == "plain"
    stream(p, 40.0, False, gap=40.0)
    stream(p, busy_ms, True, n=7, gap=busy_ms)
    assert p.interference is None and p._phase[0] == 8  # the drafter's time, while its slowdown is unknown
    stream(p, busy_ms, True, n=24, gap=busy_ms)  # measured at the first: the phase's 32 tokens
    assert p._phase[0] == 0 and p.interference == pytest.approx(busy_ms / 40.0)
    assert p.rates["plain"].tokens_per_s == pytest.approx(rate)
    q = DraftPolicy(PolicyConfig(shadow_gap=0))
    stream(q, 40.0, False, gap=40.0)
    q.mode = "draft"  # in the streamed mode the drafter's work is the mode's own cost
    stream(q, busy_ms, True, n=24, gap=busy_ms)
    assert q.rates["draft"].tokens_per_s == pytest.approx(1000 * 32 / (8 * 40 + 24 * busy_ms))


def test_a_probe_of_cloud_only_decoding_is_clocked_with_the_drafter_idle():
    """Right after a drafting mode the drafter finishes its work beside the first tokens decoded alone; before that
    slowdown is measured (a cloud-cost client seldom streams alone) they are not cloud-only decoding's clock. Taken
    at face value, its 8-token probes read 22.7 tokens/s where it ran at 32-34 (shared cores, 2026-12-03)."""
    p = DraftPolicy(objective="cloud_cost")
    p._favourite, p.mode = "rounds", "plain"
    for _ in range(3):  # the drafter still busy: 90 ms a token
        p.observe(Round(0, 0, 0, 0, 0, 0.0, 90.0, 90.0, streamed=True, tokens=1, gap_ms=90.0, overlapped=True))
    assert p.interference is None and p._phase[0] == 0
    for _ in range(p.config.probe_tokens):  # then idle: 30 ms
        p.observe(Round(0, 0, 0, 0, 0, 0.0, 30.0, 30.0, streamed=True, tokens=1, gap_ms=30.0))
    assert p.mode != "plain" and p.rates["plain"].tokens_per_s == pytest.approx(1000 / 30.0)


def test_entering_lock_step_rounds_is_measured_apart_from_their_rate_and_charged_to_the_probe():
    """Entering ``rounds``, the verifier decodes alone while the drafter catches up (on shared cores 2-6x slower
    than cloud-only decoding): not the mode's rate, but what the entry lost is kept, and a probe is charged it."""
    p = DraftPolicy(modes=("plain", "rounds"))
    p.rates["plain"].add(1000 / 30.0, 30.0, 5000.0, 1.0)
    p._favourite, p.mode = "plain", "rounds"  # a probe of lock-step rounds
    for _ in range(10):  # the entry: 150 ms a token beside the drafter's catch-up, where cloud-only decoding takes 30
        p.observe(Round(0, 0, 0, 0, 0, 0.0, 150.0, 150.0, streamed=True, tokens=1, gap_ms=150.0, overlapped=True))
    assert p._phase[0] == 0 and p._phase_entry == [10, 1500.0, 0.0]
    for _ in range(8):  # then chains of 3 that held: 4 tokens a 95 ms round, 42 tokens/s
        p.observe(Round(1, 3, 3, 3, 3, 20.0, 60.0, 95.0, forward_tokens=4, tokens=4, gap_ms=95.0))
        assert p._phase_entry[2] in (0.0, 20.0)  # (the first tree's drafting: part of the entry's work)
    assert p.rates["rounds"].tokens_per_s == pytest.approx(1000 * 4 / 95.0)
    assert p.entry_loss_ms == pytest.approx(1500.0 - 10 * 30.0)
    assert p.explore_loss_ms == pytest.approx(1500.0 + 8 * 95.0 - 42 * 30.0)  # (its trees alone lost nothing)
    assert p.favourite == p.mode == "rounds"  # entered: the rest of this request is judged on the mode's rate


@pytest.mark.parametrize("mode", ["rounds", "draft"])  # (the same catch-up enters either)
@pytest.mark.parametrize("entry_loss_ms, stays", [
    (None, True),  # never measured
    (100.0, True),  # a drafter on its own cores catches up beside the verifier at little cost
    (1200.0, False),  # shared cores: 96 tokens at 42 tokens/s and the entry make 27.5, cloud-only decoding 33
])
def test_a_request_enters_a_drafting_mode_only_where_its_entry_pays(mode, entry_loss_ms, stays):
    p = DraftPolicy(modes=("plain", mode))
    p.rates["plain"].add(1000 / 30.0, 30.0, 5000.0, 1.0)
    p.rates[mode].add(42.0, 8.0, 5000.0, 1.0)
    p._favourite = p.mode = mode
    p.entry_loss_ms, p._tokens_per_request = entry_loss_ms, 96.0
    first_verdict(p)
    assert p.favourite == p.mode == (mode if stays else "plain")
    assert [(d["kind"], d["chose"]) for d in p.decisions] == [("request", p.mode)]


def test_a_blind_probe_of_a_mode_the_last_text_predicted_to_lose_pays_its_expected_loss_first():
    """No entry priced at all, but the last text's chains put lock-step rounds at 15 tokens/s against cloud-only
    decoding's 33: the probe's 8 tokens would lose 0.28 s, which waits for 9.3 s of the favourite at 3 %."""
    p = DraftPolicy(modes=("plain", "rounds"))
    for _ in range(p.config.shadow_min):  # chains that fail at their first node
        p.observe_shadow(4, 0, 40.0)
    run_phase(p, 1000 / 30.0, pending=150)
    predicted = p._gate_lost["rounds"]
    loss_ms = p.config.probe_tokens * (1000 / predicted - 30.0)
    first_verdict(p)  # a new request: no chains of its own, and no entry priced (none measured, no slowdown known)
    assert p._entry_due_ms("rounds") is None
    modes = [run_phase(p, 1000 / 30.0, pending=150) for _ in range(20)]
    first = modes.index("rounds")
    assert 960.0 * first < loss_ms / p.config.explore_budget <= 960.0 * (first + 2)


@pytest.mark.parametrize("mode, free", [("draft", True), ("rounds", False), ("plain", True)])
def test_only_the_drafting_mode_in_force_is_entered_free(mode, free):
    """In the streamed mode, its trees flowing but the drafter 79 tokens behind (on shared cores it sends few):
    lock-step rounds are entered on that backlog, priced, not as if the drafter were caught up."""
    p = DraftPolicy()
    p.observe_catch_up(100, 800.0)
    p.entry_ratio = 1.0
    p._favourite = p.mode = "draft"
    p.observe(Round(1, 3, 3, 0, 0, 20.0, 60.0, 95.0, forward_tokens=4, tokens=1, gap_ms=95.0, pending=79))
    due = p._entry_due_ms(mode)
    assert due is None if free else due >= 8.0 * 79


@pytest.mark.parametrize("pending, incumbent", [(0, "rounds"), (150, "plain")])
def test_a_drafting_favourite_the_drafter_must_catch_up_for_is_entered_as_a_switch(pending, incumbent):
    """Lock-step rounds entering at 34.2 tokens/s (42, less a 0.52 s entry over 95 tokens) against cloud-only
    decoding's 33.3: inside the 5 % band. With the drafter warmed up on the prompt the favourite holds; with a cold
    prompt to catch up on, the request starts in cloud-only decoding and rounds must beat it by the band."""
    p = DraftPolicy(modes=("plain", "rounds"))
    p.rates["plain"].add(1000 / 30.0, 30.0, 5000.0, 1.0)
    p.rates["rounds"].add(42.0, 8.0, 5000.0, 1.0)
    p._favourite = p.mode = "rounds"
    p.entry_loss_ms, p._tokens_per_request = 516.0, 96.0
    first_verdict(p, pending=pending)
    assert p._entering_rate("rounds") == pytest.approx(34.2, abs=0.05)
    assert p.favourite == p.mode == incumbent
    assert p.decisions[-1]["incumbent"] == incumbent and p.decisions[-1]["pending"] == pending


def test_an_entry_is_measured_per_ms_of_the_catch_up_it_waited_on():
    """The entry of the test above, the drafter catching up on 150 tokens at 8 ms each, then drafting its first
    tree in 20 ms: it lost 1.2 s of that 1.22 s of work. That ratio, not the 1.2 s, prices the next entry: the
    catch-up's part scales with what the drafter has to catch up on."""
    p = DraftPolicy(modes=("plain", "rounds"))
    p.rates["plain"].add(1000 / 30.0, 30.0, 5000.0, 1.0)
    p.observe_catch_up(150, 1200.0)
    p.observe(Round(0, 0, 0, 0, 0, 0.0, 30.0, 30.0, streamed=True, tokens=1, gap_ms=30.0, pending=150))
    p._new_phase()  # (the probe begins on that verdict: the drafter has 150 tokens to catch up on)
    p._favourite, p.mode = "plain", "rounds"
    for _ in range(10):
        p.observe(Round(0, 0, 0, 0, 0, 0.0, 150.0, 150.0, streamed=True, tokens=1, gap_ms=150.0, overlapped=True))
    for _ in range(8):
        p.observe(Round(1, 3, 3, 3, 3, 20.0, 60.0, 95.0, forward_tokens=4, tokens=4, gap_ms=95.0))
    assert p.entry_loss_ms == pytest.approx(1200.0)
    ratio = 1200.0 / (8.0 * 150 + 20.0)
    assert p.entry_ratio == pytest.approx(ratio)
    priced = {}
    for pending in (15, 150):
        p.observe(Round(1, 3, 3, 3, 3, 20.0, 60.0, 95.0, forward_tokens=4, tokens=4, gap_ms=95.0, pending=pending))
        priced[pending] = p._entry_ms()
    assert priced[150] - priced[15] == pytest.approx(ratio * 8.0 * 135)
    assert ratio * 8.0 * 15 < priced[15] < ratio * (8.0 * 15 + 12 * 20.0)  # (and a first tree of up to 12 levels)


@pytest.mark.parametrize("pending, stays", [
    (13, True),  # the drafter caught up but for a few tokens: 96 tokens at 42 tokens/s and 104 ms make 40.3
    (150, False),  # a cold 150-token prompt: 1.2 s of catch-up, 27.5 tokens/s against cloud-only decoding's 33
])
def test_a_requests_entry_is_priced_on_what_the_drafter_has_to_catch_up_on(pending, stays):
    p = DraftPolicy(modes=("plain", "rounds"))
    p.rates["plain"].add(1000 / 30.0, 30.0, 5000.0, 1.0)
    p.rates["rounds"].add(42.0, 8.0, 5000.0, 1.0)
    p._favourite = p.mode = "rounds"
    p.observe_catch_up(100, 800.0)
    p.entry_loss_ms, p.entry_ratio, p._tokens_per_request = 300.0, 1.0, 96.0  # (300 ms: a short catch-up's)
    first_verdict(p, pending=pending)
    assert p.favourite == p.mode == ("rounds" if stays else "plain")


@pytest.mark.parametrize("slowdown, share", [(3.0, 2 / 3), (1.0, None)])
def test_a_first_entry_is_priced_where_the_drafter_is_measured_to_slow_the_verifier(slowdown, share):
    """No entry measured yet: where a working drafter makes the verifier s-fold slower, an entry loses the
    1 - 1/s of the catch-up in which cloud-only decoding would have made its tokens. Where it costs nothing
    (its own cores), nothing is guessed."""
    p = DraftPolicy(modes=("plain", "rounds"))
    p.observe_catch_up(100, 800.0)
    p.est.solo_ms[:] = [30.0] * p.config.overlap_samples
    p.est.overlap_ms[:] = [30.0 * slowdown] * p.config.overlap_samples
    first_verdict(p, pending=150)
    if share is None:
        assert p._entry_ms() is None
    else:
        shape = p.best_shape("rounds", est=p._request_est())
        assert p._entry_ms() == pytest.approx(share * (8.0 * 150 + shape.d * p.est.draft_level_ms(shape.k)))


@pytest.mark.parametrize("ratio, first_probe", [
    (None, 3),  # entries unpriced: the schedule's probe once ``explore_every`` phases ended
    (1.0, 42),  # a 1.22 s entry (a cold 150-token prompt) waits until 0.96 s phases pay for it at 3 %: 40.7 s
])
def test_a_scheduled_probe_waits_until_the_budget_pays_its_entry(ratio, first_probe):
    p = DraftPolicy(modes=("plain", "rounds"))
    p.rates["rounds"].add(30.0, 8.0, 5000.0, 1.0)  # measured, below cloud-only decoding's 33: only a probe
    run_phase(p, 1000 / 30.0, pending=150)  # (plain's own first phase)
    p.observe_catch_up(100, 800.0)
    p.entry_ratio = ratio
    modes = [run_phase(p, 1000 / 30.0, pending=150) for _ in range(60)]
    assert modes.index("rounds") == first_probe
    if ratio is not None:  # (the phases before it: the initial one and ``first_probe``)
        assert 960.0 * first_probe < p._entry_ms() / p.config.explore_budget <= 960.0 * (first_probe + 1)


@pytest.mark.parametrize("shadows_said_lose, probed", [(False, True), (True, False)])
def test_an_unmeasured_mode_the_last_text_predicted_to_lose_is_probed_once_its_entry_is_paid_for(
    shadows_said_lose, probed
):
    """Shadow chains are off where the drafter slows the verifier, so a new request has no prediction of its own:
    a mode the last text's chains said would lose is not probed blind on it, paying a cold prompt's entry (0.9 s on
    shared cores), until the budget covers that; one never judged is measured at once."""
    p = DraftPolicy(modes=("plain", "rounds"))
    p.observe_catch_up(100, 800.0)
    p.entry_ratio = 1.0
    if shadows_said_lose:  # chains that fail at their first node: rounds at 15 tokens/s against cloud-only's 33
        for _ in range(p.config.shadow_min):
            p.observe_shadow(4, 0, 40.0)
    run_phase(p, 1000 / 30.0, pending=150)
    assert p.mode == ("plain" if shadows_said_lose else "rounds")
    p._new_phase()
    p.mode = "plain"
    first_verdict(p, pending=150)  # a new request: no chains of its own
    run_phase(p, 1000 / 30.0, pending=150)
    assert (p.mode == "rounds") == probed
    assert ("rounds" in p._gate_lost) == shadows_said_lose


@pytest.mark.parametrize("trees, measured", [(1, False), (2, True)])
def test_a_rate_is_measured_on_two_verdicts_not_one_lucky_tree(trees, measured):
    """A probe of lock-step rounds cut by the request's end after one tree of 8 tokens (47 tokens/s, where the mode
    runs at 30): one tree is no rate, and the next request must not start in the mode on it."""
    p = DraftPolicy(modes=("plain", "rounds"))
    p.rates["plain"].add(1000 / 30.0, 30.0, 5000.0, 1.0)
    p._favourite, p.mode = "plain", "rounds"
    for _ in range(trees):  # chains of 7 that all held: 8 tokens in 170 ms
        p.observe(Round(1, 7, 7, 7, 7, 20.0, 60.0, 170.0, forward_tokens=8, tokens=8, gap_ms=170.0))
    assert p.mode == "rounds"  # (a probe of one tree is not cut either)
    first_verdict(p)
    assert bool(p.rates["rounds"].measured_ms) == measured
    assert p.favourite == p.mode == ("rounds" if measured else "plain")


def test_a_request_is_entered_on_its_own_evidence_not_the_last_requests():
    """The last request's text ran lock-step rounds at 58 tokens/s; the client's rate for them is 36. The new
    request, whose text is unknown, pays the entry (0.9 s) at the client's rate: 96 tokens at 36 tokens/s and the
    entry make 26.9, cloud-only decoding 33. Judged on the last text, the entry would have paid (37.4)."""
    p = DraftPolicy(modes=("plain", "rounds"))
    p.rates["plain"].add(1000 / 30.0, 30.0, 5000.0, 1.0)
    p.rates["rounds"].add(36.0, 8.0, 5000.0, 1.0)
    p._favourite = p.mode = "rounds"
    p.req.rates["rounds"] = [120, 2000.0, 960.0]  # (this request's text: 60 tokens/s)
    p.entry_loss_ms, p._tokens_per_request, p._request_tokens = 900.0, 96.0, 88
    for _ in range(2):  # the last request ends on a partial phase at the client's rate
        p.observe(Round(1, 3, 3, 3, 3, 20.0, 60.0, 1000 * 4 / 36, forward_tokens=4, tokens=4, gap_ms=1000 * 4 / 36))
    first_verdict(p)
    assert p.rates["rounds"].tokens_per_s == pytest.approx(36.0)
    assert p.favourite == p.mode == "plain"
    assert p.decisions[-1]["kind"] == "request"


def test_requests_lengths_are_counted_from_first_verdict_to_first_verdict():
    p = DraftPolicy(modes=("plain",))
    for _ in range(2):
        first_verdict(p)
        for _ in range(39):
            p.observe(verdict(p, 30.0))
    first_verdict(p)
    assert p._tokens_per_request == pytest.approx(40.0) and p._request_tokens == 1


def test_the_streamed_mode_leaves_a_request_at_what_its_trees_saved_not_its_clock():
    """A phase of the streamed mode whose trees saved nothing is cloud-only decoding under another name: its clock
    (27.8 tokens/s, within the noise of plain's 26.3) must not carry it past cloud-only decoding in the next
    request, before that text has shown anything."""
    p = DraftPolicy(PolicyConfig(explore_every=64, explore_max=64))
    p.rates["plain"].tokens_per_s, p.rates["plain"].measured_ms = 1000 / 38, 5000.0
    p.est.solo_ms = [38.0] * 8
    p.mode = "draft"  # a probe, cloud-only decoding the favourite
    p.req.draft_account = (24, 24 * 38.0, 8)  # 8 trees so far, each token a whole forward: nothing saved
    run_phase(p, 27.8, verifier_ms=38.0)
    assert p.draft_saved() == pytest.approx(1.0) and p.favourite == "plain"
    assert p.rates["draft"].tokens_per_s == pytest.approx(1000 / 38)  # not the clock's 27.8
    new_request(p)
    assert p.rate_now("draft") == pytest.approx(1000 / 38) and p._best_mode() == "plain"


def test_a_collapse_of_the_last_requests_shapes_does_not_rule_their_mode_out():
    """Chat after code: lock-step rounds, the favourite, draft the code's deep chains and collapse before this
    request's chains suffice to re-shape them. The window is those shapes failing here, not this text's clock for
    rounds: once the chains suffice, the model prices the chain this text calls for (and the collapse still keeps
    modes that never ran here out)."""
    p = DraftPolicy(PolicyConfig(shadow_min=24), est(rtt=20.0, verify_token=20.0))
    p.rates["plain"].tokens_per_s, p.rates["plain"].measured_ms = 7.0, 5000.0
    p.rates["rounds"].tokens_per_s, p.rates["rounds"].measured_ms = 14.0, 5000.0
    p.calibration["rounds"] = 1.0  # (on the code)
    p._favourite = p.mode = "rounds"
    new_request(p)
    while p.mode == "rounds":  # deep chains, one token a round: 2 tokens/s
        p.observe(Round(1, 12, 12, 0, 0, 40.0, 200.0, 500.0, forward_tokens=13, tokens=1, gap_ms=500.0,
                        forward_ms=200.0))
    assert p.req.collapsed and not p.req.rechecked and p.favourite == "plain"
    assert "rounds" not in p.req.rates and not p._ruled_out("rounds") and p._ruled_out("draft")
    shadowed(p, 3, n=24)
    assert p.rate_now("rounds") == pytest.approx(p.predicted_rate("rounds")) and p.rate_now("rounds") > 2.0


def test_cloud_only_decoding_costs_at_least_a_forward_a_token():
    """A plain phase whose tokens arrived in a burst reads cheaper than the verifier can decode: its cost is never
    below a one-token forward a token (else the cloud-cost objective takes cloud-only decoding for the cheapest)."""
    p = DraftPolicy(objective="cloud_cost")
    p.rates["plain"].verifier_ms_per_token, p.rates["plain"].measured_ms = 65.0, 2000.0
    assert p.cost_now("plain") == 65.0  # no forward timed yet
    p.est.solo_ms = [140.0] * 8
    assert p.cost_now("plain") == 140.0


def test_a_requests_first_trees_are_shaped_on_its_own_chains_not_the_last_requests():
    """Chat after code: the client's running acceptance is the code's (every first choice held), which calls for the
    deepest chain; the new request's first tree is shaped at the prior instead, and its own chains then move it."""
    p = DraftPolicy(PolicyConfig(explore_every=64, explore_max=64), est(rtt=20.0, alpha=1.0, verify_token=20.0),
                    modes=("rounds",))
    code = p.best_shape("rounds")
    new_request(p)
    first = p.shape()
    assert first.d < code.d
    p.observe(Round(1, first.d, first.n, 0, 0, 30.0, 100.0, 150.0, tokens=1, gap_ms=150.0))  # the chat: none held
    assert p.shape().d <= first.d
