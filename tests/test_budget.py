"""Cross-request verify budget: the pure allotment of forward tokens to tree nodes, the path log-probabilities the
edge sends for it, their checks at the verifier, and the engine loop verifying pruned trees losslessly."""
import math
import threading

import pytest

from tandem.cloud.budget import UNSCORED_LEVEL_LOGP, allot, node_scores, restrict
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
