"""The draft policy's closed form (edge/policy/closed_form.py) against examples worked by hand."""
import pytest

from tandem.core.tree import TreeShape
from tandem.edge.policy import closed_form as cf


def physics(t1=25.0, per_token=5.0, level=10.0, rtt=15.0, slowdown=1.0, proactive=False):
    """A verifier whose forward of n tokens takes t1 - per_token + per_token * n ms."""
    return cf.Physics(lambda n: t1 + per_token * (n - 1), lambda k: level * k, rtt, slowdown, proactive)


@pytest.mark.parametrize("alpha, width, depth, start, expected", [
    ([0.5, 0.5], 1, 2, 0, 1 + 0.5 + 0.25),
    ([0.5, 0.5], 2, 2, 0, 1 + 0.75 + 0.75 ** 2),  # a_d(2) = 1 - (1 - 0.5)^2
    ([0.8], 1, 3, 0, 1 + 0.8 + 0.64 + 0.512),  # depths past the estimates take the deepest
    ([0.8, 0.8, 0.8, 0.5], 1, 4, 3, 1 + 0.5),  # below three levels already committed
    ([0.9], 1, 0, 0, 1.0),  # no tree: the bonus alone
])
def test_expected_tokens(alpha, width, depth, start, expected):
    assert cf.expected_tokens(alpha, width, depth, start) == pytest.approx(expected)


def test_cloud_only_decoding():
    o = cf.plain(physics(t1=25.0))
    assert (o.mode, o.shape, o.rate, o.cost_ms) == ("plain", None, pytest.approx(40.0), 25.0)


def test_a_lock_step_round():
    # chain of 2 at alpha 0.8: 2.44 tokens in draft 20 + RTT 15 + t_v(3) = 35, i.e. 70 ms
    o = cf.lockstep(physics(), [0.8], 1, 2)
    assert o.shape == TreeShape(1, 2, 2)
    assert o.rate == pytest.approx(1000 * 2.44 / 70) and o.cost_ms == pytest.approx(35 / 2.44)
    # proactive: the guess holds with 0.8^3 = 0.512, and then 3 levels (30 ms) hide inside the 50 ms flight
    p = cf.lockstep(physics(proactive=True), [0.8], 1, 2)
    assert p.rate == pytest.approx(1000 * 2.44 / ((1 - 0.512) * 20 + 50))


def test_a_streamed_cycle():
    # depth 4: lands ceil((15 + 5 * 10) / 25) = 3 tokens late; survives 0.8^3 = 0.512; then one forward of 2 tokens
    # (30 ms) commits 1 + 0.8 tokens; else one more token alone
    o = cf.streamed(physics(), [0.8], 1, 4)
    tokens = 3 + 0.512 * 1.8 + 0.488
    ms = 3 * 25 + 0.512 * 30 + 0.488 * 25
    assert o.mode == "draft" and o.rate == pytest.approx(1000 * tokens / ms) and o.cost_ms == pytest.approx(
        ms / tokens)
    assert cf.streamed(physics(), [0.8], 1, 3) is None  # lands after the verifier decoded past all of it
    slowed = cf.streamed(physics(slowdown=2.0, rtt=40.0), [0.8], 1, 4)  # 50 ms a token alone: lands 2 late
    assert slowed.rate == pytest.approx(1000 * (2 + 0.64 * 2.44 + 0.36) / (100 + 0.64 * 35 + 0.36 * 50))


@pytest.mark.parametrize("entry_ms, slowdown, left, expected", [
    (0.0, 1.0, 100, 60.0),  # nothing to catch up
    (500.0, 1.0, 100, 100 / (0.5 + 80 / 60)),  # 20 tokens at cloud-only's 40/s meanwhile, the rest at 60/s
    (500.0, 2.0, 100, 100 / (0.5 + 90 / 60)),  # ... at half that pace beside the drafter
    (5000.0, 1.0, 100, 40.0),  # the request is over before the drafter catches up
])
def test_an_entry_is_paid_once_over_the_tokens_left(entry_ms, slowdown, left, expected):
    mode = cf.Option("rounds", TreeShape(1, 4, 4), 60.0, 10.0)
    assert cf.entered(mode, cf.Option("plain", None, 40.0, 25.0), entry_ms, left, slowdown) == pytest.approx(expected)


PLAIN, FAST, CHEAP = (cf.Option("plain", None, 40.0, 25.0), cf.Option("draft", TreeShape(1, 4, 4), 50.0, 20.0),
                      cf.Option("rounds", TreeShape(1, 6, 6), 41.0, 9.0))


@pytest.mark.parametrize("candidates, current, objective, expected", [
    ([PLAIN, FAST, CHEAP], "plain", "latency", FAST),
    ([PLAIN, CHEAP], "plain", "latency", PLAIN),  # 41 is within the 5 % hysteresis of 40
    ([PLAIN, CHEAP], "rounds", "latency", CHEAP),  # ... and 40 within it of 41: the mode in force stays
    ([PLAIN, FAST, CHEAP], "plain", "cloud_cost", CHEAP),  # the cheapest no slower than cloud-only
    ([PLAIN, FAST, cf.Option("rounds", None, 30.0, 5.0)], "plain", "cloud_cost", FAST),  # too slow to count
])
def test_choice(candidates, current, objective, expected):
    chosen, best = cf.choose(candidates, current, objective, 0.05, lambda o: o.rate)
    assert chosen == expected and best[expected.mode] == expected


def test_options_span_every_mode_width_and_depth():
    found = cf.options(physics(), [0.8], (1, 2), 6)
    assert found[0].mode == "plain"
    assert {(o.mode, o.shape.k, o.shape.d) for o in found[1:] if o.mode == "rounds"} == {
        ("rounds", k, d) for k in (1, 2) for d in range(1, 7)}
    assert all(o.shape.d > 3 for o in found if o.mode == "draft")  # the shallower land too late


def test_the_edges_turn_between_rounds_counts_once_per_round():
    # a 30 ms turn (commit, catch-up) before each round's drafting: 2.44 tokens in 100 ms
    o = cf.lockstep(physics(), [0.8], 1, 2)
    turned = cf.lockstep(cf.Physics(lambda n: 25.0 + 5.0 * (n - 1), lambda k: 10.0 * k, 15.0, turn_ms=30.0),
                         [0.8], 1, 2)
    assert turned.rate == pytest.approx(1000 * 2.44 / 100) and turned.rate < o.rate
    assert cf.late(physics(), 1, 4) == 3 and cf.late(cf.Physics(lambda n: 25.0, lambda k: 10.0, 15.0, turn_ms=30.0),
                                                     1, 4) == 4


def test_host_drafted_chains():
    # the host drafts a chain of 2 at 4 ms a level, no link: 2.44 tokens in 8 + t_v(3) = 43 ms
    p = cf.Physics(lambda n: 25.0 + 5.0 * (n - 1), lambda k: 10.0 * k, 15.0, host_level_ms=4.0)
    o = cf.hosted(p, [0.8], 2)
    assert (o.mode, o.shape) == ("host", TreeShape(1, 2, 2))
    assert o.rate == pytest.approx(1000 * 2.44 / 43) and o.cost_ms == pytest.approx(35 / 2.44)
    assert {o.shape.d for o in cf.options(p, [0.8], (1,), 5) if o.mode == "host"} == {1, 2, 3, 4, 5}
    assert not [o for o in cf.options(physics(), [0.8], (1,), 5) if o.mode == "host"]  # no host drafter
