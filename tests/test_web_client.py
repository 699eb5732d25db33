"""clients/web (TypeScript): its Node unit tests, run with the suite. They drive the client's round loop against the
scripted verifier through the gateway's WebSocket relay (tests/scripted_relay.py): token-exact output whatever the
drafter, lock-step and streamed, stop strings, edge tokens, resume, UNAUTHENTICATED, and replays of
docs/protocol/*.jsonl; and tokenizers.js on the default pair's tokenizer.json (converted from its GGUF), against
llama.cpp's ids of the same texts (a fixture this test writes)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tandem.core.tree import TreeShape

from test_gguf_tokenizer import HARD, TEXTS

WEB = Path(__file__).resolve().parent.parent / "clients" / "web"


@pytest.fixture
def tokenizer_fixture(drafter_path, tmp_path):
    """The default drafter's tokenizer, and one vocabulary of each other family converted (llama.cpp's
    vocabulary-only GGUFs): each with llama.cpp's ids of the test texts and the hard strings; the fixture files
    joined by the path delimiter."""
    from llama_vocab import vocab
    from tandem.core.gguf_tokenizer import tokenizer_json
    from tandem.core.llama_runtime import LlamaModel
    paths = []
    for gguf in (drafter_path, *(vocab(name) for name in ("llama-bpe", "llama-spm", "phi-3", "gemma-4"))):
        llama = LlamaModel(gguf, vocab_only=True)
        cases = []
        for text in [*TEXTS, *HARD.values()]:
            ids = llama.tokenize(text)
            cases.append({"text": text, "ids": ids,
                          "plain": b"".join(llama.piece(t) for t in ids).decode("utf-8", errors="replace")})
        paths.append(tmp_path / f"tokenizer-fixture-{len(paths)}.json")
        paths[-1].write_text(json.dumps({"tokenizer": json.loads(tokenizer_json(gguf)), "cases": cases}))
    return os.pathsep.join(map(str, paths))


def random_qwen2_gguf(path, vocab=96, hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, seed=0):
    """A random-weight Qwen2 GGUF written with numpy alone (tensors in Hugging Face's [out, in] orientation, as
    llama.cpp's converter writes them); scaled so that greedy choices are far from ties."""
    import gguf
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen2")
    for add, value in ((w.add_block_count, layers), (w.add_embedding_length, hidden), (w.add_head_count, heads),
                       (w.add_feed_forward_length, ffn), (w.add_head_count_kv, kv_heads),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, 10000.0),
                       (w.add_eos_token_id, vocab - 1)):
        add(value)
    head_dim = hidden // heads

    def t(name, *shape, scale=0.2):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))
    t("token_embd.weight", vocab, hidden, scale=1.0)
    t("output.weight", vocab, hidden, scale=0.5)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        t(p + "attn_q.weight", heads * head_dim, hidden), t(p + "attn_q.bias", heads * head_dim, scale=0.05)
        for n in "kv":
            t(p + f"attn_{n}.weight", kv_heads * head_dim, hidden), t(p + f"attn_{n}.bias", kv_heads * head_dim)
        t(p + "attn_output.weight", hidden, heads * head_dim)
        t(p + "ffn_gate.weight", ffn, hidden), t(p + "ffn_up.weight", ffn, hidden)
        t(p + "ffn_down.weight", hidden, ffn)
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + n + ".weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def onnx_drafter_fixture(tmp_path):
    """The random model's self-contained export and, for a scripted session of draft calls (a prompt longer than
    the client's prefill chunk, chains accepted in part, in whole, not at all, a new prompt sharing a prefix), the
    greedy chain each call must return, computed here by recomputing the whole sequence for every token (no cache):
    the TypeScript drafter's cache reuse must give the same chains; and trees of a few shapes between them, as
    edge/drafting.py's build_tree makes them on the same cache-free logits."""
    import onnxruntime as ort

    from tandem.edge.onnx_drafter import session_options
    from tandem.edge.export.onnx_export import export
    out = export(random_qwen2_gguf(tmp_path / "tiny.gguf"), "fp32", cache_root=tmp_path / "onnx", self_contained=True)
    meta = json.loads((out / "meta.json").read_text())
    sess = ort.InferenceSession(str(out / "model.onnx"), session_options(1), providers=["CPUExecutionProvider"])
    L, H, D = meta["layers"], meta["kv_heads"], meta["head_dim"]

    from tandem.cloud.learning.teacher import top_k_logprobs
    from tandem.edge.drafting import build_tree

    def last_logits(seq):
        n = len(seq)
        mask = np.triu(np.full((n, n), -1e9, np.float32), k=1)
        return sess.run(["logits"], {"input_ids": np.array(seq), "positions": np.arange(n), "mask": mask,
                                     "past_k": np.zeros((L, H, 0, D), np.float32),
                                     "past_v": np.zeros((L, H, 0, D), np.float32),
                                     "logit_rows": np.array([n - 1])})[0][0]

    def greedy(seq, depth):
        chain, margin = [], np.inf
        for _ in range(depth):
            logits = last_logits(seq + chain)
            top = np.sort(logits)[-2:]
            margin = min(margin, float(top[1] - top[0]))
            chain.append(int(logits.argmax()))
            if chain[-1] in meta["eos"]:
                break
        return chain, margin

    rng = np.random.default_rng(1)
    committed = [int(x) for x in rng.integers(0, 90, 21)]
    calls = []
    for accept in (2, 4, 0, 1, 4):  # the verdicts: how much of each chain the target took, then its own token
        chain, margin = greedy(committed, 4)
        calls.append({"committed": list(committed), "depth": 4, "chain": chain, "margin": margin})
        committed += chain[:accept] + [int(rng.integers(0, 90))]
    restart = committed[:5] + [int(x) for x in rng.integers(0, 90, 3)]  # the next request shares a prefix
    for seq, depth in ((restart, 6), (restart, 6), (restart + [7], 1)):
        chain, margin = greedy(seq, depth)
        calls.append({"committed": list(seq), "depth": depth, "chain": chain, "margin": margin})
    assert min(c["margin"] for c in calls) > 1e-3, "the random model has near-ties: pick another seed"

    def tree(seq, k, n, d):
        """build_tree on logits recomputed from scratch for every node's path; the margin: the closest two of the
        path log-probabilities it ranks (a near-tie could order them differently in another runtime)."""
        def top_k(s):
            ids, logp = top_k_logprobs(last_logits(s)[None], k)
            return [(int(t), float(lp)) for t, lp in zip(ids[0], logp[0])]

        def expand(indices, tokens, parents):
            def path(i):
                return [] if i < 0 else path(parents[i]) + [tokens[i]]
            return [top_k(seq + path(i)) for i in indices]

        built = build_tree(top_k(seq), expand, TreeShape(k, n, d))
        logps = np.sort(np.array(built.logp))
        return built.tree, float(np.diff(logps).min()) if len(logps) > 1 else np.inf

    trees = []
    for seq, (k, n, d) in ((calls[3]["committed"], (2, 6, 4)), (calls[4]["committed"], (3, 10, 4)),
                           (restart, (1, 4, 4)), (restart + [7, 9], (4, 12, 3))):
        t, margin = tree(seq, k, n, d)
        trees.append({"committed": seq, "shape": {"k": k, "n": n, "d": d}, "tokens": list(t.tokens),
                      "parents": list(t.parents), "margin": margin})
    assert min(t["margin"] for t in trees) > 1e-4, "the random model's trees have near-ties: pick another seed"
    path = tmp_path / "onnx-drafter-fixture.json"
    path.write_text(json.dumps({"model": str(out / "model.onnx"), "meta": meta, "prefillChunk": 8, "calls": calls,
                                "trees": trees}))
    return path


@pytest.mark.models
def test_the_typescript_client_passes_its_node_tests(tokenizer_fixture, onnx_drafter_fixture):
    if shutil.which("npm") is None:
        pytest.fail("npm is not installed (Node 20+ is needed for clients/web)")
    if not (WEB / "node_modules").is_dir():
        pytest.fail("clients/web has no node_modules: `make test` installs them (npm ci in clients/web)")
    r = subprocess.run(["npm", "test"], cwd=WEB, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TANDEM_PYTHON": sys.executable,
                            "TANDEM_TOKENIZER_FIXTURE": str(tokenizer_fixture),
                            "TANDEM_ONNX_DRAFTER_FIXTURE": str(onnx_drafter_fixture)})
    summary = [line for line in r.stdout.splitlines() if line.startswith(("# pass", "# fail", "# skipped",
                                                                           "not ok"))]
    assert r.returncode == 0 and "# fail 0" in summary and "# skipped 0" in summary, \
        r.stdout[-4000:] + r.stderr[-2000:]
