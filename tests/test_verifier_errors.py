"""Bad input at the verifier: the right gRPC status and an actionable message, one test per case, while a
bystander session on the same server keeps producing exactly the target's greedy tokens."""
import queue
import time

import grpc
import pytest

from tandem.cloud import reference
from tandem.cloud.server import serve
from tandem.edge.client import health
from tandem.protos import verifier_pb2 as pb
from tandem.protos import verifier_pb2_grpc as pb_grpc

pytestmark = pytest.mark.models

PROMPT_TEXT = "def add(a, b):\n    return"


class Stream:
    """A raw session stream: send messages one by one, read answers one by one."""

    def __init__(self, address):
        self.channel = grpc.insecure_channel(address)
        self.requests = queue.SimpleQueue()
        self.responses = pb_grpc.VerifierStub(self.channel).Session(iter(self.requests.get, None), timeout=120)

    def send(self, **kind):
        self.requests.put(pb.SessionRequest(**kind))
        return next(self.responses)

    def close(self):
        self.requests.put(None)
        self.responses.cancel()
        self.channel.close()


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.model.tokenize(PROMPT_TEXT)


def open_msg(prompt, **limits):
    return pb.Open(prompt_tokens=prompt, limits=pb.Limits(max_new_tokens=limits.get("new", 32),
                                                          max_tree_nodes=limits.get("nodes", 8),
                                                          max_tree_depth=limits.get("depth", 4)))


@pytest.fixture(scope="module")
def bystander(server, engine, prompt):
    """Opened before the bad clients; advanced one greedy token after every case; must never be disturbed."""
    s = Stream(server)
    opened = s.send(open=open_msg(prompt, new=64)).opened
    state = {"sid": opened.session_id, "len": len(prompt), "tokens": []}

    def step():
        state["seq"] = state.get("seq", 0) + 1
        v = s.send(draft=pb.Draft(session_id=state["sid"], committed_len=state["len"], tree=pb.DraftTree(),
                                  seq=state["seq"])).verdict
        assert v.committed_len == state["len"] + 1 and list(v.accepted) == []
        state["len"] += 1
        state["tokens"].append(v.bonus_token)

    yield step
    expected = reference.greedy(engine, prompt, len(state["tokens"])).tokens
    assert state["tokens"] == expected, "a bad client disturbed another session"
    s.close()


def expect_error(address, messages, code, fragment):
    s = Stream(address)
    try:
        with pytest.raises(grpc.RpcError) as info:
            for m in messages:
                s.send(**m)
        assert info.value.code() == code, info.value.details()
        assert fragment in info.value.details()
    finally:
        s.close()
    return info.value.details()


def tree(tokens, parents):
    return pb.DraftTree(tokens=tokens, parents=parents)


class WithSid:
    """Open a session, then send drafts that carry its real session id (so only the tree is wrong)."""

    def __init__(self, address, prompt, **limits):
        self.s = Stream(address)
        self.opened = self.s.send(open=open_msg(prompt, **limits)).opened
        self.len = len(prompt)

    def draft(self, t, committed_len=None, sid=None, seq=1, **fields):
        return self.s.send(draft=pb.Draft(session_id=self.opened.session_id if sid is None else sid,
                                          committed_len=self.len if committed_len is None else committed_len,
                                          tree=t, seq=seq, **fields))


def expect_draft_error(address, prompt, t, code, fragment, bystander, **kw):
    sess = WithSid(address, prompt, **{k: v for k, v in kw.items() if k in ("nodes", "depth")})
    try:
        with pytest.raises(grpc.RpcError) as info:
            sess.draft(t, committed_len=kw.get("committed_len"), sid=kw.get("sid"))
        assert info.value.code() == code, info.value.details()
        assert fragment in info.value.details(), info.value.details()
    finally:
        sess.s.close()
    bystander()


INVALID = grpc.StatusCode.INVALID_ARGUMENT


def test_parent_out_of_range(server, prompt, bystander):
    expect_draft_error(server, prompt, tree([1, 2], [-1, 7]), INVALID, "node 1 has parent 7", bystander)


def test_parent_not_topological(server, prompt, bystander):
    expect_draft_error(server, prompt, tree([1, 2], [1, -1]), INVALID, "topological order", bystander)


def test_duplicate_sibling_tokens(server, prompt, bystander):
    expect_draft_error(server, prompt, tree([5, 5], [-1, -1]), INVALID, "siblings must carry distinct tokens",
                       bystander)


def test_token_outside_vocabulary(server, prompt, bystander, engine):
    expect_draft_error(server, prompt, tree([engine.vocab_size], [-1]), INVALID, "outside the vocabulary",
                       bystander)


def test_tree_over_node_limit(server, prompt, bystander):
    expect_draft_error(server, prompt, tree([1, 2, 3, 4, 5], [-1, -1, -1, -1, -1]), INVALID,
                       "5 nodes, over the negotiated limit of 4", bystander, nodes=4)


def test_tree_over_depth_limit(server, prompt, bystander):
    expect_draft_error(server, prompt, tree([1, 2, 3], [-1, 0, 1]), INVALID, "depth 3, over the negotiated limit of 2",
                       bystander, depth=2)


def test_length_mismatch_in_tree(server, prompt, bystander):
    expect_draft_error(server, prompt, tree([1, 2], [-1]), INVALID, "equal length", bystander)


def test_draft_more_than_a_tree_ahead(server, prompt, bystander):
    expect_draft_error(server, prompt, tree([1], [-1]), INVALID, "one tree can add at most 5", bystander,
                       committed_len=len(prompt) + 6, depth=4)


def test_draft_without_a_sequence_number(server, prompt, bystander):
    sess = WithSid(server, prompt)
    try:
        with pytest.raises(grpc.RpcError) as info:
            sess.draft(tree([1], [-1]), seq=0)
        assert info.value.code() == INVALID and "seq" in info.value.details()
    finally:
        sess.s.close()
    bystander()


def test_stale_draft_is_answered_with_a_token_decoded_alone(server, engine, prompt, bystander):
    """A draft built on a guess the verifier did not commit is not an error (drafting ahead makes them normal):
    its verdict says stale and carries the target's own next token."""
    ref = reference.greedy(engine, prompt, 2).tokens
    sess = WithSid(server, prompt)
    try:
        v = sess.draft(tree([ref[1]], [-1]), committed_len=len(prompt) + 1,
                       assumed_tokens=[(ref[0] + 1) % 1000]).verdict
        assert v.stale and v.draft_seq == 1 and list(v.accepted) == [] and v.bonus_token == ref[0]
        assert v.committed_len == len(prompt) + 1
    finally:
        sess.s.close()
    bystander()


def test_nan_temperature_is_invalid(server, prompt, bystander):
    msg = open_msg(prompt)
    msg.sampling.temperature = float("nan")
    expect_error(server, [dict(open=msg)], INVALID, "temperature must be a finite number")
    bystander()


def test_draft_for_unknown_session(server, prompt, bystander):
    expect_draft_error(server, prompt, tree([1], [-1]), grpc.StatusCode.NOT_FOUND, "unknown session 'nope'",
                       bystander, sid="nope")


def test_draft_before_open(server, bystander):
    expect_error(server, [dict(draft=pb.Draft(session_id="x", committed_len=1))], grpc.StatusCode.NOT_FOUND,
                 "send Open first")
    bystander()


def test_close_ends_the_stream(server, prompt, bystander):
    sess = WithSid(server, prompt)
    closed = sess.s.send(close=pb.Close(session_id=sess.opened.session_id)).closed
    assert closed.committed_len == len(prompt)
    with pytest.raises(StopIteration):  # the stream ended with OK: a later draft is never read
        sess.draft(tree([1], [-1]))
    assert health(server).active_sessions == 1  # only the bystander
    sess.s.close()
    bystander()


def test_prompt_longer_than_context(server, engine, bystander):
    too_long = [198] * (engine.n_ctx + 10)
    expect_error(server, [dict(open=open_msg(too_long))], INVALID, f"does not fit the context of {engine.n_ctx}")
    bystander()


def test_prompt_token_outside_vocabulary_and_empty_prompt(server, engine, bystander):
    expect_error(server, [dict(open=open_msg([1, engine.vocab_size + 5]))], INVALID, "outside the vocabulary")
    expect_error(server, [dict(open=open_msg([]))], INVALID, "prompt_tokens is empty")
    bystander()


def test_vocabulary_and_model_mismatch(server, prompt, bystander):
    msg = open_msg(prompt)
    msg.vocab_size = 32000
    expect_error(server, [dict(open=msg)], grpc.StatusCode.FAILED_PRECONDITION, "vocabulary size 32000")
    msg = open_msg(prompt)
    msg.vocab_fingerprint = "0" * 64
    expect_error(server, [dict(open=msg)], grpc.StatusCode.FAILED_PRECONDITION, "fingerprint")
    msg = open_msg(prompt)
    msg.target_model = "llama-70b"
    expect_error(server, [dict(open=msg)], grpc.StatusCode.FAILED_PRECONDITION, "llama-70b")
    bystander()


def test_capacity_is_resource_exhausted(engine, prompt, bystander):
    srv, port = serve(engine, "127.0.0.1:0", max_sessions=1)
    try:
        first = WithSid(f"127.0.0.1:{port}", prompt)
        expect_error(f"127.0.0.1:{port}", [dict(open=open_msg(prompt))], grpc.StatusCode.RESOURCE_EXHAUSTED,
                     "maximum of 1 sessions")
        assert first.draft(tree([], [])).verdict.committed_len == len(prompt) + 1  # the first one still works
        first.s.close()
    finally:
        srv.stop(grace=None)
    bystander()


def test_granted_limits_are_capped(server, prompt, engine):
    sess = WithSid(server, prompt, nodes=1000, depth=100)
    limits = sess.opened.limits
    assert limits.max_tree_nodes == min(64, engine.max_tree_nodes) and limits.max_tree_depth == 16
    assert limits.max_new_tokens == 32
    sess.s.close()


def test_idle_session_expires_and_frees_its_cache(engine, prompt, bystander):
    srv, port = serve(engine, "127.0.0.1:0", max_sessions=2, idle_timeout_s=0.5)
    try:
        sess = WithSid(f"127.0.0.1:{port}", prompt)
        time.sleep(1.5)  # the client goes silent
        with pytest.raises(grpc.RpcError) as info:
            sess.draft(tree([], []))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "expired" in info.value.details()
        assert health(f"127.0.0.1:{port}").active_sessions == 0
        sess.s.close()
    finally:
        srv.stop(grace=None)
    bystander()


def test_decode_runs_stream_target_only_tokens_and_end_at_the_limit(server, engine, prompt, bystander):
    """Server-side decoding: Open(decode_steps=3) streams 3 tokens right after the prefill, a Draft's
    decode_steps streams after its verdict; all equal target-only greedy decoding, and a run longer than
    max_new_tokens ends at the limit with LENGTH."""
    s = Stream(server)
    try:
        opened = s.send(open=pb.Open(prompt_tokens=prompt, limits=pb.Limits(max_new_tokens=7), decode_steps=3)).opened
        verdicts = [next(s.responses).verdict for _ in range(3)]
        assert [v.draft_seq for v in verdicts] == [0, 0, 0]
        s.requests.put(pb.SessionRequest(draft=pb.Draft(session_id=opened.session_id, seq=1,
                                                        committed_len=len(prompt) + 3, decode_steps=100)))
        verdicts += [next(s.responses).verdict for _ in range(4)]
        assert [v.draft_seq for v in verdicts[3:]] == [1, 0, 0, 0]
        assert [v.committed_len for v in verdicts] == [len(prompt) + i for i in range(1, 8)]
        assert all(not v.accepted for v in verdicts)
        assert [v.finish_reason for v in verdicts] == [pb.FINISH_REASON_UNSPECIFIED] * 6 + [pb.FINISH_REASON_LENGTH]
        assert [v.bonus_token for v in verdicts] == reference.greedy(engine, prompt, 7).tokens
        closed = s.send(close=pb.Close(session_id=opened.session_id)).closed  # the run ended: Close is next
        assert closed.committed_len == len(prompt) + 7
    finally:
        s.close()
    bystander()


def test_a_draft_interrupts_a_run_and_is_rebased_onto_its_tokens(server, engine, prompt, bystander):
    """The verifier decodes alone from the prefill on; a tree drafted on the prompt arrives after two streamed
    tokens: it stops the run, is walked along those two tokens and its remaining nodes are verified, then the run
    resumes. Every token is the target's greedy one."""
    ref = reference.greedy(engine, prompt, 12).tokens
    s = Stream(server)
    try:
        opened = s.send(open=pb.Open(prompt_tokens=prompt, limits=pb.Limits(max_new_tokens=12,
                                                                              max_tree_depth=8, max_tree_nodes=8),
                                     decode_steps=1000)).opened
        first = [next(s.responses).verdict for _ in range(2)]
        chain = ref[:6]
        s.requests.put(pb.SessionRequest(draft=pb.Draft(session_id=opened.session_id, seq=1, committed_len=len(prompt),
                                                        tree=tree(chain, list(range(-1, 5))), decode_steps=2)))
        got = first + [next(s.responses).verdict]
        while got[-1].draft_seq != 1:
            got.append(next(s.responses).verdict)
        v = got[-1]
        streamed = len(got) - 1
        assert v.rebased == streamed and 2 <= streamed < 6
        assert list(v.accepted) == list(range(streamed, 6)) and not v.stale
        assert v.forward_tokens == 1 + 6 - streamed
        after = [next(s.responses).verdict for _ in range(2)]  # its decode_steps: two more tokens, then it waits
        tokens = [x.bonus_token for x in got[:-1]] + chain[streamed:] + [v.bonus_token] + [x.bonus_token for x in after]
        assert tokens == ref[:len(tokens)] and after[-1].committed_len == len(prompt) + len(tokens)
        closed = s.send(close=pb.Close(session_id=opened.session_id)).closed
        assert closed.committed_len == len(prompt) + len(tokens)
    finally:
        s.close()
    bystander()
