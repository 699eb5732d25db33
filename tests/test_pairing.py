"""``tandem models check``: the kind of a target/drafter pair (the verifier's own rule) and the acceptance that
greedy chains would see, predicted from one teacher-forced pass of the drafter and held to a real lock-step run."""
import json
import re

import pytest

from bench.gguf_copies import newline_twin_target
from tandem.orchestrator import pairing


@pytest.mark.parametrize("matches, depth, tau", [
    ("", 4, 0.0),
    ("0000", 4, 1.0),  # every round commits only the target's own token
    ("1111", 4, 4.0),  # one chain of 4 accepted takes all four
    ("11111111", 4, 4.0),  # 4 accepted, the 5th token committed as the bonus; then 3 accepted: 8 in 2 rounds
    ("1111", 0, 1.0),  # no drafting
    ("1101", 4, 2.0),  # 2 accepted + the miss; then 1 accepted: 4 tokens in 2 rounds
    ("10110", 2, 2.5),  # [1 + the miss] [1 1 + the bonus]: 5 tokens in 2 rounds
])
def test_chain_tau(matches, depth, tau):
    assert pairing.chain_tau([c == "1" for c in matches], depth) == pytest.approx(tau)


def test_chain_tau_refuses_a_negative_depth():
    with pytest.raises(ValueError):
        pairing.chain_tau([True], -1)


class Engine:
    def __init__(self, texts):
        self.texts, self.vocab_size = texts, len(texts)
        self.vocab_fingerprint = self.vocab_fingerprint_of(len(texts))

    def vocab_fingerprint_of(self, n):
        return "|".join(self.texts[:n])


class Tok:
    def __init__(self, texts):
        self.n_vocab, self.vocab_fingerprint = len(texts), "|".join(texts)


class GgufEngine(Engine):
    def tokenizer_file(self):
        raise AssertionError("classifying a pair reads no file")


@pytest.mark.parametrize("target, drafter, kind", [
    (["a", "b", "c"], ["a", "b", "c"], pairing.NATIVE),
    (["a", "b", "c", "[PAD3]"], ["a", "b", "c"], pairing.PADDED),
    (["a", "b", "c"], ["a", "x", "c"], pairing.TRANSLATED),
    (["a", "b", "c", "d"], ["a", "x", "c"], pairing.TRANSLATED),
    (["a", "b"], ["a", "b", "c"], pairing.TRANSLATED),
])
@pytest.mark.parametrize("with_file", [True, False])
def test_the_kind_of_pair_is_the_verifiers_rule_then_translation(target, drafter, kind, with_file):
    """Pairs the verifier refuses are translated where the target offers its tokenizer file, else refused."""
    p = pairing.pairing((GgufEngine if with_file else Engine)(target), Tok(drafter))
    if kind == pairing.TRANSLATED and not with_file:
        kind = pairing.REFUSED
    assert (p.kind, p.target_ids, p.drafter_ids) == (kind, len(target), len(drafter))
    assert bool(p.detail) == (kind in (pairing.TRANSLATED, pairing.REFUSED))


class VocabEngine:
    """A target engine as pairing sees it, on a real vocabulary (llama.cpp's vocabulary-only GGUFs)."""

    def __init__(self, name, file_kind="gguf-vocab"):
        from llama_vocab import vocab
        from tandem.core.llama_runtime import LlamaModel
        self.model, self.file_kind = LlamaModel(vocab(name), vocab_only=True), file_kind
        self.vocab_size, self.vocab_fingerprint = self.model.n_vocab, self.model.vocab_fingerprint
        self.vocab_fingerprint_of = self.model.vocab_fingerprint_of

    def tokenizer_file(self):
        return None if self.file_kind is None else (self.file_kind, self.model.path)


@pytest.mark.models
@pytest.mark.parametrize("target, drafter, kind, web", [
    ("llama-bpe", "qwen2", pairing.TRANSLATED, r"converted from the target's GGUF vocabulary \(byte-level\)"),
    ("llama-spm", "llama-spm", pairing.NATIVE, r"converted .* \(sentencepiece\)"),
    ("gemma-4", "llama-spm", pairing.TRANSLATED, r"converted .* \(gemma4\)"),
    ("deepseek-coder", "qwen2", pairing.TRANSLATED,
     r"none: ggml-vocab-deepseek-coder.gguf: tokenizer 'gpt2' with pre-tokenizer 'deepseek-coder' has no "
     r"tokenizer.json conversion .* \(Python edges tokenize it with llama.cpp\)"),
])
def test_models_check_says_the_kind_of_pair_and_what_a_browser_client_gets(target, drafter, kind, web):
    from llama_vocab import vocab
    from tandem.core.llama_runtime import LlamaModel
    engine = VocabEngine(target)
    p = pairing.with_tokenizer_file(pairing.pairing(engine, LlamaModel(vocab(drafter), vocab_only=True)), engine)
    assert p.kind == kind
    line = pairing.report(p, None).splitlines()[-1]
    assert line.startswith("browser clients' tokenizer: ") and re.search(web, line), line


@pytest.mark.models
def test_a_pair_to_translate_without_a_tokenizer_file_is_refused():
    from llama_vocab import vocab
    from tandem.core.llama_runtime import LlamaModel
    drafter = LlamaModel(vocab("qwen2"), vocab_only=True)
    engine = VocabEngine("llama-bpe", None)
    p = pairing.with_tokenizer_file(pairing.pairing(engine, drafter), engine)
    assert p.kind == pairing.REFUSED and "offers no tokenizer file" in pairing.report(p, None)
    hf = VocabEngine("qwen2", "hf-tokenizer-json")
    p = pairing.with_tokenizer_file(pairing.pairing(hf, drafter), hf)
    assert p.kind == pairing.NATIVE and p.web == "the target's own tokenizer.json"


@pytest.mark.models
def test_predicted_tokens_per_forward_match_a_real_lock_step_run(engine, drafter, humaneval_chats, target_greedy):
    from tandem.cloud.server import serve
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.planner import FixedPlanner
    srv, port = serve(engine, "127.0.0.1:0", max_sessions=2)
    client = EdgeClient(drafter, f"127.0.0.1:{port}", TreeShape(1, 4, 4), stream=False)
    compared = 0
    try:
        for chat in humaneval_chats[:2]:
            predicted = pairing.measure(engine, drafter.model, [chat], 48, depths=(4,))
            prompt = engine.model.tokenize(engine.model.chat_prompt(chat))
            gen = client.generate(prompt, max_new_tokens=48, planner=FixedPlanner(TreeShape(1, 4, 4), False)).result()
            if gen.tokens != target_greedy(engine, prompt, 48).tokens:
                continue  # a target near-tie between batch shapes: another answer, another acceptance
            compared += 1
            measured = gen.stats.generated_tokens / gen.stats.rounds
            assert predicted["chain_tau"]["4"] == pytest.approx(measured, rel=0.1)
    finally:
        client.close()
        srv.stop(grace=None)
    assert compared, "no prompt decoded the same answer as target-only greedy decoding"


@pytest.mark.models
def test_models_check_says_native_padded_or_translated(target_path, drafter_path, tmp_path):
    from bench.gguf_copies import CACHE, permuted_copy
    from tandem.orchestrator import cli
    padded, _ = newline_twin_target(drafter_path)
    out = tmp_path / "check.json"
    assert cli.main(["models", "check", "--target", str(target_path), "--drafter", str(drafter_path),
                     "--prompts", "1", "--tokens", "16", "--json", str(out)]) == 0
    native = json.loads(out.read_text())
    assert native["kind"] == "native" and native["acceptance"]["tokens"] == 32  # one code and one chat prompt
    assert 0.3 < native["acceptance"]["agreement"] <= 1.0
    assert 1.0 <= native["acceptance"]["chain_tau"]["4"] <= 5.0
    assert cli.main(["models", "check", "--target", str(padded), "--drafter", str(drafter_path), "--prompts", "0",
                     "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {
        "kind": "padded", "target_ids": 152064, "drafter_ids": 151936, "detail": "", "acceptance": None,
        "web": "tokenizer.json converted from the target's GGUF vocabulary (byte-level)"}
    # the same model with its ids shuffled: refused as it is, drafted through translation (measured through a
    # local verifier: one prompt of each kind, short, as the stack's translation tests run it at length)
    assert cli.main(["models", "check", "--target", str(target_path), "--drafter",
                     str(permuted_copy(drafter_path, CACHE)), "--prompts", "1", "--tokens", "12",
                     "--json", str(out)]) == 0
    translated = json.loads(out.read_text())
    assert translated["kind"] == "translated" and "fingerprint" in translated["detail"]
    assert translated["acceptance"]["agreement"] is None and translated["acceptance"]["tokens"] == 24
    assert 1.2 <= translated["acceptance"]["chain_tau"]["6"] <= 7.0
