"""Deterministic mode on the torch engine: runs of a fixed row count with attention over each row's own keys in
fixed chunks (cloud/engines/torch_invariant.py). A position's logits are the same bits decoded alone, in a chain, as a
tree node (on or off the first-choice path), after keep_path and after a resume; the default engine differs on the same
cases, so the tests can fail. Then the real 0.5B through gRPC: speculative output and logprobs bit-identical to
cloud-only decoding."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tandem.cloud import reference  # noqa: E402
from tandem.cloud.engines import torch_invariant  # noqa: E402
from tandem.cloud.engines.deterministic import NotBatchInvariant  # noqa: E402
from tandem.cloud.engines.torch_engine import TorchVerifierEngine  # noqa: E402
from tandem.core.tree import DraftTree  # noqa: E402

V = 151


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return transformers.Qwen2ForCausalLM(cfg)


@pytest.fixture(scope="module")
def engines():
    """The same random weights twice (the attention implementation is a setting of the model object)."""
    m = tiny_model()
    return {True: TorchVerifierEngine(model=m, n_ctx=1024, device="cpu", deterministic=True),
            False: TorchVerifierEngine(model=copy.deepcopy(m), n_ctx=1024, device="cpu")}


PROMPT = [int(t) for t in np.random.RandomState(1).randint(1, 100, size=200)]  # past KEY_CHUNK: several chunks
CONT = [int(t) for t in np.random.RandomState(2).randint(1, 100, size=12)]


def one_at_a_time(engine, prompt, cont):
    seq = engine.new_sequence()
    engine.prefill(seq, prompt[:-1])
    rows = []
    for t in [prompt[-1], *cont]:
        rows.append(engine.forward_tree(seq, t, DraftTree())[0].copy())
        engine.keep_path(seq, DraftTree(), [])
    engine.release(seq)
    return np.stack(rows)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_logits_are_bit_identical_whatever_the_batch_only_in_deterministic_mode(engines, deterministic):
    eng = engines[deterministic]
    ref = one_at_a_time(eng, PROMPT, CONT)
    same = []
    # 11 nodes (two runs with the root): the true chain CONT[0..2] sits off the first-choice path, under node 1
    tree = DraftTree(tokens=(5, CONT[0], 6, CONT[1], CONT[2], 7, 8, 9, 10, 11, 12),
                     parents=(-1, -1, 1, 1, 3, 0, 5, 6, 7, 8, 9))
    seq = eng.new_sequence()
    eng.prefill(seq, PROMPT[:-1])
    rows = eng.forward_tree(seq, PROMPT[-1], tree).copy()
    same.append(np.array_equal(rows[[0, 2, 4, 5]], ref[:4]))
    eng.keep_path(seq, tree, [1, 3, 4])  # an accepted path with gaps behind it in the cache
    chain = eng.forward_tree(seq, CONT[3], DraftTree.chain(CONT[4:11])).copy()  # a full run: root + 7
    same.append(np.array_equal(chain, ref[4:12]))
    eng.keep_path(seq, DraftTree.chain(CONT[4:11]), list(range(7)))
    same.append(np.array_equal(eng.forward_tree(seq, CONT[11], DraftTree())[0], ref[12]))
    eng.release(seq)
    # a resume: the prompt and 9 earlier output tokens, the output computed as verify forwards computed it
    seq = eng.new_sequence()
    eng.prefill(seq, PROMPT + CONT[:8], generated=9)
    same.append(np.array_equal(eng.forward_tree(seq, CONT[8], DraftTree())[0], ref[9]))
    eng.release(seq)
    if deterministic:
        assert same == [True] * 4
    else:  # float32 rounding moves with the batch: ~1e-7 here, enough to flip a near-tie
        assert not all(same)


def test_a_build_whose_runs_are_not_batch_invariant_is_refused(monkeypatch):
    """Without the chunked attention (SDPA reduces over every key, masked ones included), the start-up check sees
    logits move between run sizes and the engine refuses to start; asking for the prefix cache too is refused."""
    monkeypatch.setattr(torch_invariant, "register", lambda: "sdpa")
    with pytest.raises(NotBatchInvariant, match="cannot hold"):
        TorchVerifierEngine(model=tiny_model(), n_ctx=256, device="cpu", deterministic=True)
    with pytest.raises(ValueError, match="without the prefix cache"):
        TorchVerifierEngine(model=tiny_model(), n_ctx=256, device="cpu", deterministic=True, prefix_cache_tokens=64)


# --- the real 0.5B through the whole stack: edge drafter -> gRPC -> deterministic torch verifier -------------------

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def det05(torch05_base):
    """The real 0.5B in deterministic mode: a copy of the shared model (the attention is a setting of the model)."""
    return TorchVerifierEngine(model=copy.deepcopy(torch05_base.model), tokenizer=torch05_base.tokenizer, n_ctx=1024,
                               device="cpu", deterministic=True)


@pytest.mark.models
def test_real_speculative_output_and_logprobs_are_bit_identical_to_cloud_only(det05, drafter, humaneval_chats):
    from tandem.cloud.server import serve
    from tandem.core.sampling import Sampling
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.planner import FixedPlanner

    prompt = drafter.model.tokenize(drafter.model.chat_prompt(humaneval_chats[0]))
    ref = reference.greedy(det05, prompt, NEW_TOKENS)
    sampling = Sampling(temperature=0.8, top_p=0.95, seed=1234)
    sampled_ref = reference.decode(det05, prompt, NEW_TOKENS, sampling)
    srv, port = serve(det05, "127.0.0.1:0", max_sessions=2)
    client = EdgeClient(drafter, f"127.0.0.1:{port}", TreeShape.parse("4,16,6"), stream=False)
    try:
        gen = client.generate(prompt, max_new_tokens=NEW_TOKENS, top_logprobs=0)
        gen.result()
        assert gen.tokens == ref.tokens  # no near-tie excused
        assert [lp.logprob for lp in gen.logprobs] == [float(np.float32(x)) for x in ref.logprobs]
        assert gen.stats.tau > 1.5  # drafts were accepted: trees of 17 tokens ran in three runs each
        sampled = client.generate(prompt, max_new_tokens=NEW_TOKENS, sampling=sampling,
                                  planner=FixedPlanner(TreeShape.parse("4,16,6"))).result()
        assert sampled.tokens == sampled_ref.tokens  # same draws, same bits
    finally:
        client.close()
        srv.stop(grace=None)
