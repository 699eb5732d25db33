"""PyTorch verifier engine: tree forward with a 4D mask equals token-by-token decoding; KV pruning keeps exactly
the accepted path; padded multi-session batches equal single-session forwards. Tiny random Qwen2 + the real 0.5B."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tandem.cloud.acceptance import accept  # noqa: E402
from tandem.core.sampling import Sampling  # noqa: E402
from tandem.cloud.engines.engine import TreeJob  # noqa: E402
from tandem.cloud.engines.torch_engine import TorchVerifierEngine, tree_attention_allowed  # noqa: E402
from tandem.core.tree import DraftTree  # noqa: E402

V = 97


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   eos_token_id=V - 1)
    return TorchVerifierEngine(model=transformers.Qwen2ForCausalLM(cfg), n_ctx=256, device="cpu")


def sequential_rows(engine, prompt, continuation):
    """Logits after prompt + continuation[:i] for every i, one token per forward."""
    seq = engine.new_sequence()
    engine.prefill(seq, prompt[:-1])
    rows = []
    for tok in [prompt[-1], *continuation]:
        rows.append(engine.forward_tree(seq, tok, DraftTree())[0].copy())
        engine.keep_path(seq, DraftTree(), [])
    return np.stack(rows)


def test_tree_mask_table():
    t = DraftTree(tokens=(1, 2, 3, 4), parents=(-1, -1, 0, 2))
    assert tree_attention_allowed(t).astype(int).tolist() == [
        [1, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0],  # node 0
        [1, 0, 1, 0, 0],  # node 1 (sibling of 0): not node 0
        [1, 1, 0, 1, 0],  # node 2 under 0
        [1, 1, 0, 1, 1],  # node 3 under 2
    ]


def test_tiny_tree_rows_equal_token_by_token(tiny):
    prompt = [5, 17, 33, 2, 60]
    a, b, c = 11, 42, 7
    seq_rows = sequential_rows(tiny, prompt, [a, b, c])
    alt_rows = sequential_rows(tiny, prompt, [b, a])  # the sibling branch b -> a
    tree = DraftTree(tokens=(a, b, b, c, a), parents=(-1, -1, 0, 2, 1))
    seq = tiny.new_sequence()
    tiny.prefill(seq, prompt[:-1])
    rows = tiny.forward_tree(seq, prompt[-1], tree)
    np.testing.assert_allclose(rows[[0, 1, 3, 4]], seq_rows, atol=1e-4)
    np.testing.assert_allclose(rows[[2, 5]], alt_rows[1:], atol=1e-4)
    assert (rows.argmax(1)[[0, 1, 3, 4]] == seq_rows.argmax(1)).all()


def test_tiny_keep_path_keeps_exactly_the_accepted_path(tiny):
    prompt = [3, 4, 5]
    tree = DraftTree(tokens=(10, 20, 30, 40), parents=(-1, -1, 1, 2))
    seq = tiny.new_sequence()
    tiny.prefill(seq, prompt[:-1])
    tiny.forward_tree(seq, prompt[-1], tree)
    tiny.keep_path(seq, tree, [1, 2])  # 20 -> 30
    assert seq.n_past == len(prompt) + 2
    assert all(layer.keys.shape[2] == seq.n_past for layer in seq.cache.layers)
    after = tiny.forward_tree(seq, 77, DraftTree())[0]
    expect = sequential_rows(tiny, prompt, [20, 30, 77])[-1]
    np.testing.assert_allclose(after, expect, atol=1e-4)


def test_tiny_padded_batch_equals_alone(tiny):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]
    trees = [DraftTree.chain([14, 15]), DraftTree(tokens=(16, 17, 18), parents=(-1, -1, 0)), DraftTree()]
    alone, seqs = [], []
    for p, t in zip(prompts, trees):
        s = tiny.new_sequence()
        tiny.prefill(s, p[:-1])
        alone.append(tiny.forward_tree(s, p[-1], t).copy())
        s2 = tiny.new_sequence()
        tiny.prefill(s2, p[:-1])
        seqs.append(s2)
    together = tiny.forward_batch([TreeJob(s, p[-1], t) for s, p, t in zip(seqs, prompts, trees)])
    for a, b in zip(alone, together):
        np.testing.assert_allclose(a, b, atol=1e-4)
    # each session's cache was cut back out of the batch: past + its own new tokens, and it continues correctly
    for s, p, t, rows in zip(seqs, prompts, trees, alone):
        assert all(layer.keys.shape[2] == len(p) - 1 + len(t) + 1 for layer in s.cache.layers)
        path = list(accept(t, rows, Sampling()).accepted)
        tiny.keep_path(s, t, path)
        assert s.n_past == len(p) + len(path)


@pytest.fixture(scope="module")
def tiny_cached(tiny):
    """The tiny model's engine with a block prefix cache (blocks of 4, reuse from 8 tokens)."""
    eng = TorchVerifierEngine(model=tiny.model, n_ctx=256, device="cpu", prefix_cache_tokens=64,
                              prefix_block_tokens=4)
    eng.prefix_cache.min_tokens = 8
    return eng


def run_turn(engine, prompt, trees):
    """Prefill ``prompt[:-1]``, verify ``trees`` greedily one after the other, release; returns (reused, the
    committed tokens after the prompt, every forward's logits)."""
    seq = engine.new_sequence()
    reused = engine.prefill(seq, prompt[:-1])
    root, committed, logits = prompt[-1], [], []
    for tree in trees:
        rows = engine.forward_tree(seq, root, tree).copy()
        acc = accept(tree, rows, Sampling())
        engine.keep_path(seq, tree, list(acc.accepted))
        new = acc.committed_tokens(tree)
        committed += new
        root = new[-1]
        logits.append(rows)
    engine.release(seq)
    return reused, committed, logits


def test_tiny_prefix_cache_reuses_the_last_turn_and_decodes_the_same(tiny, tiny_cached):
    """Turn 2 = turn 1's prompt + answer + a new message: its prefill takes turn 1's committed blocks from the
    cache (prompt and the answer's verified tokens, root included) and every logit equals the uncached engine's."""
    tiny_cached.reset_prefix_cache()
    trees = [DraftTree.chain([1, 2, 3]), DraftTree(tokens=(4, 5, 6), parents=(-1, -1, 1)), DraftTree()]
    turn1 = [5, 17, 33, 2, 60, 8, 9, 10, 11]
    reused, answer, _ = run_turn(tiny_cached, turn1, trees)
    assert reused == 0
    history = turn1[:-1] + [turn1[-1]] + answer  # what the session committed
    assert len(tiny_cached.prefix_cache) == (len(history) - 1) // 4  # its full blocks (the last root is not in KV)
    turn2 = history + [70, 71, 72, 73, 74]
    reused2, answer2, rows2 = run_turn(tiny_cached, turn2, trees)
    assert reused2 == (len(history) - 1) // 4 * 4 >= 8  # every full block turn 1 had in its KV
    plain_reused, plain_answer, plain_rows = run_turn(tiny, turn2, trees)
    assert plain_reused in (0, None) and answer2 == plain_answer
    for a, b in zip(rows2, plain_rows):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # a prompt that forks inside block 1 reuses block 0 only: 4 tokens, under min_tokens 8 -> nothing
    assert run_turn(tiny_cached, turn1[:5] + [90, 91, 92, 93, 94], [DraftTree()])[0] == 0


def test_tiny_prefix_reused_session_batches_with_a_fresh_one(tiny, tiny_cached):
    tiny_cached.reset_prefix_cache()
    hits = tiny_cached.prefix_cache.stats.hits
    shared = list(range(20, 40))
    run_turn(tiny_cached, shared + [1], [DraftTree()])
    a, b = tiny_cached.new_sequence(), tiny_cached.new_sequence()
    assert tiny_cached.prefill(a, shared + [3, 4]) == 20  # 20 of 22 from the cache
    assert tiny_cached.prefill(b, [7, 8, 9]) == 0
    tree = DraftTree.chain([11, 12])
    together = tiny_cached.forward_batch([TreeJob(a, 5, tree), TreeJob(b, 10, tree)])
    for prompt, rows in ((shared + [3, 4, 5], together[0]), ([7, 8, 9, 10], together[1])):
        s = tiny.new_sequence()
        tiny.prefill(s, prompt[:-1])
        np.testing.assert_allclose(rows, tiny.forward_tree(s, prompt[-1], tree), atol=1e-5)
        tiny.release(s)
    for s in (a, b):
        tiny_cached.release(s)
    assert tiny_cached.prefix_cache.stats.hits == hits + 1


@pytest.fixture(scope="module")
def torch05(torch05_base):
    """The real Qwen2.5-Coder-0.5B (loaded from its GGUF by the engine, tests/conftest.py), with a prefix cache as
    `tandem serve --engine torch` runs it (so the lossless test below runs with it on too)."""
    return TorchVerifierEngine(model=torch05_base.model, tokenizer=torch05_base.tokenizer, n_ctx=1024, device="cpu",
                               prefix_cache_tokens=2048)


@pytest.mark.models
def test_real_05b_gguf_tree_equals_sequential(torch05, drafter_path):
    eng = torch05
    from tandem.core.llama_runtime import LlamaModel
    lm = LlamaModel(drafter_path)
    assert eng.vocab_size == lm.n_vocab and eng.vocab_fingerprint == lm.vocab_fingerprint
    prompt = lm.tokenize(lm.chat_prompt([{"role": "user", "content": "Write a Python function that adds."}]))
    ref = sequential_rows(eng, prompt, [])
    greedy = []
    seq = eng.new_sequence()
    eng.prefill(seq, prompt[:-1])
    root = prompt[-1]
    for _ in range(4):
        row = eng.forward_tree(seq, root, DraftTree())[0]
        root = int(row.argmax())
        greedy.append(root)
        eng.keep_path(seq, DraftTree(), [])
    seq_rows = sequential_rows(eng, prompt, greedy[:3])
    np.testing.assert_allclose(seq_rows[0], ref[0], atol=1e-4)
    tree = DraftTree(tokens=(greedy[0], 13, greedy[1], greedy[2]), parents=(-1, -1, 0, 2))
    s = eng.new_sequence()
    eng.prefill(s, prompt[:-1])
    rows = eng.forward_tree(s, prompt[-1], tree)
    np.testing.assert_allclose(rows[[0, 1, 3, 4]], seq_rows, atol=1e-3)
    acc = accept(tree, rows, Sampling())
    assert acc.committed_tokens(tree) == greedy[:4]
    assert acc.accepted == (0, 2, 3)
    eng.keep_path(s, tree, acc.accepted)
    assert all(layer.keys.shape[2] == len(prompt) + 3 for layer in s.cache.layers)


@pytest.mark.models
def test_real_edge_to_torch_verifier_is_lossless(torch05, drafter, humaneval_chats):
    """Edge (llama.cpp drafter) -> gRPC -> torch verifier, greedy: exactly torch target-only decoding."""
    from tandem.cloud import reference
    from tandem.cloud.server import serve
    from tandem.edge.client import EdgeClient
    from tandem.core.tree import TreeShape

    srv, port = serve(torch05, "127.0.0.1:0", max_sessions=2)
    try:
        prompt = drafter.model.tokenize(drafter.model.chat_prompt(humaneval_chats[1]))
        gen = EdgeClient(drafter, f"127.0.0.1:{port}", TreeShape(2, 8, 4), stream=False).generate(
            prompt, max_new_tokens=24)
        gen.result()
    finally:
        srv.stop(grace=None)
    ref = reference.greedy(torch05, prompt, 24)
    # float32 on CPU: batch shape moves logits by ~1e-5, so anything but a true tie must match exactly
    verdict = reference.classify(gen.tokens, ref, noise=1e-4)
    assert verdict.ok, str(verdict)
    assert gen.stats.tau > 1.5


@pytest.mark.models
def test_real_torch_prefix_cache_turns_are_lossless(torch05, drafter, humaneval_chats):
    """Two chat turns edge -> gRPC -> torch verifier with its block prefix cache: turn 2's prefill takes turn 1's
    history from the cache (Opened.cached_tokens, in whole blocks), and both answers equal target-only decoding
    computed with the cache empty."""
    from tandem.cloud import reference
    from tandem.cloud.server import serve
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient

    tok = drafter.model
    turn1 = tok.tokenize(tok.chat_prompt(humaneval_chats[2]))
    block = torch05.prefix_cache.block_tokens
    torch05.reset_prefix_cache()
    srv, port = serve(torch05, "127.0.0.1:0", max_sessions=2)
    try:
        client = EdgeClient(drafter, f"127.0.0.1:{port}", TreeShape(2, 8, 4), stream=False)
        gen1 = client.generate(turn1, max_new_tokens=16).result()
        turn2 = turn1 + gen1.tokens + tok.tokenize("<|im_end|>\n<|im_start|>user\nAdd type hints.<|im_end|>\n"
                                                   "<|im_start|>assistant\n", special=True)
        gen2 = client.generate(turn2, max_new_tokens=16).result()
        client.close()
    finally:
        srv.stop(grace=None)
    assert gen1.stats.cached_tokens == 0
    # turn 1 committed prompt + answer; all but its last token were in KV, stored in whole blocks
    assert (len(turn1) + len(gen1.tokens) - 1) // block * block <= gen2.stats.cached_tokens < len(turn2)
    for gen, prompt in ((gen1, turn1), (gen2, turn2)):
        torch05.reset_prefix_cache()
        verdict = reference.classify(gen.tokens, reference.greedy(torch05, prompt, 16), noise=1e-4)
        assert verdict.ok, str(verdict)


@pytest.mark.models
def test_real_translated_drafter_against_a_hugging_face_tokenizer_is_lossless(torch05, drafter_path,
                                                                                humaneval_chats):
    """A torch target loaded with a Hugging Face tokenizer offers its tokenizer.json; a drafter with another
    tokenizer (the 0.5B with its ids shuffled) fetches it, drafts through translation, and the answer is exactly
    torch target-only decoding."""
    from bench.gguf_copies import CACHE, permuted_copy
    from tandem.cloud import reference
    from tandem.cloud.server import serve
    from tandem.core.hf_tokenizer import FORMAT, HfTokenizer
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.llama_drafter import LlamaDrafter
    from tandem.edge.planner import FixedPlanner
    from tandem.edge.translate import SUFFIX, tokenizer_cache
    assert torch05.tokenizer_file()[0] == FORMAT  # no GGUF behind this engine: its tokenizer.json
    srv, port = serve(torch05, "127.0.0.1:0", max_sessions=2)
    client = EdgeClient(LlamaDrafter(permuted_copy(drafter_path, CACHE), n_ctx=1024), f"127.0.0.1:{port}",
                        TreeShape(1, 4, 4), stream=False)
    try:
        for kind in SUFFIX:  # fetched over gRPC (in any format: the same vocabulary)
            tokenizer_cache(torch05.vocab_fingerprint, kind).unlink(missing_ok=True)
        assert client.pair_with_target() == "translated"
        assert isinstance(client.drafter.tokenizer, HfTokenizer)
        prompt = client.prompt_tokens(humaneval_chats[1])
        gen = client.generate(prompt, max_new_tokens=24, planner=FixedPlanner(TreeShape(1, 4, 4), False)).result()
    finally:
        client.close()
        srv.stop(grace=None)
    ref = reference.greedy(torch05, prompt, 24)
    verdict = reference.classify(gen.tokens, ref, noise=1e-4)
    assert verdict.ok, str(verdict)
    assert gen.stats.accepted_tokens >= 8
    assert gen.text == torch05.tokenizer.decode(gen.tokens)  # rendered as the target's tokenizer renders it
