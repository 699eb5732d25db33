"""Cross-request verify budget: the pure allotment of forward tokens to tree nodes, the path log-probabilities the
edge sends for it, their checks at the verifier, the engine loop verifying pruned trees losslessly, and the fitted
forward cost that turns a latency target into a token budget."""
import math
import threading

import pytest

from tandem.cloud.budget import UNSCORED_LEVEL_LOGP, ForwardCost, allot, forward_target_ms, node_scores, restrict
from tandem.cloud.scheduler import Scheduler
from tandem.cloud.session import DraftRequest, InvalidRequest, Limits, open_session
from tandem.core.sampling import Sampling
from tandem.core.tree import DraftTree
from tandem.edge.drafting import BuiltTree
from tandem.edge.rounds import GRAFT_LOGP, sent_logp

from scripted import ScriptedEngine, succ

L = math.log
# root -> a (0.6) -> c (0.6*0.5); root -> b (0.3) -> d (0.3*0.9)
T = DraftTree((1, 2, 3, 4), (-1, -1, 0, 1))
T_LOGP = [L(0.6), L(0.3), L(0.3), L(0.27)]
CHAIN = DraftTree.chain([7, 8, 9])
CHAIN_LOGP = [L(0.9), L(0.81), L(0.729)]


@pytest.mark.parametrize("trees, scores, budget, expected", [
    ([T], [T_LOGP], 5, [(0, 1, 2, 3)]),  # everything fits: root + 4 nodes
    ([T], [T_LOGP], 3, [(0, 1)]),  # ties at 0.3 go to the shallower node (b before c)
    ([T], [T_LOGP], 4, [(0, 1, 2)]),
    ([T], [T_LOGP], 1, [()]),  # the root alone: one plain decoding step
    ([T, CHAIN], [T_LOGP, CHAIN_LOGP], 6, [(0,), (0, 1, 2)]),  # across sessions: the confident chain wins
    ([T, CHAIN], [T_LOGP, CHAIN_LOGP], 2, [(), ()]),  # roots only
    # a child scoring above its parent waits for the parent: kept nodes are always a tree
    ([T], [[L(0.1), L(0.5), L(0.9), L(0.4)]], 3, [(1, 3)]),  # c (0.9) waits for a (0.1): b, d go first
    ([T], [[L(0.1), L(0.05), L(0.9), L(0.01)]], 3, [(0, 2)]),
])
def test_allot_keeps_the_most_probable_nodes_across_trees(trees, scores, budget, expected):
    assert allot(trees, scores, budget) == expected
    for tree, keep in zip(trees, expected):  # parents first, so the restricted tree is a valid tree
        assert all(tree.parents[n] < 0 or tree.parents[n] in keep for n in keep)


def test_allot_spends_exactly_the_budget_when_there_is_more_to_verify():
    trees = [DraftTree.chain(list(range(10, 18))) for _ in range(4)]
    scores = [node_scores(t, ()) for t in trees]
    kept = allot(trees, scores, 20)
    assert sum(len(k) for k in kept) + len(trees) == 20
    assert sorted(len(k) for k in kept) == [4, 4, 4, 4]  # unscored: depth order, so the trees share evenly


@pytest.mark.parametrize("tree, logp, expected", [
    (T, T_LOGP, T_LOGP),
    (T, (), [UNSCORED_LEVEL_LOGP, UNSCORED_LEVEL_LOGP, 2 * UNSCORED_LEVEL_LOGP, 2 * UNSCORED_LEVEL_LOGP]),
])
def test_node_scores(tree, logp, expected):
    assert node_scores(tree, logp) == pytest.approx(expected)


def test_restrict_renumbers_parents():
    assert restrict(T, (0, 1, 3)) == DraftTree((1, 2, 4), (-1, -1, 1))
    assert restrict(T, ()) == DraftTree()


def test_sent_logp_is_relative_to_the_sent_root_and_values_grafted_nodes():
    built = BuiltTree(T, (0, 1, 2, 3), tuple(T_LOGP))
    assert sent_logp(built, T, (0, 1, 2, 3), ()) == pytest.approx(T_LOGP)
    # the subtree below node a, sent on its own (a proactive draft whose guess held): c is now a root child
    assert sent_logp(built, DraftTree((3,), (-1,)), (2,), (0,)) == pytest.approx([L(0.5)])
    # a repeated span grafted below c: one level of GRAFT_LOGP below c's value
    grafted = DraftTree((1, 2, 3, 4, 5), (-1, -1, 0, 1, 2))
    assert sent_logp(built, grafted, (0, 1, 2, 3, -1), ()) == pytest.approx(T_LOGP + [L(0.3) + GRAFT_LOGP])
    assert sent_logp(BuiltTree(T, (0, 1, 2, 3), ()), T, (0, 1, 2, 3), ()) == ()  # a drafter without scores


def session(engine, i=0):
    return open_session(engine, [1 + 10 * i, 2 + 10 * i], Sampling(), Limits(20, 8, 4), Limits(0, 16, 8))


@pytest.mark.parametrize("logp, match", [
    ((-0.1,), "1 node log-probabilities for a tree of 2"),
    ((-0.1, 0.5), "not a finite number <= 0"),
    ((-0.1, float("nan")), "not a finite number <= 0"),
    ((float("-inf"), -1.0), "not a finite number <= 0"),
])
def test_bad_node_logprobs_are_refused_before_any_work(logp, match):
    eng = ScriptedEngine(succ)
    s = session(eng)
    with pytest.raises(InvalidRequest, match=match):
        s.prepare(DraftRequest(2, DraftTree.chain([3, 4]), 1, (), 0, logp))
    assert s.committed_len == 2 and s.last_draft_seq == 0  # nothing changed


def test_a_rebased_job_scores_its_nodes_below_the_new_root():
    eng = ScriptedEngine(succ)
    s = session(eng)
    s.committed.append(3)  # the verifier decoded 3 alone while the draft (hanging below length 2) travelled
    job = s.prepare(DraftRequest(2, DraftTree((3, 4, 5), (-1, 0, 1)), 1, (), 0, (L(0.9), L(0.45), L(0.09))))
    assert job.rebased == 1 and job.nodes == (1, 2)
    assert job.node_logp() == pytest.approx([L(0.5), L(0.1)])


def test_the_loop_verifies_every_pending_session_in_one_forward_within_the_budget():
    """Three sessions, each a true chain of 3 (succ) with a wrong sibling at every level: 21 tokens in all, budget
    9. Every session is verified in the same forward, the forward holds 9 tokens, and each commits the true tokens
    of its kept nodes -- exactly what it would commit unpruned, only fewer of them."""
    eng = ScriptedEngine(succ)
    sched = Scheduler(eng, max_batch_tokens=64, window_ms=50, verify_budget_tokens=9)
    seen: list[int] = []
    inner = eng.forward_batch
    eng.forward_batch = lambda jobs: (seen.append(sum(j.n_tokens for j in jobs)), inner(jobs))[1]
    ss = [session(eng, i) for i in range(3)]
    drafts = []
    for i, _ in enumerate(ss):
        true = [3 + 10 * i, 4 + 10 * i, 5 + 10 * i]
        # levels: (true, wrong) pairs; the true node is the first child
        tree = DraftTree((true[0], 40, true[1], 41, true[2], 42), (-1, -1, 0, 0, 2, 2))
        confident = 0.9 if i == 0 else 0.5  # session 0's drafter is sure, the others are not
        logp = (L(confident), L(0.05), 2 * L(confident), L(0.05), 3 * L(confident), L(0.05))
        drafts.append(DraftRequest(2, tree, 1, (), 0, logp))
    gate = threading.Event()
    sched.call(gate.wait)
    futures = [sched.verify(s, d) for s, d in zip(ss, drafts)]
    gate.set()
    verdicts = [f.result(timeout=5) for f in futures]
    sched.stop()
    assert eng.batches == [3] and seen == [9]
    # 9 tokens: 3 roots + 6 nodes, best-first: session 0's chain (0.9, 0.81, 0.729), then 0.5, 0.5, 0.25 ...
    assert [v.accepted for v in verdicts] == [(0, 2, 4), (0, 2), (0,)]
    assert [v.forward_tokens for v in verdicts] == [4, 3, 2]
    assert [v.pruned_nodes for v in verdicts] == [3, 4, 5]
    for i, (v, d) in enumerate(zip(verdicts, drafts)):
        assert v.tokens(d.tree) == [succ(2 + 10 * i + k) for k in range(len(v.accepted) + 1)]
    assert sched.stats.pruned_nodes == 12


def test_a_budget_below_the_pending_sessions_still_takes_every_root():
    """Budget 2, three sessions waiting: holding one back would cost it a whole forward, its root costs one token.
    All three go in one forward of their roots; each commits the target's next token."""
    eng = ScriptedEngine(succ)
    sched = Scheduler(eng, max_batch_tokens=64, window_ms=50, verify_budget_tokens=2)
    ss = [session(eng, i) for i in range(3)]
    gate = threading.Event()
    sched.call(gate.wait)
    futures = [sched.verify(s, DraftRequest(2, DraftTree.chain([3 + 10 * i, 4 + 10 * i]), 1, (), 0))
               for i, s in enumerate(ss)]
    gate.set()
    verdicts = [f.result(timeout=5) for f in futures]
    sched.stop()
    assert eng.batches == [3] and sched.stats.tokens == 3 and sched.stats.pruned_nodes == 6
    assert [v.tokens(DraftTree()) for v in verdicts] == [[3], [13], [23]]


def test_the_pool_bench_replays_recorded_drafts_by_committed_length_over_grpc():
    """bench.pool's replay client speaks today's protocol, and sends each position's recorded tree."""
    from bench.pool import replay
    from tandem.cloud.server import serve

    server, port = serve(ScriptedEngine(succ), "127.0.0.1:0", max_sessions=2)
    recorded = [(2, DraftTree.chain([3, 4, 5]), (L(0.9), L(0.8), L(0.7))),  # drafted at committed length 2
                (5, DraftTree.chain([6, 7, 8]), ()),  # at 5: the first verdict (3, 4, 5 + 6) commits past its root
                (20, DraftTree.chain([30]), ())]  # never reached
    latency_ms: list[float] = []
    try:
        tokens = replay(f"127.0.0.1:{port}", [1, 2], recorded, 12, latency_ms)
    finally:
        server.stop(grace=None)
    assert tokens == list(range(3, 15))
    # verdicts: 3,4,5 + 6 | the second tree rebased one level (6 is committed): 7,8 + 9 | then 10..14 one each
    assert len(latency_ms) == 7 - 1  # every verdict's but the first's


@pytest.mark.parametrize("observations, line, within", [
    ([], None, {100: None}),  # nothing seen: no budget from a latency target yet
    ([(10, 60.0), (20, 70.0)], None, {100: None}),  # under min_forwards
    # the exact line; 100 ms would allow 50 tokens, but never more than twice the mean size seen (23.3)
    ([(10, 60.0), (20, 70.0), (40, 90.0)], (50.0, 1.0), {100: 46, 80: 30, 60: 10, 50.5: 1, 10: 1}),
    ([(16, 80.0)] * 4, (0.0, 5.0), {100: 20, 80: 16}),  # one size only: proportional
    ([(16, 80.0), (17, 82.0), (16, 81.0)], (0.0, 243 / 49), {100: 20}),  # nearly one size: the slope is noise
    ([(10, 100.0), (20, 60.0), (30, 20.0)], (0.0, 3.0), {30: 10}),  # falling cost makes no sense: proportional
])
def test_forward_cost_fits_time_against_tokens(observations, line, within):
    cost = ForwardCost(decay=1.0)
    for n, ms in observations:
        cost.observe(n, ms)
    fit = cost.line()
    assert fit == (None if line is None else pytest.approx(line))
    for ms, tokens in within.items():
        assert cost.tokens_within(ms) == tokens


def test_forward_cost_follows_a_replica_that_slows_down():
    """The KV grows, the host gets busy: with forgetting, the fit moves to the new cost within a few forwards."""
    cost = ForwardCost(decay=0.7)
    for n in (8, 16, 32) * 3:
        cost.observe(n, 40 + 2 * n)
    assert cost.tokens_within(104) == 32
    for n in (8, 16, 32) * 5:
        cost.observe(n, 80 + 4 * n)  # twice as slow
    fixed, per_token = cost.line()
    assert fixed == pytest.approx(80, rel=0.1) and per_token == pytest.approx(4, rel=0.1)
    assert cost.tokens_within(104) < 10


@pytest.mark.parametrize("target, wait, forward", [
    (600, 0, 600),  # lock-step sessions: nobody waits, the forward may take the whole target
    (600, 200, 400),
    (600, 300, 300),  # desynchronised sessions settle here: wait about one forward, each half the target
    (600, 500, 300),  # never below half: a smaller forward holds fewer roots and everyone waits longer
])
def test_forward_target_leaves_room_for_the_queue(target, wait, forward):
    assert forward_target_ms(target, wait) == forward


def test_a_latency_target_sets_the_forwards_token_budget():
    """A scripted engine whose forward takes 20 ms + 4 ms per token, a 90 ms target, three sessions sending
    7-token trees (21 tokens, ~104 ms in one forward). Warm-up forwards hold 16, 32, 64 tokens; once fitted,
    each forward holds what fits the target less the drafts' queue wait (here the 50 ms batch window), every
    session still in it and committing true tokens only."""
    import time

    eng = ScriptedEngine(succ)
    inner = eng.forward_batch
    seen: list[int] = []
    allowed: list[int] = []

    def paced(jobs):
        n = sum(j.n_tokens for j in jobs)
        seen.append(n)
        allowed.append(sched.budget_now())  # what this forward was sized by (state changes only after it)
        time.sleep((20 + 4 * n) / 1000)
        return inner(jobs)
    eng.forward_batch = paced
    with pytest.raises(ValueError, match="verify_budget_ms"):
        Scheduler(eng, verify_budget_ms=float("nan"))
    sched = Scheduler(eng, max_batch_tokens=64, window_ms=50, verify_budget_ms=90)
    assert sched.budget_now() == 16  # nothing fitted yet: small warm-up forwards
    ss = [open_session(eng, [1 + 10 * i, 2 + 10 * i], Sampling(), Limits(64, 8, 4), Limits(0, 16, 8))
          for i in range(3)]
    for r in range(5):
        gate = threading.Event()
        sched.call(gate.wait)
        drafts, futures = [], []
        for s in ss:
            base = s.committed[-1]
            tree = DraftTree((base + 1, 45, base + 2, 46, base + 3, 47), (-1, -1, 0, 0, 2, 2))
            drafts.append((base, tree))
            futures.append(sched.verify(s, DraftRequest(len(s.committed), tree, r + 1, (), 0)))
        gate.set()
        for (base, tree), f in zip(drafts, futures):
            v = f.result(timeout=5)
            assert v.tokens(tree) == [base + 1 + k for k in range(len(v.accepted) + 1)]
    sched.stop()
    assert eng.batches == [3] * 5
    assert allowed[:3] == [16, 32, 64] and seen[:3] == [16, 21, 21]  # warm-up: growing sizes, under the limit
    # then each forward holds what the fit said: ~5 ms per token; a target of 90 ms less ~50 ms of window wait
    # (never under 45 ms) -> 8 or 9 tokens; the roots always go in
    for k in (3, 4):
        assert seen[k] == max(3, allowed[k]) and seen[k] < 21
    assert 45 <= forward_target_ms(90, sched.wait_ms) < 90 and sched.wait_ms >= 20
    fixed, per_token = sched.cost.line()
    assert per_token == pytest.approx(4, rel=0.5)
    assert sched.stats.pruned_nodes == 5 + 42 - seen[3] - seen[4]


def test_the_price_a_verdict_carries_is_the_fitted_slope_and_the_targets_share():
    eng = ScriptedEngine(succ)
    sched = Scheduler(eng, window_ms=1, verify_budget_ms=50)
    assert sched.price(4) == {"price_us_per_token": 0, "batch_sessions": 4, "token_budget": 0}  # nothing fitted
    for n in (1, 1, 1, 1):
        sched.cost.observe(n, 5.0)
    assert sched.price(4)["price_us_per_token"] == 0  # one size seen: the slope is not told from the floor
    for n, ms in ((9, 13.0), (17, 21.0), (33, 37.0)):  # 4 ms + 1 ms a token
        sched.cost.observe(n, ms)
    fits = sched.cost.tokens_within(50.0)
    assert sched.price(4) == {"price_us_per_token": 1000, "batch_sessions": 4, "token_budget": fits // 4} and fits
    sched.budget_ms = 0
    assert sched.price(4)["token_budget"] == 0  # no latency target: no budget
    sched.stop()


def test_verdicts_reach_the_edge_with_the_price(tmp_path):
    """Through the servicer and the wire, on a verifier paced to 95 ms + 5 ms a token (slow enough that a busy
    host's own compute stays under it): once its forwards had different sizes, a generation's statistics carry the
    verifier's price (~5,000 us a token) and its load."""
    pytest.importorskip("torch")
    from tandem.cloud.backend import LocalBackend
    from tandem.cloud.engines.pacing import CostCurve, PacedEngine
    from tandem.cloud.server import serve
    from tandem.cloud.engines.torch_engine import TorchVerifierEngine
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.planner import FixedPlanner
    from tinystack import TinyDrafter, tiny_model
    engine = PacedEngine(TorchVerifierEngine(model=tiny_model(), n_ctx=160, device="cpu", max_sessions=2),
                         CostCurve("line", (1, 64), (100.0, 415.0)))
    backend = LocalBackend(engine, Limits(0, 16, 8), max_sessions=2)
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    client = EdgeClient(TinyDrafter(tiny_model()), f"127.0.0.1:{port}", max_tree_nodes=16, max_tree_depth=8)
    try:
        for shape in (None, TreeShape(1, 3, 3), TreeShape(2, 12, 6), TreeShape(2, 12, 6)):
            gen = client.generate([1, 2, 3, 4], max_new_tokens=12, planner=FixedPlanner(shape, stream=False))
            gen.result()
    finally:
        client.close()
        srv.stop(None)
        backend.scheduler.stop()
    assert gen.stats.batch_sessions == 1 and 3500 <= gen.stats.price_us_per_token <= 7000, gen.stats
    from tandem.orchestrator.gateway.openai_api import tandem_stats  # (the REST answer's "tandem" statistics)
    assert tandem_stats(gen.stats)["price_us_per_token"] == gen.stats.price_us_per_token
