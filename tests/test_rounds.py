"""The edge's round loop (edge/rounds.py) as a pure state machine, driven by a scripted verifier: which messages it
sends, which drafter jobs it queues (and with which paths and tokens), what it commits, how it rebases, drops dead
trees, adopts or discards speculative trees, resumes and finishes. No network, no model."""
import pytest

from tandem.core.messages import Finish, Limits, Opened, Verdict
from tandem.core.tree import DraftTree, TreeShape
from tandem.edge.actions import Emit, Job, SendClose, SendDraft, SendOpen
from tandem.edge.drafting import BuiltTree
from tandem.edge.generation_stats import GenerationStats
from tandem.edge.planner import FixedPlanner, Round
from tandem.edge.rounds import ProtocolError, RoundLoop

PROMPT = (10, 11, 12)
CAPS = Limits(100, 16, 8)


def built(tree: DraftTree) -> BuiltTree:
    return BuiltTree(tree, tuple(range(len(tree))), tuple(-0.1 * (d + 1) for d in tree.depths))


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


class Ngram:
    """A stand-in n-gram drafter: proposes a fixed continuation."""

    def __init__(self, proposal):
        self.proposal, self.seen = list(proposal), []

    def propose(self, limit, end=None):
        return self.proposal[:limit]

    def extend(self, tokens):
        self.seen += list(tokens)


def started(shape=TreeShape(1, 3, 3), stream=True, **kw):
    """A loop that opened its session and whose drafter caught up on the prompt: the first draft job is out."""
    loop = RoundLoop(PROMPT, 100, FixedPlanner(shape, stream), CAPS, **kw)
    acts = loop.begin(0.0)
    # the prompt goes out at once; streaming unless every token is to be verified in a tree
    assert of(acts, SendOpen) == [SendOpen(PROMPT, 100, 1 << 20 if stream else 0)]
    (start,) = of(acts, Job)
    assert start.ops == (("start", PROMPT), ("catch_up",))
    assert loop.on_opened(Opened("s", Limits(100, 8, 6), 500), 0.01) == []  # the drafter is still busy
    (job,) = of(loop.on_job_done(start.tag, None, 0.0, (3, 5.0), 0.02), Job)
    return loop, job


def verdict(committed_len, bonus, seq=0, accepted=(), rebased=0, stale=False, finish=Finish.NONE):
    return Verdict(tuple(accepted), bonus, committed_len, finish, 100, 1000, seq, rebased, stale,
                   1 + len(accepted))


def test_streamed_tokens_commit_and_emit_while_the_drafter_catches_up():
    loop = RoundLoop(PROMPT, 100, FixedPlanner(TreeShape(1, 3, 3)), CAPS)
    loop.begin(0.0)
    loop.on_opened(Opened("s", Limits(100, 8, 6), 500), 0.01)
    assert of(loop.on_verdict(verdict(4, 20), 0.1), Emit) == [Emit((20,))]
    assert of(loop.on_verdict(verdict(5, 21), 0.2), Emit) == [Emit((21,))]
    assert loop.generated == [20, 21] and loop.stats.streamed_tokens == 2 and loop.stats.ttft_s == pytest.approx(0.1)
    with pytest.raises(ProtocolError, match="committed length 9"):
        loop.on_verdict(verdict(9, 22), 0.3)


def test_first_draft_job_extends_the_drafter_with_streamed_tokens_then_drafts_within_granted_limits():
    loop = RoundLoop(PROMPT, 100, FixedPlanner(TreeShape(4, 64, 16)), CAPS)
    (start,) = of(loop.begin(0.0), Job)
    loop.on_opened(Opened("s", Limits(100, 8, 6), 500), 0.01)
    loop.on_verdict(verdict(4, 20), 0.1)  # a token arrived while the drafter caught up
    (job,) = of(loop.on_job_done(start.tag, None, 0.0, (3, 5.0), 0.2), Job)
    assert job.ops == (("extend", (20,)), ("draft", TreeShape(4, 8, 6)))  # granted limits cap the shape


def test_without_a_warm_up_the_first_draft_waits_for_the_first_token():
    """A planner that does not warm the drafter up alongside the prefill (its drafter slows the verifier) does not
    start the first draft's catch-up on the prompt alongside the first token's forward either."""
    planner = FixedPlanner(TreeShape(1, 3, 3))
    planner.drafts = False
    loop = RoundLoop(PROMPT, 100, planner, CAPS)
    (start,) = of(loop.begin(0.0), Job)
    assert start.ops == (("start", PROMPT),)  # no catch-up alongside the prefill
    assert loop.on_opened(Opened("s", Limits(100, 8, 6), 500), 0.01) == []
    assert of(loop.on_job_done(start.tag, None, 0.0, (0, 0.0), 0.02), Job) == []  # prefilled: still no draft
    (job,) = of(loop.on_verdict(verdict(4, 20), 0.1), Job)  # the first token: now it drafts (evaluating the
    assert job.ops == (("extend", (20,)), ("draft", TreeShape(1, 3, 3)))  # prompt first, the drafter's catch-up)


def test_a_drafted_tree_is_sent_below_the_length_it_was_drafted_on():
    loop, job = started()
    tree = DraftTree.chain([20, 21, 22])
    (send,) = of(loop.on_job_done(job.tag, built(tree), 30.0, (0, 0.0), 0.1), SendDraft)
    assert send.draft.committed_len == 3 and send.draft.tree == tree and send.draft.seq == 1
    assert send.draft.decode_steps == 1 << 20  # the verifier keeps decoding alone after it


def test_cloud_cost_mode_asks_the_verifier_to_wait_for_each_tree():
    loop, job = started(stream=False)
    (send,) = of(loop.on_job_done(job.tag, built(DraftTree.chain([20])), 30.0, (0, 0.0), 0.1), SendDraft)
    assert send.draft.decode_steps == 0


def test_tree_verdict_after_rebasing_commits_and_tells_the_drafter_the_whole_path():
    loop, job = started()
    tree = DraftTree.chain([20, 21, 22])
    loop.on_job_done(job.tag, built(tree), 30.0, (0, 0.0), 0.1)
    loop.on_verdict(verdict(4, 20), 0.12)  # decoded alone while the tree was on its way: node 0
    acts = loop.on_verdict(verdict(6, 23, seq=1, accepted=(1,), rebased=1), 0.2)
    assert of(acts, Emit) == [Emit((21, 23))] and loop.generated == [20, 21, 23]
    (nxt,) = of(acts, Job)  # the commit goes first in the next draft job
    assert nxt.ops[0] == ("commit", built(tree), (0, 1), (20, 21, 23))
    assert nxt.ops[1:] == (("extend", ()), ("draft", TreeShape(1, 3, 3)))
    s = loop.stats
    assert (s.trees, s.rebased_tokens, s.accepted_tokens, s.rounds) == (1, 1, 1, 2)


def test_rebase_that_disagrees_with_the_edge_is_a_protocol_error():
    loop, job = started()
    loop.on_job_done(job.tag, built(DraftTree.chain([20, 21])), 30.0, (0, 0.0), 0.1)
    loop.on_verdict(verdict(4, 20), 0.12)
    with pytest.raises(ProtocolError, match="rebased by 0"):
        loop.on_verdict(verdict(5, 21, seq=1, rebased=0), 0.2)


def test_accepted_node_must_hang_below_the_rebase_point():
    loop, job = started()
    tree = DraftTree(tokens=(20, 30, 21), parents=(-1, -1, 0))
    loop.on_job_done(job.tag, built(tree), 30.0, (0, 0.0), 0.1)
    with pytest.raises(ProtocolError, match="accepts node 2, not a child of node -1"):
        loop.on_verdict(verdict(5, 22, seq=1, accepted=(2,)), 0.2)


def test_tree_left_by_tokens_committed_while_drafting_is_never_sent():
    loop, job = started()
    loop.on_verdict(verdict(4, 99), 0.05)  # the verifier decoded 99; the tree guesses 20
    acts = loop.on_job_done(job.tag, built(DraftTree.chain([20, 21])), 30.0, (0, 0.0), 0.1)
    assert not of(acts, SendDraft) and loop.stats.dead_trees == 1
    (nxt,) = of(acts, Job)
    assert nxt.ops[0] == ("commit", built(DraftTree.chain([20, 21])), (), (99,))  # dropped, history extended


def test_stale_verdict_commits_its_token_and_drops_the_tree():
    loop, job = started()
    tree = DraftTree.chain([20, 21])
    loop.on_job_done(job.tag, built(tree), 30.0, (0, 0.0), 0.1)
    acts = loop.on_verdict(verdict(4, 77, seq=1, stale=True, rebased=0), 0.2)
    assert of(acts, Emit) == [Emit((77,))] and loop.stats.stale_trees == 1
    assert of(acts, Job)[0].ops[0] == ("commit", built(tree), (), (77,))


def test_verdict_for_a_draft_not_in_flight():
    loop, job = started()
    with pytest.raises(ProtocolError, match="no draft is in flight"):
        loop.on_verdict(verdict(4, 20, seq=3), 0.1)


def test_grafted_nodes_extend_the_tree_but_not_the_drafters_path():
    ngram = Ngram([20, 31, 32])
    loop, job = started(ngram=ngram)
    tree = DraftTree.chain([20, 21])
    (send,) = of(loop.on_job_done(job.tag, built(tree), 30.0, (0, 0.0), 0.1), SendDraft)
    assert send.draft.tree == DraftTree((20, 21, 31, 32), (-1, 0, 0, 2))  # 31 -> 32 hangs below node 0
    acts = loop.on_verdict(verdict(7, 40, seq=1, accepted=(0, 2, 3)), 0.2)
    assert loop.generated == [20, 31, 32, 40] and loop.stats.ngram_accepted == 2
    assert of(acts, Job)[0].ops[0] == ("commit", built(tree), (0,), (20, 31, 32, 40))  # stops at the graft
    assert ngram.seen == [20, 31, 32, 40]


def speculating():
    """A tree in flight (chain 20 21) and a speculative tree drafted on the guess 20 21 (bonus guess 22)."""
    loop, job = started(shape=TreeShape(1, 2, 2), speculate=True)
    tree = DraftTree.chain([20, 21])
    acts = loop.on_job_done(job.tag, built(tree), 30.0, (0, 0.0), 0.1)
    (spec_job,) = of(acts, Job)
    assert spec_job.ops == (("speculate", built(tree), (0, 1), TreeShape(1, 3, 3)),)  # one level deeper
    spec = built(DraftTree.chain([22, 23, 24]))
    assert loop.on_job_done(spec_job.tag, spec, 25.0, (0, 0.0), 0.15) == []
    return loop, tree, spec


def test_speculation_that_held_goes_out_at_once():
    loop, tree, spec = speculating()
    acts = loop.on_verdict(verdict(6, 22, seq=1, accepted=(0, 1)), 0.2)
    (adopt,) = of(acts, Job)
    (send,) = of(acts, SendDraft)
    assert adopt.ops == (("adopt",),)
    assert send.draft.committed_len == 6 and send.draft.tree == DraftTree.chain([23, 24]) and send.draft.seq == 2
    assert loop.stats.proactive_hits == 1
    (spec2,) = of(loop.on_job_done(adopt.tag, spec, 0.0, (0, 0.0), 0.21), Job)  # speculating on the new flight
    assert spec2.ops[0][0] == "speculate"
    # its verdict commits against the speculative tree, the guessed bonus node first, with the next job
    assert not of(loop.on_verdict(verdict(8, 30, seq=2, accepted=(0,)), 0.3), Job)
    (nxt,) = of(loop.on_job_done(spec2.tag, None, 20.0, (0, 0.0), 0.31), Job)
    assert nxt.ops[0] == ("commit", spec, (0, 1), (22, 23, 30)) and nxt.ops[-1][0] == "draft"


@pytest.mark.parametrize("v, why", [
    (verdict(5, 99, seq=1, accepted=(0,)), "shorter path than guessed"),
    (verdict(6, 99, seq=1, accepted=(0, 1)), "other bonus than guessed"),
    (verdict(4, 99, seq=1, stale=True), "stale"),
])
def test_speculation_that_missed_is_discarded(v, why):
    loop, tree, spec = speculating()
    acts = loop.on_verdict(v, 0.2)
    assert not of(acts, SendDraft) and loop.stats.proactive_hits == 0, why
    assert of(acts, Job)[0].ops[0][0] == "commit", why


def test_speculation_is_not_adopted_when_grafted_nodes_were_accepted():
    """The drafter's first-choice path 20 21, and an n-gram graft 21 -> 22 below it that the target accepted:
    the drafter's path matches the guess but the committed history is longer; adopting would desynchronise it."""
    loop, job = started(shape=TreeShape(1, 2, 2), speculate=True, ngram=Ngram([20, 21, 22]))
    tree = DraftTree.chain([20, 21])
    acts = loop.on_job_done(job.tag, built(tree), 30.0, (0, 0.0), 0.1)
    (send,) = of(acts, SendDraft)
    assert send.draft.tree == DraftTree((20, 21, 22), (-1, 0, 1))
    (spec_job,) = of(acts, Job)
    loop.on_job_done(spec_job.tag, built(DraftTree.chain([23, 24, 25])), 25.0, (0, 0.0), 0.15)
    acts = loop.on_verdict(verdict(7, 23, seq=1, accepted=(0, 1, 2)), 0.2)  # bonus 23 = the guessed bonus
    assert not of(acts, SendDraft) and loop.stats.proactive_hits == 0
    assert of(acts, Job)[0].ops[0] == ("commit", built(tree), (0, 1), (20, 21, 22, 23))


def test_finish_closes_and_later_verdicts_change_nothing():
    loop, job = started()
    acts = loop.on_verdict(verdict(4, 2, finish=Finish.STOP), 0.1)
    assert of(acts, SendClose) and loop.finish == "stop"
    assert loop.on_verdict(verdict(5, 3), 0.2) == [] and loop.generated == [2]
    assert loop.on_job_done(job.tag, built(DraftTree.chain([5])), 1.0, (0, 0.0), 0.3) == []


def test_stop_string_closes():
    loop, job = started()
    assert loop.on_stop_string() == [SendClose()] and loop.finish == "stop"


def test_a_lost_connection_drops_the_tree_and_reopens_on_the_committed_history():
    loop, job = started()
    tree = DraftTree.chain([20, 21])
    loop.on_job_done(job.tag, built(tree), 30.0, (0, 0.0), 0.1)
    loop.on_verdict(verdict(4, 20), 0.12)
    assert loop.on_connection_lost() == []
    acts = loop.begin(1.0)
    assert of(acts, SendOpen) == [SendOpen(PROMPT + (20,), 99, 1 << 20, 1)] and not of(acts, Job)
    acts = loop.on_opened(Opened("t", Limits(99, 8, 6), 700), 1.1)
    (nxt,) = of(acts, Job)
    assert nxt.ops[0] == ("commit", built(tree), (), (20,)) and nxt.ops[-1][0] == "draft"
    assert of(loop.on_job_done(nxt.tag - 1, built(tree), 1.0, (0, 0.0), 1.2), SendDraft) == []  # stale job


def test_a_job_abandoned_by_a_lost_connection_is_ignored_and_its_tree_cleared():
    loop, job = started()
    loop.on_connection_lost()  # the draft job is still running
    loop.begin(1.0)
    acts = loop.on_opened(Opened("t", Limits(100, 8, 6), 700), 1.1)
    (nxt,) = of(acts, Job)
    assert nxt.ops[0] == ("extend", ())  # resets the drafter's trees before drafting again
    assert loop.on_job_done(job.tag, built(DraftTree.chain([20])), 1.0, (0, 0.0), 1.2) == []


def test_no_drafting_is_cloud_only_decoding():
    loop = RoundLoop(PROMPT, 100, FixedPlanner(None), CAPS)
    (start,) = of(loop.begin(0.0), Job)
    loop.on_opened(Opened("s", Limits(100, 8, 6), 500), 0.01)
    assert loop.on_job_done(start.tag, None, 0.0, (3, 5.0), 0.02) == []
    assert of(loop.on_verdict(verdict(4, 20), 0.1), Job) == []


def test_the_planner_sees_every_verdict():
    seen = []

    class Recording(FixedPlanner):
        def observe(self, r: Round):
            seen.append(r)

    loop = RoundLoop(PROMPT, 100, Recording(TreeShape(1, 2, 2)), CAPS)
    (start,) = of(loop.begin(0.0), Job)
    loop.on_opened(Opened("s", Limits(100, 8, 6), 500), 0.01)
    loop.on_verdict(verdict(4, 20), 0.5)
    (job,) = of(loop.on_job_done(start.tag, None, 0.0, (3, 5.0), 0.55), Job)
    loop.on_job_done(job.tag, built(DraftTree.chain([21, 22])), 40.0, (0, 0.0), 0.6)
    loop.on_verdict(verdict(5, 21), 0.62)
    loop.on_verdict(verdict(7, 23, seq=1, accepted=(1,), rebased=1), 0.7)
    assert [r.streamed for r in seen] == [True, True, False]
    assert seen[0].first and not seen[1].first and seen[1].gap_ms == pytest.approx(120.0)
    tree = seen[2]
    assert (tree.rebased, tree.accepted, tree.depth, tree.tokens, tree.draft_ms) == (1, 1, 1, 2, 40.0)
    assert tree.round_ms == pytest.approx(100.0)


def test_lock_step_with_a_full_drafter_asks_the_verifier_to_stream_the_rest():
    loop, job = started(stream=False)
    full = BuiltTree(DraftTree(), (), (), full=True)
    (send,) = of(loop.on_job_done(job.tag, full, 1.0, (0, 0.0), 0.1), SendDraft)
    assert send.draft.tree == DraftTree() and send.draft.decode_steps == 1 << 20  # no tree: decode alone
    assert of(loop.on_verdict(verdict(4, 20, seq=1), 0.2), Emit) == [Emit((20,))]
    assert not of(loop.on_verdict(verdict(5, 21), 0.3), SendDraft)  # streaming now: nothing more to ask


@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_draft_costs_one_round_not_the_rest_of_the_generation(stream):
    """A drafter with nothing to draft this round (a translating drafter whose text spelled no whole target token
    yet) is not a full one: the verifier decodes this round's token alone, and the next round drafts again."""
    loop, job = started(stream=stream)
    (send,) = of(loop.on_job_done(job.tag, built(DraftTree()), 1.0, (0, 0.0), 0.1), SendDraft)
    assert send.draft.tree == DraftTree() and send.draft.decode_steps == 0  # one token, then back to drafting
    (again,) = of(loop.on_verdict(verdict(4, 20, seq=1), 0.2), Job)
    assert any(op[0] == "draft" for op in again.ops)
    (send,) = of(loop.on_job_done(again.tag, built(DraftTree.chain([21, 22])), 1.0, (0, 0.0), 0.3), SendDraft)
    assert send.draft.tree == DraftTree.chain([21, 22])


def test_a_waiting_verifier_is_never_left_waiting():
    """Lock-step, then the planner stops drafting (say the policy switched to cloud-only decoding): the verifier
    is waiting for a draft, so an empty one restarts its run."""
    class Switch(FixedPlanner):
        def shape(self, pending_tokens):
            return None if self.off else self._shape

    planner = Switch(TreeShape(1, 2, 2), stream=False)
    planner.off = False
    loop = RoundLoop(PROMPT, 100, planner, CAPS)
    (start,) = of(loop.begin(0.0), Job)
    loop.on_opened(Opened("s", Limits(100, 8, 6), 500), 0.01)
    (job,) = of(loop.on_job_done(start.tag, None, 0.0, (3, 5.0), 0.02), Job)
    loop.on_job_done(job.tag, built(DraftTree.chain([20, 21])), 1.0, (0, 0.0), 0.1)
    planner.off = True
    (send,) = of(loop.on_verdict(verdict(6, 22, seq=1, accepted=(0, 1)), 0.2), SendDraft)
    assert send.draft.tree == DraftTree() and send.draft.decode_steps == 1 << 20 and send.draft.committed_len == 6


class Shadowing(FixedPlanner):
    """Cloud-only decoding that asks for a shadow chain whenever the drafter is free; records what it is told."""

    def __init__(self, depth=3):
        super().__init__(None)
        self.depth, self.scored, self.rounds = depth, [], []

    def shadow(self, pending_tokens):
        return TreeShape(1, self.depth, self.depth)

    def observe_shadow(self, depth, accepted, draft_ms):
        self.scored.append((depth, accepted, draft_ms))

    def observe(self, r):
        self.rounds.append(r)


def shadow_started(planner):
    loop = RoundLoop(PROMPT, 100, planner, CAPS)
    (start,) = of(loop.begin(0.0), Job)
    assert start.ops == (("start", PROMPT),)  # cloud-only decoding: no catch-up while the verifier prefills
    loop.on_opened(Opened("s", Limits(100, 8, 6), 500), 0.01)
    assert loop.on_job_done(start.tag, None, 0.0, (0, 0.0), 0.02) == []  # no shadow before the first token
    return loop


def test_a_shadow_chain_is_drafted_on_the_stream_scored_against_it_and_never_sent():
    planner = Shadowing()
    loop = shadow_started(planner)
    (job,) = of(loop.on_verdict(verdict(4, 20), 0.1), Job)
    assert job.ops == (("extend", (20,)), ("draft", TreeShape(1, 3, 3)))
    loop.on_verdict(verdict(5, 21), 0.15)  # streams on while the drafter works
    chain = built(DraftTree.chain([21, 22, 40]))
    assert loop.on_job_done(job.tag, chain, 30.0, (4, 8.0), 0.2) == []  # one at a time: this one is not scored
    assert planner.scored == []  # 21 matched so far: undecided
    acts = loop.on_verdict(verdict(6, 22), 0.25)
    assert planner.scored == [] and not of(acts, Job)
    acts = loop.on_verdict(verdict(7, 23), 0.3)  # 40 was wrong: two of three matched
    assert planner.scored == [(3, 2, 30.0)]
    assert loop.stats.shadow_chains == 1 and loop.stats.shadow_accepted == 2
    (nxt,) = of(acts, Job)  # the drafter drops the shadow tree and keeps every streamed token
    assert nxt.ops == (("commit", chain, (), (21,)), ("extend", (22, 23)), ("draft", TreeShape(1, 3, 3)))
    assert loop.stats.trees == 0 and loop.generated == [20, 21, 22, 23]


def test_a_fully_matched_shadow_chain_is_scored_as_soon_as_its_last_node_streams():
    planner = Shadowing(depth=2)
    loop = shadow_started(planner)
    (job,) = of(loop.on_verdict(verdict(4, 20), 0.1), Job)
    loop.on_verdict(verdict(5, 21), 0.15)
    loop.on_verdict(verdict(6, 22), 0.16)
    loop.on_job_done(job.tag, built(DraftTree.chain([21, 22])), 20.0, (0, 0.0), 0.2)  # already decided
    assert planner.scored == [(2, 2, 20.0)]


def test_streamed_verdicts_say_whether_the_drafter_worked_meanwhile():
    planner = Shadowing()
    loop = shadow_started(planner)
    (job,) = of(loop.on_verdict(verdict(4, 20), 0.1), Job)  # the shadow job starts after this verdict
    loop.on_verdict(verdict(5, 21), 0.15)  # ... so this forward overlapped it
    # wrong at once (21 streamed, not 30): scored, and the next one starts
    (job2,) = of(loop.on_job_done(job.tag, built(DraftTree.chain([30, 31, 32])), 30.0, (0, 0.0), 0.2), Job)
    assert planner.scored == [(3, 0, 30.0)]
    loop.on_verdict(verdict(6, 22), 0.25)
    planner.shadow = lambda pending: None
    loop.on_job_done(job2.tag, built(DraftTree.chain([50, 51, 52])), 30.0, (0, 0.0), 0.26)
    loop.on_verdict(verdict(7, 23), 0.3)  # the second job ran since the last verdict: overlapped
    loop.on_verdict(verdict(8, 24), 0.4)  # nothing ran: alone
    # the first: the drafter's start ran during the prefill (a first verdict is no rate for the planner anyway)
    assert [r.overlapped for r in planner.rounds] == [True, True, True, True, False]


def test_no_proactive_drafting_where_a_working_drafter_slows_the_verifier():
    for ok in (True, False):
        planner = FixedPlanner(TreeShape(1, 2, 2))
        planner.overlap_ok = ok
        loop = RoundLoop(PROMPT, 100, planner, CAPS, speculate=True)
        (start,) = of(loop.begin(0.0), Job)
        loop.on_opened(Opened("s", Limits(100, 8, 6), 500), 0.01)
        (job,) = of(loop.on_job_done(start.tag, None, 0.0, (3, 5.0), 0.02), Job)
        acts = loop.on_job_done(job.tag, built(DraftTree.chain([20, 21])), 30.0, (0, 0.0), 0.1)
        assert [a.ops[0][0] for a in of(acts, Job)] == (["speculate"] if ok else [])


@pytest.mark.parametrize("warms_up", [True, False])
def test_the_planner_is_told_what_drafting_would_first_evaluate_a_cold_prompt_included(warms_up):
    """A planner that does not warm the drafter up on the prompt (its drafter slows the verifier) gets a cold
    prompt: the first draft evaluates all of it, and entering a drafting mode is priced on that (on shared cores
    a 150-token prompt's catch-up took 0.9 s, the verifier making 1-10 tokens meanwhile; 2026-12-04)."""
    class Recording(FixedPlanner):
        def __init__(self):
            super().__init__(TreeShape(1, 3, 3))
            self.drafts, self.asked, self.seen = warms_up, [], []

        def shape(self, pending_tokens):
            self.asked.append(pending_tokens)
            return self._shape if len(self.seen) >= 2 else None

        def observe(self, r):
            self.seen.append(r.pending)

    planner = Recording()
    loop = RoundLoop(PROMPT, 100, planner, CAPS)
    (start,) = of(loop.begin(0.0), Job)
    assert start.ops == ((("start", PROMPT), ("catch_up",)) if warms_up else (("start", PROMPT),))
    loop.on_opened(Opened("s", Limits(100, 8, 6), 500), 0.01)
    loop.on_job_done(start.tag, None, 0.0, (3, 5.0) if warms_up else (0, 0.0), 0.02)
    cold = 0 if warms_up else len(PROMPT)
    loop.on_verdict(verdict(4, 20), 0.1)
    (job,) = of(loop.on_verdict(verdict(5, 21), 0.2), Job)
    assert planner.seen == [cold + 1, cold + 2] and planner.asked[-1] == cold + 2
    assert job.ops[0] == ("extend", (20, 21))  # (the drafter's own catch-up evaluates the cold prompt first)
    loop.on_verdict(verdict(6, 22), 0.3)  # a token decoded alone while it drafts: the prompt is evaluated now
    assert planner.seen[-1] == 1


def test_a_verdict_whose_committed_tokens_differ_from_the_edges_is_a_protocol_error():
    """Every verdict carries the verifier's rolling hash of its committed tokens: the same length with another token
    (which the length check cannot see) is caught at once."""
    from dataclasses import replace

    from tandem.core.messages import HASH_START, extend_hash
    loop = RoundLoop(PROMPT, 100, FixedPlanner(TreeShape(1, 3, 3)), CAPS)
    loop.begin(0.0)
    loop.on_opened(Opened("s", Limits(100, 8, 6), 500), 0.01)
    good = extend_hash(HASH_START, PROMPT + (20,))
    assert good == extend_hash(extend_hash(HASH_START, PROMPT), [20]) != extend_hash(HASH_START, PROMPT + (21,))
    assert of(loop.on_verdict(replace(verdict(4, 20), committed_hash=good), 0.1), Emit) == [Emit((20,))]
    wrong = replace(verdict(5, 21), committed_hash=extend_hash(good, [22]))
    with pytest.raises(ProtocolError, match="differ from the edge's at committed length 5"):
        loop.on_verdict(wrong, 0.2)


def test_stats_of_two_generations_sum_counts_and_keep_the_later_policy_decision():
    a = GenerationStats(generated_tokens=10, rounds=4, accepted_by_depth=[3, 1], policy={"mode": "rounds"})
    b = GenerationStats(generated_tokens=6, rounds=6, accepted_by_depth=[2, 2, 1], policy={"mode": "plain"})
    a.add(b)
    assert (a.generated_tokens, a.rounds, a.accepted_by_depth) == (16, 10, [5, 3, 1])
    assert a.policy == {"mode": "plain"} and a.policy is not b.policy


def test_the_planner_hears_the_hosts_pace_from_host_chains_and_from_steps_it_had_no_seat_for():
    """Host verdicts carry the pace the host gives this session: a chain's (drafted, accepted) with it, and a step
    decoded alone because every seat was taken (host_drafted 0) with a pace alone, which the planner must hear to
    leave the host; a plain streamed verdict says nothing of the host."""
    from dataclasses import replace
    heard = []

    forwards = []

    class Hosted(FixedPlanner):
        def observe_host(self, level_ms, drafted, accepted):
            heard.append((level_ms, drafted, accepted))

        def observe(self, r: Round):
            forwards.append(r.forward_tokens)

    loop = RoundLoop(PROMPT, 100, Hosted(None, host=True), CAPS)
    loop.begin(0.0)
    loop.on_opened(Opened("s", Limits(100, 8, 6), 500, host_drafter="tiny", host_level_us=6000), 0.01)
    loop.on_verdict(replace(verdict(7, 23), host_tokens=(20, 21, 22), host_drafted=4, host_level_us=6500,
                            forward_tokens=5), 0.1)
    loop.on_verdict(replace(verdict(8, 24), host_level_us=130_000), 0.2)  # no seat: decoded alone
    loop.on_verdict(verdict(9, 25), 0.3)
    assert heard == [(6.0, 0, 0), (6.5, 4, 3), (130.0, 0, 0)]
    assert loop.generated == [20, 21, 22, 23, 24, 25]
    assert forwards == [5, 1, 1]  # the host chain's forward held 5 tokens: not a one-token forward's time
    heard.clear()  # a session opened with no host drafter for it (none, or every seat taken): None
    RoundLoop(PROMPT, 100, Hosted(None, host=True), CAPS).on_opened(Opened("t", Limits(100, 8, 6), 500), 0.01)
    assert heard == [(None, 0, 0)]
