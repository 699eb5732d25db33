"""Deterministic mode: a position's logits are the same bits whatever the batch shape, so speculative output is
bit-identical to the engine's own cloud-only decoding -- no near-tie excused, greedy or sampled, with trees, streamed
or lock-step, under penalties and logit bias, under a grammar, and with prompt chunks from the prefix cache. Every
acceptance is also walked again independently (tests/lossless_checks.py)."""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tandem.cloud import reference
from tandem.cloud.engines import deterministic
from tandem.cloud.engines.deterministic import kept_prefix, pieces, preorder
from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
from tandem.cloud.scheduler import Scheduler
from tandem.cloud.engines.ownership import owned
from tandem.cloud.server import serve
from tandem.core.messages import Constraint
from tandem.core.sampling import Sampling
from tandem.core.tree import DraftTree, TreeShape
from tandem.edge.client import EdgeClient
from tandem.edge.planner import FixedPlanner

from lossless_checks import audited

THREADS = max(1, os.cpu_count() or 1)


@pytest.mark.parametrize("n, cap, expected", [
    (0, 7, []),
    (1, 7, [(0, 1)]),
    (7, 7, [(0, 7)]),
    (8, 7, [(0, 4), (4, 8)]),  # never 7 + 1: a lone token would need a pad in the middle of the tree
    (15, 7, [(0, 5), (5, 10), (10, 15)]),
    (17, 7, [(0, 6), (6, 12), (12, 17)]),
    (65, 7, None),  # 10 runs of 6 or 7
])
def test_pieces_are_even_runs_of_at_most_cap(n, cap, expected):
    got = pieces(n, cap)
    assert [lo for lo, _ in got] == sorted(lo for lo, _ in got) and (not got or (got[0][0], got[-1][1]) == (0, n))
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))  # consecutive, nothing skipped
    assert all(1 <= hi - lo <= cap for lo, hi in got)
    assert n < 2 or all(hi - lo >= 2 for lo, hi in got)
    sizes = [hi - lo for lo, hi in got]
    assert not sizes or max(sizes) - min(sizes) <= 1
    if expected is not None:
        assert got == expected


# tree: root's children 0 (first choice) and 1; node 0's children 2 and 3; node 2's child 4
TREE = DraftTree((10, 11, 12, 13, 14), (-1, -1, 0, 0, 2))


@pytest.mark.parametrize("tree, order", [
    (DraftTree(), []),
    (DraftTree.chain([5, 6, 7]), [0, 1, 2]),
    (TREE, [0, 2, 4, 3, 1]),  # first choices first: 0 -> 2 -> 4 is one run of cells
    (DraftTree((1, 2, 3), (-1, -1, -1)), [0, 1, 2]),
])
def test_preorder_puts_the_first_choice_chain_first(tree, order):
    assert preorder(tree) == order
    got = preorder(tree)
    assert all(tree.parents[n] < 0 or got.index(tree.parents[n]) < got.index(n) for n in got)  # parents first


@pytest.mark.parametrize("path, kept", [
    ([], 0),
    ([0], 1),
    ([0, 2, 4], 3),  # the first-choice chain: no re-decode
    ([0, 3], 1),  # node 3 sits after 2 and 4: it is re-placed
    ([1], 0),
])
def test_kept_prefix_counts_the_path_nodes_already_in_place(path, kept):
    assert kept_prefix(preorder(TREE), path) == kept


# --- the real models -----------------------------------------------------------------------------------------------

K = 20  # generated positions compared


def _rows_one_token_per_forward(engine, prompt):
    seq = engine.new_sequence()
    try:
        engine.prefill(seq, prompt[:-1])
        root, rows, tokens = prompt[-1], [], []
        for _ in range(K):
            row = np.array(engine.forward_tree(seq, root, DraftTree())[0])
            engine.keep_path(seq, DraftTree(), [])
            rows.append(row)
            root = int(row.argmax())
            tokens.append(root)
        return rows, tokens
    finally:
        engine.release(seq)


def _rows_in_trees(engine, prompt, tokens, width, depth, rng):
    """Trees holding the true continuation at a random sibling slot of every level (so it is often not the
    first choice), accepting a random prefix of it; returns the true positions' rows."""
    seq = engine.new_sequence()
    try:
        engine.prefill(seq, prompt[:-1])
        root, pos, rows = prompt[-1], 0, {}
        while pos < K:  # at K - 1 the tree is empty: the last row comes from a plain step
            toks, parents, true_nodes, parent = [], [], [], -1
            for d in range(min(depth, K - 1 - pos)):
                slot = int(rng.integers(width))
                for w in range(width):
                    toks.append(tokens[pos + d] if w == slot else int(rng.integers(1000, 30000)))
                    parents.append(parent)
                parent = len(toks) - width + slot
                true_nodes.append(parent)
            tree = DraftTree(tuple(toks), tuple(parents))
            logits = engine.forward_tree(seq, root, tree)
            path = true_nodes[: int(rng.integers(len(true_nodes) + 1))]
            rows[pos] = np.array(logits[0])
            for d, node in enumerate(path):
                rows[pos + 1 + d] = np.array(logits[node + 1])
            engine.keep_path(seq, tree, path)
            pos += len(path) + 1
            root = tokens[pos - 1]
        return [rows[k] for k in range(K)]
    finally:
        engine.release(seq)


def _rows_after_resume(engine, prompt, tokens, m):
    seq = engine.new_sequence()
    try:
        engine.prefill(seq, prompt + tokens[: m - 1], generated=m)  # the prompt's last token and m - 1 generated
        rows, root = [], tokens[m - 1]
        for k in range(m, K):
            rows.append(np.array(engine.forward_tree(seq, root, DraftTree())[0]))
            engine.keep_path(seq, DraftTree(), [])
            root = tokens[k]
        return rows
    finally:
        engine.release(seq)


@pytest.fixture(scope="module")
def long_prompt(drafter_path):
    """Over 256 tokens: cloud-only decoding then attends 512 cells, where llama.cpp's one-token kernel changes."""
    from tandem.core.llama_runtime import LlamaModel
    model = LlamaModel(drafter_path, vocab_only=True)
    text = "<|im_start|>user\n" + "Explain what this code does:\n" + "def add(a, b):\n    return a + b\n" * 24
    tokens = model.tokenize(text + "<|im_end|>\n<|im_start|>assistant\n")
    assert len(tokens) > 280
    return tokens


@pytest.mark.models
@pytest.mark.parametrize("deterministic_mode", [True, False], ids=["deterministic", "default"])
def test_logits_are_bit_identical_whatever_the_batch_only_in_deterministic_mode(drafter_path, long_prompt,
                                                                                 deterministic_mode):
    # the drafter's GGUF as the model: 3x faster than the target, and it mixes Q4_K with Q5_0/Q8_0 tensors, whose
    # batched kernels are llamafile's tinyBLAS (another kernel path the mode must keep invariant)
    engine = LlamaVerifierEngine(drafter_path, n_ctx=1024, max_sessions=1, n_threads=THREADS,
                                 deterministic=deterministic_mode)
    single, tokens = _rows_one_token_per_forward(engine, long_prompt)
    rng = np.random.default_rng(7)
    worst = {}
    for width, depth in [(1, 12), (3, 3), (2, 5)]:
        rows = _rows_in_trees(engine, long_prompt, tokens, width, depth, rng)
        worst[(width, depth)] = max(float(np.abs(a - b).max()) for a, b in zip(rows, single))
    # a resume (another replica, say): the prompt plus the first 10 generated tokens prefilled at once
    resumed = _rows_after_resume(engine, long_prompt, tokens, 10)
    worst["resume"] = max(float(np.abs(a - b).max()) for a, b in zip(resumed, single[10:]))
    if deterministic_mode:
        assert all(w == 0.0 for w in worst.values()), worst
    else:  # the test can fail: without the mode the same trees round differently here
        assert all(w > 0.0 for w in worst.values()), worst


@pytest.mark.models
def test_a_build_that_is_not_invariant_is_refused(drafter_path, monkeypatch):
    # claim invariance up to 9 tokens: forwards of 8 and 9 take another kernel path, and the start-up check sees it
    monkeypatch.setattr(deterministic, "MAX_QUERY_TOKENS", 9)
    with pytest.raises(deterministic.NotBatchInvariant, match="cannot hold"):
        LlamaVerifierEngine(drafter_path, n_ctx=256, max_sessions=1, n_threads=THREADS, deterministic=True)


# --- through the whole stack: edge drafter -> gRPC -> deterministic verifier -------------------------------------

N_PROMPTS, NEW_TOKENS = 2, 40


@pytest.fixture(scope="module")
def det_engine(target_path):
    """With the prefix cache on: every reference and every session below may load whole prompt chunks an earlier one
    computed, and must still be bit-identical (test_the_prefix_cache_... proves reuse happens)."""
    return LlamaVerifierEngine(target_path, n_ctx=2048, n_threads=THREADS, max_sessions=2, deterministic=True,
                               prefix_cache_tokens=2048, check_cells="full")


@pytest.fixture(scope="module")
def det_server(det_engine):
    srv, port = serve(det_engine, "127.0.0.1:0", max_sessions=2)
    yield f"127.0.0.1:{port}"
    srv.stop(grace=None)


@pytest.fixture(scope="module")
def det_prompts(det_engine, humaneval_chats):
    return [det_engine.model.tokenize(det_engine.model.chat_prompt(c)) for c in humaneval_chats[:N_PROMPTS]]


@pytest.fixture(scope="module")
def det_references(det_engine, det_prompts):
    """Cloud-only decoding on the deterministic engine: one token per forward."""
    return [reference.greedy(det_engine, p, NEW_TOKENS) for p in det_prompts]


@pytest.mark.models
def test_speculative_output_and_logprobs_are_bit_identical_to_cloud_only(drafter, det_server, det_prompts,
                                                                         det_references):
    # trees of 16 nodes: forwards of 17 tokens cut into runs, first-choice chains accepted in place and other
    # accepted paths re-decoded (the engine test above checks each of those cases row by row)
    client = EdgeClient(drafter, det_server, TreeShape.parse("4,16,6"), stream=False)
    with audited() as audit:
        for prompt, ref in zip(det_prompts, det_references):
            gen = client.generate(prompt, max_new_tokens=NEW_TOKENS, top_logprobs=0)
            gen.result()
            assert gen.tokens == ref.tokens  # no near-tie excused
            # the target's log-probabilities, computed from the verify forwards' logits, are the same floats
            assert [lp.logprob for lp in gen.logprobs] == [float(np.float32(x)) for x in ref.logprobs]
            assert gen.stats.tau > 1.5  # drafts were accepted: the trees really ran
    client.close()
    audit.check()


@pytest.mark.models
def test_streamed_trees_are_bit_identical_too(drafter, det_server, det_prompts, det_references):
    """The streamed protocol: the verifier decodes alone (a lone token padded to a batch-invariant run) until a
    tree arrives, then verifies the tree rebased onto what it decoded meanwhile."""
    client = EdgeClient(drafter, det_server, TreeShape.parse("2,8,4"), stream=True)
    with audited() as audit:
        gen = client.generate(det_prompts[0], max_new_tokens=NEW_TOKENS).result()
    client.close()
    audit.check()
    assert gen.tokens == det_references[0].tokens


@pytest.mark.models
def test_penalties_and_logit_bias_are_bit_identical(drafter, det_engine, det_server, det_prompts, det_references):
    """Penalties narrow top-2 gaps, where a near-tie excuse would hide the most; here nothing is excused."""
    bias = det_engine.model.tokenize("def")[0]
    sampling = Sampling(presence_penalty=0.75, frequency_penalty=0.5, repetition_penalty=1.25,
                        logit_bias=((bias, -3.0),))
    ref = reference.decode(det_engine, det_prompts[0], NEW_TOKENS, sampling)
    assert ref.tokens != det_references[0].tokens  # the shaping changed the answer
    client = EdgeClient(drafter, det_server, TreeShape.parse("4,16,6"), stream=False)
    with audited() as audit:
        gen = client.generate(det_prompts[0], max_new_tokens=NEW_TOKENS, sampling=sampling).result()
    client.close()
    audit.check()
    assert gen.tokens == ref.tokens and gen.stats.tau > 1.2


@pytest.mark.models
def test_structured_output_is_bit_identical(drafter, det_engine, det_server):
    m = det_engine.model
    prompt = m.tokenize(m.chat_prompt([{"role": "user", "content": "Give a JSON object describing a cat: its name "
                                                                    "and age."}]))
    constraint = Constraint(json_object=True)
    ref = reference.decode(det_engine, prompt, NEW_TOKENS, constraint=constraint)
    client = EdgeClient(drafter, det_server, TreeShape.parse("2,8,4"), stream=False)
    with audited() as audit:
        gen = client.generate(prompt, max_new_tokens=NEW_TOKENS, constraint=constraint).result()
    client.close()
    audit.check()
    assert gen.tokens == ref.tokens and gen.text.lstrip().startswith("{")


@pytest.mark.models
def test_the_prefix_cache_reuses_whole_prompt_chunks_and_changes_no_bit(drafter, det_engine, det_server,
                                                                         det_prompts):
    """A prompt computed with the cache empty is the reference; the same system prompt with another question then
    loads the chunks they share and computes the rest: its answer equals its own reference computed with the cache
    emptied first, bit for bit, and the first prompt again reuses every whole chunk of itself."""
    m = det_engine.model
    system = {"role": "system", "content": "You are a careful Python reviewer. " * 24}
    code = ("def merge(a, b):\n    out = []\n    while a and b:\n"
            "        out.append((a if a[0] < b[0] else b).pop(0))\n    return out + a + b\n")
    chats = [[system, {"role": "user", "content": q + code}] for q in ("What does this return?\n",
                                                                      "Is this stable?\n")]
    prompts = [m.tokenize(m.chat_prompt(c)) for c in chats]
    stats, chunk = det_engine.prefix_cache.stats, det_engine._ctxs[0].n_batch
    common = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    shared = common // chunk * chunk
    # the system prompt spans whole chunks, and the first prompt's kept chunks reach past where they part: the
    # second may reuse only up to the chunk boundary before it (a chunk cut there would round differently)
    assert shared >= 2 * chunk and common % chunk and (len(prompts[0]) - 1) // chunk * chunk > common
    refs = []
    for p in prompts:
        with owned(det_engine):
            det_engine.reset_prefix_cache()
        before = stats.reused_tokens
        refs.append(reference.greedy(det_engine, p, NEW_TOKENS))
        assert stats.reused_tokens == before  # computed from nothing
    with owned(det_engine):
        det_engine.reset_prefix_cache()
    client = EdgeClient(drafter, det_server, TreeShape.parse("4,16,6"), stream=False)
    with audited() as audit:
        outs = [client.generate(p, max_new_tokens=NEW_TOKENS, top_logprobs=0).result() for p in prompts + prompts[:1]]
    client.close()
    audit.check()
    assert [o.tokens for o in outs] == [r.tokens for r in refs + refs[:1]]
    # the same floats, not just the same choices: a chunk cut elsewhere would round differently
    assert [[lp.logprob for lp in o.logprobs] for o in outs] == [[float(np.float32(x)) for x in r.logprobs]
                                                                for r in refs + refs[:1]]
    assert outs[0].stats.cached_tokens == 0
    assert outs[1].stats.cached_tokens == shared  # the chunks the first prompt's session stored
    assert outs[2].stats.cached_tokens == (len(prompts[0]) - 1) // chunk * chunk


@pytest.mark.models
def test_sampled_speculative_output_equals_sampled_cloud_only_at_the_same_seed(drafter, det_engine, det_server,
                                                                              det_prompts):
    sampling = Sampling(temperature=0.8, top_p=0.95, seed=1234)
    client = EdgeClient(drafter, det_server, TreeShape.parse("4,16,6"), stream=False)
    try:
        for prompt in det_prompts[:1]:
            ref = reference.decode(det_engine, prompt, NEW_TOKENS, sampling)
            gen = client.generate(prompt, max_new_tokens=NEW_TOKENS, sampling=sampling,
                                  planner=FixedPlanner(TreeShape.parse("4,16,6")))
            assert gen.result().tokens == ref.tokens  # same draws, same bits: no CDF-margin excuse either
    finally:
        client.close()


@pytest.mark.models
def test_trees_pruned_by_a_verify_budget_keep_the_output_bit_identical(drafter, make_drafter, det_engine,
                                                                       det_prompts, det_references):
    """Two sessions at once under a budget of 6 tokens per forward: every 17-token tree is pruned to its most
    probable nodes (across both sessions), and the output is still exactly cloud-only decoding's."""
    sched = Scheduler(det_engine, window_ms=20, verify_budget_tokens=6)
    srv, port = serve(det_engine, "127.0.0.1:0", max_sessions=2, scheduler=sched)
    clients = [EdgeClient(d, f"127.0.0.1:{port}", TreeShape.parse("4,16,6"), stream=False)
               for d in (drafter, make_drafter())]
    try:
        with ThreadPoolExecutor(2) as pool:
            gens = list(pool.map(lambda cp: cp[0].generate(cp[1], max_new_tokens=NEW_TOKENS).result(),
                                 zip(clients, det_prompts)))
    finally:
        for c in clients:
            c.close()
        srv.stop(grace=None)
    assert [g.tokens for g in gens] == [r.tokens for r in det_references]
    assert sched.stats.pruned_nodes > 0 and sum(g.stats.pruned_nodes for g in gens) == sched.stats.pruned_nodes
    assert sched.stats.tokens <= 6 * sched.stats.forwards
    assert all(g.stats.tau > 1.2 for g in gens)  # the kept nodes were still accepted
