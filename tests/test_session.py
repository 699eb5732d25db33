"""Session rules (limits, finish, stale/closed drafts) on a scripted engine: pure logic, no model."""
import pytest

from cloud.acceptance import Sampling
from cloud.session import (Finish, InvalidRequest, Limits, Refused, StaleDraft, UnknownSession, grant_limits,
                           open_session)
from cloud.tree import DraftTree
from edge.client import GenerationStats

from scripted import EOS, ScriptedEngine, succ


def session(prompt=(1, 2, 3), new=20, nxt=succ, **sampling):
    eng = ScriptedEngine(nxt)
    return eng, open_session(eng, list(prompt), Sampling(**sampling), Limits(new, 8, 4), Limits(0, 16, 8))


def test_accepted_path_and_bonus_are_committed_and_cache_follows():
    eng, s = session()
    v = s.verify(3, DraftTree.chain([4, 5, 9]))
    assert v.accepted == (0, 1) and v.bonus == 6 and v.committed_len == 6 and v.finish is Finish.NONE
    assert s.committed == [1, 2, 3, 4, 5, 6]
    assert s.seq["cache"] == [1, 2, 3, 4, 5]  # everything committed but the last token


def test_eos_inside_the_accepted_path_finishes_and_drops_the_rest():
    # a target that would go on after EOS: 7 is accepted by the maths but must never be committed
    eng, s = session(prompt=(46,), new=20, nxt=lambda t: 7 if t == EOS else succ(t))
    v = s.verify(1, DraftTree.chain([47, 48, EOS, 7]))
    assert v.finish is Finish.STOP and v.accepted == (0, 1, 2) and v.bonus == -1
    assert s.committed == [46, 47, 48, EOS] and v.committed_len == 4


def test_max_new_tokens_truncates_inside_a_round():
    eng, s = session(new=2)
    v = s.verify(3, DraftTree.chain([4, 5, 6]))
    assert v.finish is Finish.LENGTH and v.accepted == (0, 1) and v.bonus == -1 and s.committed == [1, 2, 3, 4, 5]
    with pytest.raises(InvalidRequest, match="already finished"):
        s.verify(5, DraftTree())


def test_bonus_can_end_on_length():
    eng, s = session(new=3)
    v = s.verify(3, DraftTree.chain([4, 5]))
    assert v.finish is Finish.LENGTH and v.accepted == (0, 1) and v.bonus == 6


def test_stale_and_closed_drafts_change_nothing():
    eng, s = session()
    with pytest.raises(StaleDraft, match="assumes committed length 4"):
        s.verify(4, DraftTree.chain([4]))
    assert s.committed == [1, 2, 3] and "pending" not in s.seq
    s.close()
    s.close()
    assert eng.released == 1
    with pytest.raises(UnknownSession, match="closed"):
        s.verify(3, DraftTree())


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
    with pytest.raises(InvalidRequest, match="temperature >= 0"):
        open_session(eng, [1], Sampling(temperature=-1), Limits(), Limits())
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
