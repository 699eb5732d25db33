"""Pipelined drafting and the adaptive policy end to end: edge -> (delayed) gRPC -> verifier on the real pair.
Trees drafted while the verifier streams are rebased onto its tokens, a slow link makes them arrive later (and
the policy draft deeper), speculative trees go out on arrival of the verdict they guessed, and the output stays
token-identical to target-only decoding throughout.

What these tests check is an interleaving of two computations, the drafter's and the verifier's, which here share
this host's cores; how fast one runs against the other differs from host to host (on a 2-core AMD EPYC, unpaced,
the verifier decoded past every pipelined tree before it arrived: no tree accepted, the policy saw no tree at
all). So the tests that need trees to land run against a verifier paced to ``PACE_MS`` per forward (real logits,
``cloud.engines.pacing``): it sleeps out each forward and leaves the cores to the drafter, as in a deployment where they
run on different hardware, and the interleaving is the same on every host."""
import pytest

from bench.netdelay import DelayInterceptor
from tandem.cloud import reference
from tandem.cloud.backend import LocalBackend
from tandem.cloud.engines.pacing import CostCurve, PacedEngine
from tandem.cloud.server import serve
from tandem.core.tree import TreeShape
from tandem.edge.client import EdgeClient
from tandem.edge.planner import FixedPlanner
from tandem.edge.policy import DraftPolicy, PolicyConfig

pytestmark = pytest.mark.models

NEW = 48
PACE_MS = 200.0  # a verify forward's wall time: above this pair's real forwards of up to ~10 tokens on 2 cores


@pytest.fixture(scope="module")
def paced(engine):
    """A verifier (own engine loop on the shared engine) whose every forward takes ``PACE_MS``."""
    backend = LocalBackend(PacedEngine(engine, CostCurve("test pace", (1,), (PACE_MS,))), max_sessions=4)
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    yield f"127.0.0.1:{port}"
    srv.stop(grace=None)
    backend.scheduler.stop()


@pytest.fixture(scope="module")
def prompt(engine, humaneval_chats):
    return engine.model.tokenize(engine.model.chat_prompt(humaneval_chats[2]))


@pytest.fixture(scope="module")
def ref(engine, prompt, target_greedy):
    return target_greedy(engine, prompt, NEW)


def lossless(gen, ref, noise):
    verdict = reference.classify(gen.tokens, ref, noise)
    assert verdict.ok, str(verdict)


def test_cloud_only_decoding_streams_one_run(server, drafter, prompt, ref):
    """No drafting: the verifier decodes the whole answer alone from the prefill on and streams it; every
    committed token is a target-only greedy token (one-token forwards: the reference's batch shape, so exact)."""
    client = EdgeClient(drafter, server, shape=None)
    gen = client.generate(prompt, max_new_tokens=NEW).result()
    client.close()
    assert gen.tokens == ref.tokens
    assert gen.stats.rounds == gen.stats.streamed_tokens == len(gen.tokens) and gen.stats.trees == 0


def test_pipelined_trees_are_rebased_and_lossless(paced, drafter, prompt, ref, noise):
    client = EdgeClient(drafter, paced, TreeShape(1, 6, 6), interceptors=[DelayInterceptor(20)])
    gen = client.generate(prompt, max_new_tokens=NEW).result()
    client.close()
    s = gen.stats
    lossless(gen, ref, noise)
    assert s.trees >= 3 and s.streamed_tokens > 0  # trees and tokens decoded alone interleave
    assert s.rebased_tokens > 0  # trees arrived after the verifier had moved on, and were walked along
    assert s.accepted_tokens > 0 and s.rounds < len(gen.tokens)  # fewer forwards than tokens


def test_speculative_trees_go_out_on_arrival_of_their_verdict(paced, drafter, prompt, ref, noise):
    # a 120 ms round trip leaves the drafter time to speculate even on a loaded 2-core host (at 60 ms a busy
    # host saw no hit at all); how often the guess holds is bench.speculative's business, not a test's
    # lock-step: every round has a verdict in flight to speculate during (pipelined, a loaded host sent too few
    # trees for one hit: 6 drafted nodes in 48 tokens in one full-suite run)
    client = EdgeClient(drafter, paced, TreeShape(1, 5, 5), interceptors=[DelayInterceptor(60)], proactive=True)
    gen = client.generate(prompt, max_new_tokens=NEW, planner=FixedPlanner(TreeShape(1, 5, 5), stream=False)).result()
    client.close()
    assert gen.stats.proactive_hits >= 1, gen.stats
    lossless(gen, ref, noise)


def test_the_policy_drafts_on_a_flat_verifier_and_stays_lossless(paced, drafter, prompt, ref, noise):
    """Every forward takes PACE_MS whatever its size (a GPU's flat curve, slowed down): once this code prompt's
    shadow chains show its acceptance, a drafting mode is priced above cloud-only decoding and runs; the output is
    the target's."""
    policy = DraftPolicy(PolicyConfig(decide_tokens=8))
    client = EdgeClient(drafter, paced, policy=policy)
    gen = client.generate(prompt, max_new_tokens=NEW).result()
    client.close()
    lossless(gen, ref, noise)
    decisions = list(policy.decisions)
    assert decisions[0]["kind"] == "request" and all(set(d["modes"]) >= {"plain"} for d in decisions)
    drafted = [d for d in decisions if d["chose"] != "plain"]
    assert drafted and drafted[0]["modes"][drafted[0]["chose"]]["rate"] > drafted[0]["modes"]["plain"]["rate"]
    assert gen.stats.trees > 0 and gen.stats.accepted_tokens > 0


def test_a_slower_link_means_later_trees(paced, drafter, prompt, ref, noise):
    """Trees arrive after the verifier decoded more tokens alone when the link is slower; the policy measures the
    link and that lateness (its ``rebase`` estimate is what makes it draft deeper there)."""
    # 400 ms one way: a tree reaches the verifier a round trip (800 ms) later, after 800 / PACE_MS = 4 more tokens
    # decoded alone; half of that is the bound (drafting time moves the rest, more so on a loaded host)
    late = {}
    for one_way_ms in (0, 400):
        client = EdgeClient(drafter, paced, TreeShape(1, 8, 8), interceptors=[DelayInterceptor(one_way_ms)])
        gen = client.generate(prompt, max_new_tokens=NEW).result()
        client.close()
        lossless(gen, ref, noise)
        late[one_way_ms] = gen.stats.rebased_tokens / gen.stats.trees
    assert late[400] > late[0] + 0.5 * 800 / PACE_MS, late
    policy = DraftPolicy(PolicyConfig(decide_tokens=8), modes=("rounds",))  # lock-step rounds: every tree a round trip
    client = EdgeClient(drafter, paced, policy=policy, interceptors=[DelayInterceptor(80)])
    lossless(client.generate(prompt, max_new_tokens=NEW).result(), ref, noise)
    client.close()
    rounds = [d for d in policy.decisions if d["chose"] == "rounds"]
    assert rounds and rounds[-1]["inputs"]["rtt_ms"] > 120
