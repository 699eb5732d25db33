"""The draft policy (edge/policy) driven through the Planner API by scripted worlds: a verifier curve, a link,
a drafter and a text's acceptance produce the verdicts the round loop would report. Each test states the mode the
physics call for and checks the policy's decisions (its log), never its internals."""
import math
import random

import pytest

from tandem.edge.planner import Round
from tandem.core.tree import TreeShape
from tandem.edge.policy import DraftPolicy, PolicyConfig


class World:
    """Forwards of n tokens take t1 + per_token * (n - 1) ms; the drafter ``level`` ms a level; the link ``rtt``;
    each first choice is the target's token with probability ``alpha`` (seeded). ``clock``: how much slower a
    drafting mode's verdicts arrive than the physics say (what the model cannot see: a drafter slowing the
    verifier, say)."""

    def __init__(self, t1=25.0, per_token=5.0, level=10.0, rtt=15.0, alpha=0.8, clock=1.0, seed=0):
        self.t1, self.per_token, self.level, self.rtt, self.alpha, self.clock = t1, per_token, level, rtt, alpha, clock
        self.rng = random.Random(seed)

    def tv(self, n: int) -> float:
        return self.t1 + self.per_token * (n - 1)

    def held(self, depth: int) -> int:
        n = 0
        while n < depth and self.rng.random() < self.alpha:
            n += 1
        return n

    def alone(self, policy, first=False, pending=0, overlapped=False) -> None:
        policy.observe(Round(0, 0, 0, 0, 0, 0.0, self.tv(1), self.tv(1), streamed=True, tokens=1,
                             gap_ms=self.tv(1), first=first, overlapped=overlapped, pending=pending))

    def request(self, policy, tokens: int, pending: int = 0, partition: str = "") -> None:
        policy.new_request(partition)
        self.alone(policy, first=True, pending=pending)
        self.go(policy, tokens - 1, pending)

    def go(self, policy, tokens: int, pending: int = 0) -> None:
        """The request goes on for ``tokens`` more."""
        done = 0
        while done < tokens:
            shape = policy.shape(pending)
            pending = max(0, pending - 50)  # the drafter catches up between verdicts
            if shape is None:
                self.alone(policy)
                done += 1
                if (s := policy.shadow(0)) is not None:
                    policy.observe_shadow(s.d, self.held(s.d), s.d * self.level)
            elif policy.stream:
                done += self._streamed(policy, shape)
            else:
                held, nodes = self.held(shape.d), shape.n
                forward = self.tv(1 + nodes)
                policy.observe(Round(shape.k, shape.d, nodes, held, held, shape.d * self.level, forward,
                                     self.rtt + forward, tokens=held + 1, forward_tokens=1 + nodes,
                                     gap_ms=self.clock * (shape.d * self.level + self.rtt + forward),
                                     tried_levels=min(shape.d, held + 1), held_levels=held))
                done += held + 1

    def _streamed(self, policy, shape) -> int:
        late = math.ceil((self.rtt + (shape.d + 1) * self.level) / self.t1)
        for _ in range(late):
            self.alone(policy, overlapped=True)
        held = self.held(shape.d)
        if held < late or late >= shape.d:
            policy.observe(Round(shape.k, 0, 0, 0, 0, shape.d * self.level, self.t1, self.rtt + self.t1,
                                 rebased=late, stale=True, gap_ms=self.clock * self.t1,
                                 tried_levels=min(shape.d, held + 1), held_levels=held))
            return late + 1
        left = shape.d - late
        forward = self.tv(1 + shape.k * left)
        policy.observe(Round(shape.k, left, shape.k * left, held - late, held - late, shape.d * self.level, forward,
                             self.rtt + forward, rebased=late, forward_tokens=1 + shape.k * left,
                             tokens=held - late + 1, gap_ms=self.clock * forward,
                             tried_levels=min(shape.d, held + 1), held_levels=held))
        return late + held - late + 1


def decisions(policy, kind=None):
    return [d for d in policy.decisions if kind is None or d["kind"] == kind]


GPU = dict(t1=20.0, per_token=0.3, level=6.0, rtt=20.0)  # a flat verifier curve, a quick drafter, a metro link
CPU = dict(t1=25.0, per_token=12.0, level=20.0, rtt=1.0)  # k tokens cost ~k/2 forwards; a slow drafter beside it


def test_a_new_client_starts_in_cloud_only_decoding():
    policy = DraftPolicy()
    World(**GPU).request(policy, 1)
    (first,) = decisions(policy)
    assert first["kind"] == "request" and first["chose"] == "plain" and policy.mode == "plain"
    assert set(first["modes"]) == {"plain", "draft", "rounds"} and "t1_ms" in first["inputs"]


def test_a_well_drafted_text_on_a_flat_curve_is_drafted_and_a_poorly_drafted_one_is_not():
    good, poor = DraftPolicy(), DraftPolicy()
    World(alpha=0.9, **GPU).request(good, 160)
    World(alpha=0.1, **GPU).request(poor, 160)
    assert good.mode != "plain" and good.tokens_by_mode["plain"] < 80  # the shadow chains said so at 32
    assert poor.mode == "plain" and poor.tokens_by_mode["plain"] == 160
    switch = next(d for d in decisions(good) if d["chose"] != "plain")
    alpha = switch["inputs"]["alpha"]
    assert switch["inputs"]["chains"] >= 4 and sum(alpha) / len(alpha) > 0.8  # on this text's chains, not the prior
    assert switch["modes"][switch["chose"]]["rate"] > switch["modes"]["plain"]["rate"] * 1.05


def test_a_steep_curve_and_a_slow_drafter_keep_cloud_only_decoding():
    policy = DraftPolicy()
    World(alpha=0.8, **CPU).request(policy, 160)
    assert policy.tokens_by_mode["plain"] == 160
    last = decisions(policy)[-1]
    assert all(m["rate"] < last["modes"]["plain"]["rate"] for name, m in last["modes"].items() if name != "plain")


def test_a_drafting_mode_running_below_cloud_only_by_the_clock_is_left_for_the_request():
    """The model sees a fast mode; the clock says it runs at a third of its pace: the guard sends the rest of the
    request to cloud-only decoding; the next request is priced afresh."""
    policy, world = DraftPolicy(), World(alpha=0.9, clock=3.0, **GPU)
    world.request(policy, 200)
    (guard,) = decisions(policy, "guard")
    assert guard["chose"] == "plain" and guard["was"] != "plain"
    after = [d for d in decisions(policy) if d["tokens"] > guard["tokens"]]
    assert after and all(d["chose"] == "plain" and set(d["modes"]) == {"plain"} for d in after)
    world.request(policy, 40)
    assert set(decisions(policy, "request")[-1]["modes"]) == {"plain", "draft", "rounds"}


def test_the_cloud_cost_objective_takes_the_fewest_verifier_ms_no_slower_than_cloud_only():
    policy = DraftPolicy(objective="cloud_cost")
    World(alpha=0.9, **GPU).request(policy, 160)
    d = next(d for d in decisions(policy) if d["chose"] != "plain")
    chosen = d["modes"][d["chose"]]
    assert chosen["cost_ms"] == min(m["cost_ms"] for m in d["modes"].values())
    assert chosen["rate"] >= 0.95 * d["modes"]["plain"]["rate"]
    assert policy.tokens_by_mode["rounds"] > 0


def test_one_callers_text_never_shapes_anothers_request():
    """A pooled client serves caller a's well-drafted text, then caller b: b's first decision prices acceptance at
    the prior, not at a's; a's next request starts from a's."""
    policy = DraftPolicy()
    world = World(alpha=0.95, **GPU)
    world.request(policy, 200, partition="a")
    world.request(policy, 1, partition="b")
    b_first = decisions(policy, "request")[-1]["inputs"]["alpha"]
    assert b_first == [pytest.approx(PolicyConfig().alpha_prior)] * len(b_first)
    world.request(policy, 1, partition="a")
    assert decisions(policy, "request")[-1]["inputs"]["alpha"][0] > 0.85


def test_a_cold_prompt_prices_the_drafters_catch_up_into_drafting():
    policy, world = DraftPolicy(), World(alpha=0.9, **GPU)
    world.request(policy, 200)
    assert policy.mode != "plain"
    world.request(policy, 1, pending=2000)  # a long new prompt the drafter has not seen
    d = decisions(policy, "request")[-1]
    assert d["inputs"]["pending"] == 2000 and d["modes"]["rounds"]["entry_ms"] > 2000 * 1.9  # catch-up ~2 ms a token
    assert d["chose"] == "plain"  # a 200-token request cannot repay four seconds of catching up


def test_decisions_at_request_start_on_the_texts_first_chains_and_every_decide_tokens():
    policy = DraftPolicy(PolicyConfig(decide_tokens=16))
    World(alpha=0.1, **GPU).request(policy, 100)
    kinds = [d["kind"] for d in decisions(policy)]
    assert kinds[:2] == ["request", "recheck"] and kinds.count("recheck") == 1 and kinds[2:] == ["window"] * 5
    assert decisions(policy, "recheck")[0]["inputs"]["chains"] == PolicyConfig().recheck_chains


def test_a_chat_after_code_is_priced_on_its_own_chains_at_once():
    """The client's prior says code (every first choice held); the chat's first four chains say otherwise: the
    re-check then prices the chat on them, long before the next window. Under ``cloud_cost`` no lock-step round
    runs on the prior alone (one the text cannot feed is slower than cloud-only), and none after the re-check."""
    policy = DraftPolicy(objective="cloud_cost")
    World(alpha=0.97, **GPU).request(policy, 200)
    assert policy.mode == "rounds"
    World(alpha=0.2, seed=3, **GPU).request(policy, 60)
    recheck = decisions(policy, "recheck")[-1]
    assert recheck["tokens"] < 32 and recheck["inputs"]["alpha"][0] < 0.5  # (deeper levels: rarely reached)
    chat = decisions(policy)[-3:]
    assert [d["kind"] for d in chat] == ["request", "recheck", "window"] and all(d["chose"] != "rounds" for d in chat)
    assert all(d["modes"][d["chose"]]["rate"] >= d["modes"]["plain"]["rate"] for d in chat)


def test_a_text_whose_drafting_gets_worse_is_priced_on_its_recent_chains():
    """A text drafted well for 120 tokens (every first choice held: deep lock-step rounds are the cheapest), then
    poorly: the estimate follows the recent chains, not the whole history, and the rounds are left within a few
    windows (streamed trees cost a flat verifier nothing when they fail: they may stay)."""
    policy, world = DraftPolicy(PolicyConfig(decide_tokens=16), objective="cloud_cost"), World(alpha=1.0, **GPU)
    world.request(policy, 120)
    assert policy.mode == "rounds"
    world.alpha, made = 0.05, policy.decisions_made
    world.go(policy, 100)
    after = list(policy.decisions)[made - policy.decisions_made:]
    left = next(d for d in after if d["chose"] != "rounds")
    assert left["tokens"] - 120 <= 48 and left["inputs"]["alpha"][0] < 0.9  # (it was 1.0)


def test_the_benches_probe_records_the_predicted_rounds_and_decides_as_the_policy_does():
    from bench.output import ProbedPolicy, prediction_report

    plain, probed = DraftPolicy(), ProbedPolicy()
    for policy in (plain, probed):
        World().request(policy, 200)
    assert list(probed.decisions) == list(plain.decisions) and probed.tokens_by_mode["draft"] > 100
    report = prediction_report(probed)
    assert report["trees"] == len(probed.predictions) > 10 and prediction_report(plain) == {}
    assert report["round_ms_predicted"] > report["verify_ms_predicted"] > 0


def best_tree(sessions: int, price_ms: float, objective: str = "latency", budget: int = 0) -> int:
    """Nodes of the tree the closed form picks (0: plain decoding) for a well-drafted text on a flat GPU curve
    (20 ms + 0.3 ms a token, measured), a quick drafter and a metro link, when the verifier's last verdict said a
    token costs ``price_ms`` in a forward ``sessions`` share."""
    from tandem.edge.policy import closed_form as cf
    from tandem.edge.policy.evidence import Timing
    timing = Timing(rtt_ms=20.0)
    for n in (1, 4, 8, 17, 33):
        timing.verify.observe(n, 20.0 + 0.3 * (n - 1), 1.0)
    timing.learn_level(1, 6.0)
    timing.learn_level(2, 9.0)
    timing.observe_price(price_ms, sessions, budget)
    found = [o for o in cf.options(timing.physics(), [0.9] * 9, (1, 2), 8)
             if o.shape is None or not budget or o.shape.n + 1 <= budget]
    chosen, _ = cf.choose(found, "plain", objective, 0.0, lambda o: o.rate)
    return 0 if chosen.shape is None else chosen.shape.n


@pytest.mark.parametrize("objective", ["latency", "cloud_cost"])
def test_drafts_shrink_as_the_verifiers_price_rises(objective):
    """The same text, link and drafter; only the load the verifier reports grows. Alone (one session) the price
    changes nothing; shared, each drafted token is charged the delay it puts on the others, and the tree the
    closed form picks shrinks, down to plain decoding when no tree buys back its tokens."""
    assert best_tree(1, 0.3, objective) == best_tree(1, 0.0, objective) > 0
    nodes = [best_tree(n, 0.3, objective) for n in (1, 8, 32, 128, 512)]
    assert nodes == sorted(nodes, reverse=True) and nodes[0] > nodes[-1] == 0, nodes


def test_the_policy_prices_its_trees_on_the_verifiers_price():
    """Through the policy: a well-drafted text drafts alone, and decodes plainly once 512 sessions share the
    forward at 0.3 ms a token."""
    for sessions, drafts in ((1, True), (512, False)):
        policy = DraftPolicy()
        policy.observe_price(0.3, sessions, 0)
        World(alpha=0.9, **GPU).request(policy, 160)
        assert (policy.tokens_by_mode["plain"] < 120) == drafts, policy.tokens_by_mode


def test_a_token_budget_caps_the_tree():
    assert best_tree(1, 0.0) > 2 and 0 < best_tree(1, 0.0, budget=3) <= 2
    policy = DraftPolicy()
    policy.observe_price(0.0, 1, 3)
    World(alpha=0.9, **GPU).request(policy, 160)
    assert all(TreeShape.parse(m["shape"]).n <= 2 for d in decisions(policy) for m in d["modes"].values()
               if m.get("shape")), "a tree over the verifier's token budget was priced"


class HostWorld(World):
    """A World whose verifier's host drafts ``host`` ms a level (None: it has no host drafter)."""

    def __init__(self, host=None, **kw):
        super().__init__(**kw)
        self.host = host

    def request(self, policy, tokens: int, pending: int = 0, partition: str = "") -> None:
        if self.host is not None:  # what each Opened says
            policy.observe_host(self.host, 0, 0)
        super().request(policy, tokens, pending, partition)

    def go(self, policy, tokens: int, pending: int = 0) -> None:
        done = 0
        while done < tokens:
            if not policy.host:
                super().go(policy, 1, pending)
                done += 1
                continue
            depth = policy.plan.shape.d
            held, forward = self.held(depth), self.tv(1 + depth)
            policy.observe_host(self.host, depth, held)
            policy.observe(Round(0, 0, 0, 0, 0, 0.0, forward, forward, streamed=True, tokens=held + 1,
                                 forward_tokens=1 + depth, gap_ms=depth * self.host + forward))
            done += held + 1


FAR_SLOW = dict(t1=25.0, per_token=0.5, level=60.0, rtt=120.0)  # a phone on a long link, a flat GPU curve
NEAR_FAST = dict(t1=25.0, per_token=0.5, level=2.0, rtt=1.0)  # a fast laptop beside the verifier


@pytest.mark.parametrize("world, expected", [
    (dict(host=4.0, alpha=0.8, **FAR_SLOW), {"host"}),  # the host drafts for the device that cannot keep up
    (dict(host=40.0, alpha=0.8, **NEAR_FAST), {"draft", "rounds"}),  # the device drafts faster than the host
    (dict(host=None, alpha=0.8, **FAR_SLOW), {"plain"}),  # no host drafter: nothing pays past plain decoding
    (dict(host=4.0, alpha=0.05, **FAR_SLOW), {"plain"}),  # nothing drafts this text well
], ids=["far-slow-device", "near-fast-device", "no-host", "undraftable-text"])
def test_each_device_gets_the_mode_its_physics_call_for(world, expected):
    policy, w = DraftPolicy(), HostWorld(**world)
    for _ in range(3):
        w.request(policy, 160)
    assert policy.mode in expected
    last = decisions(policy)[-1]
    assert ("host" in last["modes"]) == (world["host"] is not None)
    if policy.mode == "host":
        assert policy.shape() is None and policy.host  # the device's drafter rests
        assert last["modes"]["host"]["rate"] > 1.5 * last["modes"]["plain"]["rate"]


def test_a_session_opened_without_a_host_seat_is_not_priced_on_the_host():
    """The far slow device of the table above holds the host; its next request opens where every seat is taken
    (Opened names no host drafter): the host is not among that request's modes, and the next request offered one
    gets it back."""
    policy, w = DraftPolicy(), HostWorld(host=4.0, alpha=0.8, **FAR_SLOW)
    for _ in range(2):
        w.request(policy, 160)
    assert policy.mode == "host"
    policy.observe_host(None, 0, 0)
    HostWorld(host=None, alpha=0.8, **FAR_SLOW).request(policy, 160)
    assert policy.mode == "plain" and all("host" not in d["modes"] for d in decisions(policy)[-2:])
    w.request(policy, 160)
    assert policy.mode == "host"
