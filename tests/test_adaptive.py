"""The adaptive draft policy end to end: edge -> (delayed) gRPC -> verifier on the real pair. A slower link must
move the draft budget up, and the output stays token-identical to target-only decoding."""
import numpy as np
import pytest

from bench.netdelay import DelayInterceptor
from cloud import reference
from edge.client import EdgeClient
from orchestrator.policy import DraftPolicy, PolicyConfig

pytestmark = pytest.mark.models

NEW = 48


@pytest.fixture(scope="module")
def prompt(engine, humaneval_chats):
    return engine.model.tokenize(engine.model.chat_prompt(humaneval_chats[2]))


def run(server, drafter, prompt, one_way_ms):
    policy = DraftPolicy(PolicyConfig(max_depth=10, widths=(1, 2)))
    depths = []
    choose = policy.choose

    def recording_choose():
        shape = choose()
        depths.append(shape.d if shape else 0)
        return shape

    policy.choose = recording_choose
    client = EdgeClient(drafter, server, policy=policy, interceptors=[DelayInterceptor(one_way_ms)])
    gen = client.generate(prompt, max_new_tokens=NEW).result()
    client.close()
    return gen, depths, policy


def test_policy_drafts_deeper_on_a_slow_link_and_stays_lossless(server, drafter, engine, prompt, noise):
    fast, fast_depths, fast_policy = run(server, drafter, prompt, 0)
    slow, slow_depths, slow_policy = run(server, drafter, prompt, 60)
    assert slow_policy.est.rtt_ms > 100 > fast_policy.est.rtt_ms  # the policy saw the link
    # after the first rounds (estimates warming up), the slow link gets the larger draft budget
    assert np.mean(slow_depths[2:]) > np.mean(fast_depths[2:]), (fast_depths, slow_depths)
    ref = reference.greedy(engine, prompt, NEW)
    for gen in (fast, slow):
        kind, at = reference.classify(gen.tokens, ref, noise)
        assert kind in ("exact", "near_tie"), (kind, at)


def test_proactive_drafting_hides_draft_time_and_stays_lossless(server, drafter, engine, prompt, noise):
    from edge.drafting import TreeShape
    plain = EdgeClient(drafter, server, TreeShape(1, 5, 5), interceptors=[DelayInterceptor(30)])
    base = plain.generate(prompt, max_new_tokens=NEW).result()
    eager = EdgeClient(drafter, server, TreeShape(1, 5, 5), interceptors=[DelayInterceptor(30)], proactive=True)
    gen = eager.generate(prompt, max_new_tokens=NEW).result()
    plain.close()
    eager.close()
    assert gen.stats.proactive_hits >= 2, gen.stats  # code prompts: the first-choice guess often holds
    # rounds that reuse a speculative tree send it at once: less drafting on the critical path
    assert gen.stats.draft_us < base.stats.draft_us
    ref = reference.greedy(engine, prompt, NEW)
    kind, at = reference.classify(gen.tokens, ref, noise)
    assert kind in ("exact", "near_tie"), (kind, at)
