"""Planted bugs, each run through the checks the lossless tests make (tests/lossless_checks.py, the engine's cell
check, the edge's committed-hash check), each of which must report it. A check is only as good as the bug it
catches: when one of these passes, a lossless test has gone blind.

Each mutant also counts how often it changed something, so a pass means "caught", never "never fired". The stacks
are tiny random-weight models (a deterministic torch target, where target-only decoding is the exact reference;
a tiny GGUF on llama.cpp for the KV cells); one test runs the real pair, where batch-shape noise makes every
divergence look like a near-tie one at a time."""
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tandem.cloud import acceptance, reference  # noqa: E402
from tandem.cloud import session as session_module  # noqa: E402
from tandem.cloud.acceptance import Acceptance  # noqa: E402
from tandem.cloud.backend import LocalBackend  # noqa: E402
from tandem.cloud.server import serve  # noqa: E402
from tandem.cloud.engines.torch_engine import TorchVerifierEngine  # noqa: E402
from tandem.core.sampling import Sampling, target_token  # noqa: E402
from tandem.core.tree import TreeShape  # noqa: E402
from tandem.edge.client import EdgeClient, RemoteError  # noqa: E402
from tandem.edge.planner import FixedPlanner  # noqa: E402
from tandem.edge.rounds import RoundLoop  # noqa: E402

from lossless_checks import audited, greedy_verdicts  # noqa: E402
from tinystack import TinyDrafter, tiny_model  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [7, 3, 9, 2], [4, 4, 8, 1, 6, 2], [11, 5, 2, 7]]
NEW = 12


class Fired:
    """How many times a mutant changed the outcome it planted a bug in."""
    n = 0


def lenient(window: float, fired: Fired):
    """A greedy acceptor that takes a drafted child whenever its logit is within ``window`` of the best (the
    target's own token is the best alone): the bug a near-tie excuse hides."""
    real = acceptance.accept

    def accept(tree, rows, sampling, uniform=lambda d: 0.0):
        if not sampling.greedy:
            return real(tree, rows, sampling, uniform)
        node, accepted = -1, []
        while True:
            row = np.asarray(rows[node + 1])
            best = int(np.argmax(row))
            child = next((c for c in tree.children[node + 1] if row[tree.tokens[c]] >= row[best] - window), None)
            if child is None:
                return Acceptance(tuple(accepted), best)
            fired.n += tree.tokens[child] != best
            accepted.append(child)
            node = child
    return accept


def drafter_biased(boost: float, fired: Fired):
    """Sampled acceptance whose draw favours the drafter's first proposal at each node (its logit raised by
    ``boost``): the committed distribution leans towards the draft, by a few percent in total variation."""
    def accept(tree, rows, sampling, uniform=lambda d: 0.0):
        node, accepted = -1, []
        while True:
            row = np.array(rows[node + 1], dtype=np.float64)
            kids = tree.children[node + 1]
            honest = target_token(row, sampling, uniform(len(accepted)))
            if kids:
                row[tree.tokens[kids[0]]] += boost
            x = target_token(row, sampling, uniform(len(accepted)))
            fired.n += x != honest
            child = next((c for c in kids if tree.tokens[c] == x), None)
            if child is None:
                return Acceptance(tuple(accepted), x)
            accepted.append(child)
            node = child
    return accept


@pytest.fixture(scope="module")
def tiny():
    """A deterministic tiny target behind the real server, and a drafter of other weights (it proposes tokens the
    target does not choose, within a logit or so: a lenient or biased acceptor gets its chances)."""
    engine = TorchVerifierEngine(model=tiny_model(0, sharpness=3.0), n_ctx=64, device="cpu", max_sessions=2,
                                 deterministic=True)
    backend = LocalBackend(engine, max_sessions=2)
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    yield engine, f"127.0.0.1:{port}"
    srv.stop(None)
    backend.scheduler.stop()


def generate(address, prompts, sampling=Sampling(), shape=TreeShape(2, 6, 3), seeds=None):
    client = EdgeClient(TinyDrafter(tiny_model(1, sharpness=3.0)), address, max_tree_nodes=8, max_tree_depth=4)
    try:
        return [client.generate(p, max_new_tokens=NEW, planner=FixedPlanner(shape, stream=False),
                                sampling=sampling if seeds is None else replace(sampling, seed=seeds + i)).result()
                .tokens for i, p in enumerate(prompts)]
    finally:
        client.close()


def test_the_checks_pass_the_honest_verifier(tiny):
    """(The control: without a mutant every check below is silent, so what they report below is the mutant.)"""
    engine, address = tiny
    with audited() as audit:
        outs = generate(address, PROMPTS)
        sampled = generate(address, PROMPTS, Sampling(1.0), seeds=100)
    audit.check()
    assert all(v.ok for v in greedy_verdicts(outs, [reference.greedy(engine, p, NEW) for p in PROMPTS], None))
    assert sampled == [reference.decode(engine, p, NEW, Sampling(1.0, seed=100 + i)).tokens
                       for i, p in enumerate(PROMPTS)]


def test_a_lenient_greedy_acceptor_is_reported(tiny):
    engine, address = tiny
    fired = Fired()
    with mock.patch.object(session_module, "accept", lenient(1.2, fired)), audited() as audit:
        outs = generate(address, PROMPTS)
    assert fired.n > 0, "the mutant never fired: nothing was tested"
    with pytest.raises(AssertionError, match="not the target's own"):
        audit.check()
    verdicts = greedy_verdicts(outs, [reference.greedy(engine, p, NEW) for p in PROMPTS], None)
    assert not all(v.ok for v in verdicts)


def test_a_sampled_draw_biased_towards_the_draft_is_reported(tiny):
    """Seeded generations against target-only decoding at the same seeds (position-keyed draws make them the same
    tokens): any draw the bias moved shows, where a chi-square test over hundreds of generations mostly would not."""
    engine, address = tiny
    fired, sampling = Fired(), Sampling(1.0)
    with mock.patch.object(session_module, "accept", drafter_biased(0.3, fired)), audited() as audit:
        outs = generate(address, PROMPTS * 2, sampling, seeds=100)
    assert fired.n > 0, "the mutant never fired: nothing was tested"
    with pytest.raises(AssertionError, match="not the target's own"):
        audit.check()
    refs = [reference.decode(engine, p, NEW, replace(sampling, seed=100 + i)) for i, p in enumerate(PROMPTS * 2)]
    assert any(o != r.tokens for o, r in zip(outs, refs))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """The tiny target as a GGUF on the llama.cpp engine (its KV cells are llama.cpp's), behind the real server."""
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    from tiny_gguf import write_gguf
    path = write_gguf(tiny_model(0, sharpness=3.0), tmp_path_factory.mktemp("tiny") / "tiny.gguf", vocab=True)
    engine = LlamaVerifierEngine(path, n_ctx=64, max_tree_nodes=8, n_threads=1, max_sessions=2)
    backend = LocalBackend(engine, max_sessions=2)
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    yield engine, f"127.0.0.1:{port}"
    srv.stop(None)
    backend.scheduler.stop()


def test_a_kv_cell_kept_from_a_rejected_branch_is_reported(tiny_llama):
    """keep_path forgets to clear the first branch's cells when the accepted path lies on another and reaches at
    least as deep: the rejected nodes stay in the session's history at positions the accepted path also holds, so
    the history's position range is right and only its cell count is not. The engine's cell check refuses the next
    forward (the generation fails loudly instead of committing what those cells would make it say)."""
    engine, address = tiny_llama
    fired, real_keep = Fired(), engine.keep_path

    def keep_path(seq, tree, path):
        ctx, real_rm, base = seq.ctx, seq.ctx.seq_rm, seq.n_past
        branch = seq.first + (tree.leaf_sets[path[-1]][0] if path else 0)

        def seq_rm(s, p0=-1, p1=-1):
            if (s == seq.first != branch and (p0, p1) == (-1, -1)
                    and base < ctx.seq_pos_max(s) <= base + len(path)):  # (within the range the path will hold)
                fired.n += 1  # the rejected branch's nodes stay
                return
            real_rm(s, p0, p1)
        with mock.patch.object(ctx, "seq_rm", seq_rm):
            real_keep(seq, tree, path)

    outs = generate(address, PROMPTS, shape=TreeShape(3, 8, 3))
    assert all(v.ok for v in greedy_verdicts(outs, [reference.greedy(engine, p, NEW) for p in PROMPTS], 1e-3))
    with mock.patch.object(engine, "keep_path", keep_path):
        with pytest.raises(RemoteError) as failed:
            generate(address, PROMPTS, shape=TreeShape(3, 8, 3))
    assert fired.n > 0, "the mutant never fired: nothing was tested"
    assert "cells of the session" in failed.value.details and "inconsistent" in failed.value.details


def test_an_unchecked_rolling_hash_is_reported():
    """The edge stops comparing the verifier's committed-token hash with its own (the length check stays): the
    test that a verdict with another token at the same length is a protocol error must fail."""
    import test_rounds
    real = RoundLoop._check_committed

    def length_only(self, v):
        real(self, replace(v, committed_hash=0))  # (a zero hash: "not sent", which the check skips)

    with mock.patch.object(RoundLoop, "_check_committed", length_only):
        with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
            test_rounds.test_a_verdict_whose_committed_tokens_differ_from_the_edges_is_a_protocol_error()
    test_rounds.test_a_verdict_whose_committed_tokens_differ_from_the_edges_is_a_protocol_error()  # (and passes)


@pytest.mark.models
def test_a_lenient_acceptor_is_reported_on_the_real_pair(engine, drafter, humaneval_chats, noise, target_greedy):
    """The review's probe: on the real pair, with penalties and logit bias (which narrow top-2 gaps), a lenient
    acceptor's tokens are each within the near-tie window, and one alone is indistinguishable from noise by the
    reference comparison (it counts them against what the measured noise explains). The audit sees every one, and
    the comparison sees the divergence: it is never "exact"."""
    prompt = engine.model.tokenize(engine.model.chat_prompt(humaneval_chats[0]))
    bias = engine.model.tokenize("def")[0]
    sampling = Sampling(presence_penalty=0.75, frequency_penalty=0.5, repetition_penalty=1.25,
                        logit_bias=((bias, -3.0),))
    srv, port = serve(engine, "127.0.0.1:0", max_sessions=1)
    fired = Fired()
    try:
        client = EdgeClient(drafter, f"127.0.0.1:{port}", TreeShape(4, 16, 6), stream=False)
        with mock.patch.object(session_module, "accept", lenient(1.2, fired)), audited() as audit:
            out = client.generate(prompt, max_new_tokens=40, sampling=sampling).result().tokens
        client.close()
    finally:
        srv.stop(grace=None)
    assert fired.n > 0, "the mutant never fired: nothing was tested"
    with pytest.raises(AssertionError, match="not the target's own"):
        audit.check()
    verdict = reference.classify(out, reference.decode(engine, prompt, 40, sampling), noise)
    assert verdict.kind != "exact", str(verdict)
