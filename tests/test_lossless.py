"""Lossless end to end on the real pair: edge drafter -> gRPC -> llama.cpp verifier, temperature 0, token-identical
to target-only greedy decoding with the same engine and model file, up to measured batch-shape near-ties (each judged
on the reference's own row, no more of them than the measured noise explains), and every committed token the
target's own token of the row the verifier computed (the acceptance audit, exact). The deterministic engine's tests
(tests/test_deterministic.py) make the same comparisons with no excuse at all."""
import numpy as np
import pytest

from tandem.cloud import reference
from tandem.cloud.server import serve
from tandem.edge.client import EdgeClient
from tandem.edge.planner import FixedPlanner
from tandem.core.sampling import Sampling
from tandem.core.tree import TreeShape

from lossless_checks import audited

pytestmark = pytest.mark.models

N_PROMPTS, NEW_TOKENS = 6, 64


class RecordingEngine:
    """Delegates to the real engine and records, per verify, the argmax of the verifier's own logits at every
    committed position (root row, then the rows of the accepted nodes)."""

    def __init__(self, inner):
        self.inner = inner
        self.expected: list[int] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward_batch(self, jobs):
        out = self.inner.forward_batch(jobs)
        self._argmax = {id(j.seq): rows.argmax(axis=1) for j, rows in zip(jobs, out)}
        return out

    def keep_path(self, seq, tree, path):
        argmax = self._argmax.pop(id(seq))
        self.expected += [int(argmax[0])] + [int(argmax[n + 1]) for n in path]
        self.inner.keep_path(seq, tree, path)


@pytest.fixture(scope="module")
def prompts(engine, humaneval_chats):
    return [engine.model.tokenize(engine.model.chat_prompt(c)) for c in humaneval_chats[:N_PROMPTS]]


@pytest.fixture(scope="module")
def references(engine, prompts, target_greedy):
    return [target_greedy(engine, p, NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def recording_server(engine):
    rec = RecordingEngine(engine)
    srv, port = serve(rec, "127.0.0.1:0", max_sessions=2)
    yield rec, f"127.0.0.1:{port}"
    srv.stop(grace=None)


@pytest.mark.parametrize("shape", ["1,6,6", "4,16,6"], ids=["chain", "tree"])
def test_greedy_is_token_identical_to_target_only(shape, drafter, prompts, references, noise, recording_server):
    rec, address = recording_server
    client = EdgeClient(drafter, address, TreeShape.parse(shape), stream=False)  # every token verified in a tree
    verdicts, taus = [], []
    for prompt, ref in zip(prompts, references):
        rec.expected = []
        gen = client.generate(prompt, max_new_tokens=NEW_TOKENS).result()
        # algorithmic half, exact: every committed token is the verifier's own argmax at its position
        assert gen.tokens == rec.expected[: len(gen.tokens)]
        verdicts.append(reference.classify(gen.tokens, ref, noise))
        taus.append(gen.stats.tau)
    client.close()
    other = [(i, v) for i, v in enumerate(verdicts) if v[0] == "other"]
    assert not other, f"divergences that are not near-ties (noise {noise:.3f}): {other}"
    assert sum(v[0] == "exact" for v in verdicts) >= N_PROMPTS - 2, verdicts
    # speculation must actually commit several tokens per target forward on code prompts
    assert np.mean(taus) > 2.0, taus


def test_greedy_with_penalties_and_logit_bias_is_the_penalised_targets(drafter, prompts, noise, engine,
                                                                       references, recording_server):
    """Penalties and logit bias change the target's greedy choice as a function of the history; the verifier shapes
    every tree row by its own path, so the output must equal target-only decoding with the same shaping. (Values
    exact in float32, as the wire carries them.)"""
    _, address = recording_server
    bias = engine.model.tokenize("def")[0]
    sampling = Sampling(presence_penalty=0.75, frequency_penalty=0.5, repetition_penalty=1.25,
                        logit_bias=((bias, -3.0),))
    client = EdgeClient(drafter, address, TreeShape(4, 16, 6), stream=False)
    verdicts, changed = [], 0
    with audited() as audit:  # every committed token is the penalised target's own of its shaped row
        for prompt, plain in zip(prompts[:2], references[:2]):
            ref = reference.decode(engine, prompt, 40, sampling)
            # cloud-only decoding runs the reference's own one-token forwards: exactly its tokens, no tie excused
            alone = client.generate(prompt, max_new_tokens=40, sampling=sampling, planner=FixedPlanner(None)).result()
            assert alone.tokens == ref.tokens
            gen = client.generate(prompt, max_new_tokens=40, sampling=sampling).result()
            verdicts.append(reference.classify(gen.tokens, ref, noise))
            changed += ref.tokens != plain.tokens[: len(ref.tokens)]
    client.close()
    audit.check()
    # trees: batch shapes move the logits, and penalties narrow the top-2 gaps, so near-ties are more frequent
    assert not [v for v in verdicts if v[0] == "other"], verdicts
    assert changed >= 1  # the shaping really changed the answers


COPY_PROMPT = [{"role": "user", "content": "Repeat this code exactly, then stop:\n```python\ndef add(a, b):\n"
                "    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n\ndef sub(a, b):\n"
                "    \"\"\"Return a minus b.\"\"\"\n    return a - b\n```"}]


def test_ngram_branch_commits_repeated_spans_losslessly(drafter, engine, noise, recording_server):
    """A copying task: prompt-lookup drafts grafted onto a short model chain get accepted, every committed token is
    still the verifier's own argmax, and the output equals target-only decoding."""
    from tandem.edge.ngram import NgramDrafter
    rec, address = recording_server
    prompt = engine.model.tokenize(engine.model.chat_prompt(COPY_PROMPT))
    ref = reference.greedy(engine, prompt, 48)
    plain = EdgeClient(drafter, address, TreeShape(1, 2, 2), stream=False).generate(prompt, max_new_tokens=48).result()
    rec.expected = []
    client = EdgeClient(drafter, address, TreeShape(1, 2, 2), max_tree_nodes=24, ngram=NgramDrafter(), stream=False)
    gen = client.generate(prompt, max_new_tokens=48).result()
    client.close()
    assert gen.tokens == rec.expected[: len(gen.tokens)]
    verdict = reference.classify(gen.tokens, ref, noise)
    assert verdict.ok, str(verdict)
    assert gen.stats.ngram_accepted >= 10, gen.stats
    assert gen.stats.rounds < plain.stats.rounds  # more tokens per forward than the 2-token chain alone


@pytest.fixture(scope="module")
def host_server(engine, make_drafter, drafter_path):
    """A verifier whose host drafts (the pair's drafter beside it) for the sessions that ask."""
    from tandem.cloud.host_drafting import HostDrafting
    from tandem.orchestrator.host_drafters import HostDrafters
    rec, host = RecordingEngine(engine), HostDrafting(HostDrafters([make_drafter()], drafter_path))
    srv, port = serve(rec, "127.0.0.1:0", max_sessions=2, host=host)
    yield rec, f"127.0.0.1:{port}"
    srv.stop(grace=None)
    host.close()


def test_host_drafted_greedy_is_token_identical_to_target_only(drafter, prompts, references, noise, host_server):
    """A device that does not draft hands its run to the verifier's host drafter: every committed token is still
    the verifier's own argmax, the output is target-only decoding's, in fewer forwards than tokens."""
    rec, address = host_server
    client = EdgeClient(drafter, address, None)
    verdicts, host_tokens, forwards, tokens = [], 0, 0, 0
    for prompt, ref in zip(prompts[:3], references[:3]):
        rec.expected = []
        gen = client.generate(prompt, max_new_tokens=NEW_TOKENS, planner=FixedPlanner(None, host=True)).result()
        assert gen.tokens == rec.expected[: len(gen.tokens)]
        verdicts.append(reference.classify(gen.tokens, ref, noise))
        host_tokens, forwards, tokens = host_tokens + gen.stats.host_tokens, forwards + gen.stats.rounds, \
            tokens + len(gen.tokens)
    client.close()
    assert not [v for v in verdicts if v[0] == "other"], verdicts
    assert host_tokens > tokens / 3 and forwards < tokens / 1.5, (host_tokens, forwards, tokens)


def test_a_thin_client_without_a_drafter_is_served_by_the_host(engine, prompts, references, noise, host_server):
    """``edge.thin.thin_client``: no drafter on the device, the target's own tokenizer fetched from the verifier.
    Its policy prices the host's drafts (on this CPU's compute-bound target plain decoding may win), and runs handed
    to the host are lossless: the output is target-only decoding's either way."""
    from tandem.edge.thin import thin_client
    rec, address = host_server
    with thin_client(address) as client:
        assert client.drafter.tokenizer.vocab_fingerprint == engine.vocab_fingerprint
        for prompt, ref, planner in zip(prompts[:2], references[:2], (None, FixedPlanner(None, host=True))):
            rec.expected = []
            gen = client.generate(prompt, max_new_tokens=NEW_TOKENS, planner=planner).result()
            assert gen.tokens == rec.expected[: len(gen.tokens)]
            assert reference.classify(gen.tokens, ref, noise)[0] != "other"
            if planner is None:
                assert set(gen.stats.policy["predicted_tokens_per_s"]) == {"plain", "host"}
        assert gen.stats.host_tokens > len(gen.tokens) / 3  # handed to the host, which drafted most of it
