"""Session rules (limits, finish, rebasing, stale/closed drafts, validation) on a scripted engine: pure logic."""
import numpy as np
import pytest

from tandem.cloud.session import (DraftRequest, Finish, InvalidRequest, Limits, Refused, UnknownSession, check_open,
                                  grant_limits, open_session)
from tandem.core.sampling import Sampling
from tandem.core.tree import DraftTree
from tandem.edge.generation_stats import GenerationStats

from scripted import EOS, ScriptedEngine, succ


def session(prompt=(1, 2, 3), new=20, nxt=succ, **sampling):
    eng = ScriptedEngine(nxt)
    return eng, open_session(eng, list(prompt), Sampling(**sampling), Limits(new, 8, 4), Limits(0, 16, 8))


def draft(committed_len, tree=DraftTree(), seq=1, assumed=()):
    return DraftRequest(committed_len, tree, seq, tuple(assumed))


def test_accepted_path_and_bonus_are_committed_and_cache_follows():
    eng, s = session()
    v = s.verify(draft(3, DraftTree.chain([4, 5, 9])))
    assert v.accepted == (0, 1) and v.bonus == 6 and v.committed_len == 6 and v.finish is Finish.NONE
    assert s.committed == [1, 2, 3, 4, 5, 6]
    assert s.seq["cache"] == [1, 2, 3, 4, 5]  # everything committed but the last token


def test_eos_inside_the_accepted_path_finishes_and_drops_the_rest():
    # a target that would go on after EOS: 7 is accepted by the maths but must never be committed
    eng, s = session(prompt=(46,), new=20, nxt=lambda t: 7 if t == EOS else succ(t))
    v = s.verify(draft(1, DraftTree.chain([47, 48, EOS, 7])))
    assert v.finish is Finish.STOP and v.accepted == (0, 1, 2) and v.bonus == -1
    assert s.committed == [46, 47, 48, EOS] and v.committed_len == 4


def test_max_new_tokens_truncates_inside_a_round():
    eng, s = session(new=2)
    v = s.verify(draft(3, DraftTree.chain([4, 5, 6])))
    assert v.finish is Finish.LENGTH and v.accepted == (0, 1) and v.bonus == -1 and s.committed == [1, 2, 3, 4, 5]
    with pytest.raises(InvalidRequest, match="already finished"):
        s.verify(draft(5, seq=2))


def test_bonus_can_end_on_length():
    eng, s = session(new=3)
    v = s.verify(draft(3, DraftTree.chain([4, 5])))
    assert v.finish is Finish.LENGTH and v.accepted == (0, 1) and v.bonus == 6


def test_a_draft_behind_the_verifier_is_rebased_onto_its_tokens():
    eng, s = session()
    assert s.verify(DraftRequest(3)).bonus == 4  # decoded alone (seq 0): committed 1 2 3 4
    #   draft on length 3:  root(3) ─ 0:4 ─ 1:5 ─ 2:6 ─ 3:9
    v = s.verify(draft(3, DraftTree.chain([4, 5, 6, 9])))
    assert (v.rebased, v.accepted, v.bonus, v.stale) == (1, (1, 2), 7, False)  # node 0 was already committed
    assert v.forward_tokens == 4 and s.committed == [1, 2, 3, 4, 5, 6, 7] and v.committed_len == 7
    assert s.seq["cache"] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("req, why", [
    (draft(3, DraftTree.chain([9, 5])), "the tokens decoded alone left the tree"),
    (draft(6, DraftTree.chain([7]), assumed=(5,)), "a guess past what was committed"),
    (draft(4, DraftTree.chain([6]), assumed=(9,)), "an assumed token the verifier did not commit"),
    (draft(4, DraftTree.chain([5])), "rebased onto its leaf: nothing left to verify, but not stale"),
])
def test_stale_drafts_decode_one_token_instead(req, why):
    eng, s = session()
    s.verify(DraftRequest(3))
    s.verify(DraftRequest(4))  # committed 1 2 3 4 5
    v = s.verify(req)
    assert v.committed_len == 6 and s.committed == [1, 2, 3, 4, 5, 6], why
    assert v.stale == (req.tree != DraftTree.chain([5])) and v.accepted == () and v.bonus == 6, why
    assert v.draft_seq == req.seq


def test_closed_sessions_and_replayed_seqs_change_nothing():
    eng, s = session()
    s.verify(draft(3, seq=5))
    with pytest.raises(InvalidRequest, match="seq 5 is not above"):
        s.verify(draft(4, seq=5))
    assert s.committed == [1, 2, 3, 4] and "pending" not in s.seq
    s.close()
    s.close()
    assert eng.released == 1
    with pytest.raises(UnknownSession, match="closed"):
        s.verify(draft(4, seq=6))


@pytest.mark.parametrize("req, message", [
    (draft(2), "inside the prompt"),
    (draft(4, assumed=(3, 3)), "inside the prompt"),
    (draft(3 + 4 + 2), "one tree can add at most 5"),
    (draft(3, assumed=(1,) * 6), "more than one tree"),
    (draft(4, assumed=(99,)), "assumed token id 99"),
    (draft(3, DraftTree.chain([1, 2, 3, 4, 5])), "depth 5, over the negotiated limit of 4"),
    (draft(3, DraftTree((1,), (0,))), "parent 0"),
])
def test_bad_drafts_are_refused_before_any_compute(req, message):
    eng, s = session()
    with pytest.raises(InvalidRequest, match=message):
        s.verify(req)
    assert s.committed == [1, 2, 3] and "pending" not in s.seq and s.last_draft_seq == 0


@pytest.mark.parametrize("requested,server,prompt_len,expected", [
    (Limits(0, 0, 0), Limits(0, 16, 8), 10, Limits(64 - 10 - 8 - 1, 16, 8)),  # zeros: as much as allowed
    (Limits(5, 4, 2), Limits(0, 16, 8), 10, Limits(5, 4, 2)),  # request below every cap
    (Limits(500, 100, 100), Limits(20, 16, 8), 10, Limits(20, 16, 8)),  # server caps
    (Limits(0, 3, 8), Limits(0, 16, 8), 10, Limits(64 - 10 - 3 - 1, 3, 3)),  # depth never above nodes
    (Limits(0, 0, 0), Limits(0, 16, 8), 60, Limits(64 - 60 - 8 - 1, 16, 8)),  # context too small: < 1
])
def test_grant_limits(requested, server, prompt_len, expected):
    assert grant_limits(ScriptedEngine(succ), requested, server, prompt_len) == expected


def test_open_refusals():
    eng = ScriptedEngine(succ)
    with pytest.raises(Refused, match="vocabulary size 7"):
        open_session(eng, [1], Sampling(), Limits(), Limits(), vocab_size=7)
    with pytest.raises(InvalidRequest, match="temperature must be a finite number"):
        open_session(eng, [1], Sampling(temperature=-1), Limits(), Limits())
    with pytest.raises(InvalidRequest, match="temperature must be a finite number"):
        open_session(eng, [1], Sampling(temperature=float("nan")), Limits(), Limits())
    with pytest.raises(InvalidRequest, match="token id 50 is outside"):
        open_session(eng, [1, 50], Sampling(), Limits(), Limits())
    with pytest.raises(InvalidRequest, match="does not fit the context"):
        open_session(eng, [1] * 60, Sampling(), Limits(), Limits(0, 16, 8))
    assert eng.released == 0  # refused before any sequence was allocated


@pytest.mark.parametrize("rounds,accepted,reached", [
    # (tree depth, accepted) per round -> accepted_by_depth, reached_by_depth
    ([(3, 3)], [1, 1, 1], [1, 1, 1]),
    ([(3, 0)], [0, 0, 0], [1, 0, 0]),
    ([(3, 1), (2, 2)], [2, 1, 0], [2, 2, 0]),
    ([(0, 0), (1, 0)], [0], [1]),  # an empty tree reaches no depth
])
def test_alpha_by_depth_bookkeeping(rounds, accepted, reached):
    s = GenerationStats()
    for depth, acc in rounds:
        s.record_round(depth, depth, acc)
    assert s.accepted_by_depth == accepted and s.reached_by_depth == reached
    assert s.rounds == len(rounds)


def test_fresh_entropy_per_session_unless_the_seed_is_pinned():
    keys = [session(temperature=1.0)[1].draws.key for _ in range(3)]
    assert len(set(keys)) == 3  # no seed: every session draws its own key
    pinned = [session(temperature=1.0, seed=5)[1].draws.key for _ in range(2)] + [session(seed=6)[1].draws.key]
    assert pinned[0] == pinned[1] != pinned[2]


def test_logprobs_follow_the_accepted_path_rows():
    """Each committed token's logprobs come from its parent's row: the root's for the first, then the accepted
    nodes' (not rows in tree order: node 0 here is a rejected sibling)."""
    eng, s = session()
    s.top_logprobs = 2
    tree = DraftTree(tokens=(9, 4, 5), parents=(-1, -1, 1))
    v = s.verify(draft(3, tree))
    assert v.accepted == (1, 2) and v.bonus == 6
    assert [lp.token for lp in v.logprobs] == [4, 5, 6]
    for lp in v.logprobs:
        assert lp.top[0][0] == lp.token and lp.logprob == pytest.approx(10 - np.log(np.exp(10) + 49))
        assert len(lp.top) == 2 and lp.top[1][1] < lp.top[0][1]
    eng, quiet = session()
    assert quiet.verify(draft(3, tree)).logprobs == ()  # not asked: none computed


@pytest.mark.parametrize("top", [-1, 21])
def test_top_logprobs_out_of_range_is_refused(top):
    with pytest.raises(InvalidRequest, match="top_logprobs"):
        check_open(ScriptedEngine(succ), [1, 2], Sampling(), top_logprobs=top)


def test_verdicts_carry_the_hash_of_everything_committed():
    from tandem.core.messages import HASH_START, extend_hash
    eng, s = session()
    v = s.verify(draft(3, DraftTree.chain([4, 5, 9])))
    assert v.committed_hash == extend_hash(HASH_START, [1, 2, 3, 4, 5, 6])
    v = s.verify(DraftRequest(6))
    assert v.committed_hash == extend_hash(HASH_START, s.committed) != 0


def test_a_full_replica_refuses_before_compiling_a_grammar(monkeypatch):
    """Capacity first: a constrained Open on a replica at its session limit is RESOURCE_EXHAUSTED, and nothing was
    compiled (a flood of schemas must not buy grammar compilation on a full verifier)."""
    import asyncio

    from tandem.cloud import backend as backend_module
    from tandem.cloud.backend import LocalBackend
    from tandem.cloud.session import Exhausted
    from tandem.core.messages import Constraint, OpenRequest
    compiled = []
    monkeypatch.setattr(backend_module, "GrammarMask", lambda engine, c: compiled.append(c))
    b = LocalBackend(ScriptedEngine(succ), max_sessions=1)
    try:
        asyncio.run(b.open(OpenRequest((1, 2, 3))))
        with pytest.raises(Exhausted):
            asyncio.run(b.open(OpenRequest((1, 2, 3), constraint=Constraint(json_object=True))))
        assert compiled == [] and b.active_sessions() == 1
    finally:
        b.scheduler.stop()


def test_a_replica_closes_sessions_nobody_has_used_for_its_idle_time():
    import asyncio
    import time

    from tandem.cloud.backend import LocalBackend
    from tandem.core.messages import OpenRequest
    eng = ScriptedEngine(succ)
    b = LocalBackend(eng, max_sessions=2)
    try:
        idle = asyncio.run(b.open(OpenRequest((1, 2, 3)))).session_id
        busy = asyncio.run(b.open(OpenRequest((1, 2, 3)))).session_id
        time.sleep(0.2)
        asyncio.run(b.verify(busy, DraftRequest(3)))
        assert b.sweep_idle(0.15) == [idle] and b.active_sessions() == 1
        deadline = time.monotonic() + 5
        while eng.released < 1 and time.monotonic() < deadline:  # freed on the engine thread
            time.sleep(0.01)
        assert eng.released == 1
        with pytest.raises(UnknownSession):
            asyncio.run(b.verify(idle, DraftRequest(3)))
        assert b.sweep_idle(10.0) == []
    finally:
        b.scheduler.stop()
