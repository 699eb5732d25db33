"""A GGUF's tokenizer as tokenizer.json (core/gguf_tokenizer.py), held to llama.cpp's tokenization of the same
vocabulary, family by family (Qwen2 and Llama 3 byte-level BPE, Llama 2 / Mistral and Phi-3 SentencePiece, Gemma 3
SentencePiece, Gemma 4 BPE over U+2581 spaces): the same ids on a table of hard strings and on llama.cpp's own
tokenizer test strings, the same bytes for every id, the same vocabulary fingerprint; a family it cannot convert
refused by name. And as a device gets it from the gateway (GET /v1/edge/tokenizer: the verifier's vocabulary
fetched and converted)."""
import json

import pytest

from scripted_gateway import KEY

import llama_vocab
from tandem.core.gguf_tokenizer import UnsupportedTokenizer, family, tokenizer_json
from tandem.core.hf_tokenizer import HfTokenizer
from tandem.core.llama_runtime import LlamaModel
from tandem.orchestrator import models

TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "In 2026, 3.14159 * 1234567 = 3878505.4 and x[12345] != y_0.",
    "I'm sure they'll say it's what we've DONE, isn't it? \t\t  spaces   \n\n  \r\n tabs\t",
    "日本語のテキストと한국어 그리고 Ελληνικά, emoji 🤖🚀 and accents: café naïve coöperate",
    "    if x:\n\t\tpass  # trailing   \n}",
]


@pytest.fixture(scope="module")
def pair(target_path, server, shared_drafter):
    from tandem.orchestrator.gateway.app import create_app
    from tandem.orchestrator.gateway.config import GatewayConfig
    from tandem.orchestrator.gateway.drafter_pool import DrafterPool
    from tandem.core.auth import ApiKeys
    from tandem.edge.client import EdgeClient
    from fastapi.testclient import TestClient
    client = EdgeClient(shared_drafter, server, None)
    with TestClient(create_app(DrafterPool([client]), GatewayConfig(keys=ApiKeys.of([KEY])))) as http:
        r = http.get("/v1/edge/tokenizer", headers={"Authorization": f"Bearer {KEY}"})
        again = http.get("/v1/edge/tokenizer", headers={"Authorization": f"Bearer {KEY}"})  # (found by fingerprint)
    assert again.content == r.content and again.headers["x-vocab-fingerprint"] == r.headers["x-vocab-fingerprint"]
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    llama = LlamaModel(target_path, vocab_only=True)
    assert r.headers["x-vocab-fingerprint"] == llama.vocab_fingerprint
    return llama, HfTokenizer(r.content)


@pytest.mark.models
@pytest.mark.parametrize("text", TEXTS)
def test_the_same_ids_as_llama_cpp(pair, text):
    llama, hf = pair
    assert hf.tokenize(text) == llama.tokenize(text)
    if "<|" not in text:  # (the tokenizers library cannot leave special tokens spelled in text unmatched)
        assert hf.tokenize(text, special=False) == llama.tokenize(text, special=False)


@pytest.mark.models
def test_the_same_vocabulary_fingerprint(pair):
    llama, hf = pair
    assert hf.n_vocab == llama.n_vocab and hf.vocab_fingerprint == llama.vocab_fingerprint


# -- the families, on hard strings ----------------------------------------------------------------------------------
FAMILIES = {  # name: llama.cpp's vocabulary-only GGUF of the family (Gemma 3: the named model)
    "qwen2": "qwen2",
    "llama-3": "llama-bpe",
    "llama-2-spm": "llama-spm",
    "phi-3-spm": "phi-3",
    "gemma-3": None,
    "gemma-4": "gemma-4",
}
HARD = {
    "empty": "",
    "one space": " ",
    "spaces": "  leading and  double  spaces   trailing   ",
    "whitespace runs": " " * 40 + "x" + "\n" * 5 + "\t" * 3 + " \n \r\n\r\n",
    "digits": "1234567890123456789 and 3.14159 * 1234567 = 3878505.4, x[12345] != y_0 in 2026",
    "emoji": "emoji 🤖🚀 family 👨‍👩‍👧‍👦 heart ❤️ flag 🇯🇵 ✅",
    "cjk": "日本語のテキストと한국어 그리고 中文字符，标点。ｆｕｌｌ",
    "code tabs": "def fib(n):\n\tif n < 2:\n\t\treturn n\n    return fib(n - 1) + fib(n - 2)\n\n\n",
    "code mixed indentation": "    if x:\n\t\tpass  # trailing   \n}\r\n\t  \t}\n",
    "byte fallback": "rare: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 𓀀 ᚠᛇᚻ 🜁 ⸻ 🫨 \u2028 tail",
    "contractions": "I'm sure they'll say it's what we've DONE, isn't it? I'M YOU'RE 'tis",
    "accents": "café naïve coöperate Ελληνικά Русский Cửa Việt",
    "markers spelled": "<0x41> is a byte token's text, \u2581 a space's; <unk> </s> <s> <|endoftext|> <eos>",
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def vocab(request):
    """(llama.cpp's tokenizer, the conversion read by the edge's reader of tokenizer.json, the texts of the
    tokens llama.cpp matches only when it parses special tokens, llama.cpp's test strings for the family), one
    family at a time."""
    name = FAMILIES[request.param]
    path = llama_vocab.vocab(name) if name else models.fetch("gemma3-270m", progress=False)
    converted = tokenizer_json(path)
    specials = [t["content"] for t in json.loads(converted)["added_tokens"] if t["special"]]
    strings = llama_vocab.llama_cpp_strings(name or "llama-bpe")  # (Gemma 3's: the common ones)
    return LlamaModel(path, vocab_only=True), HfTokenizer(converted), specials, strings


def spelled_specials(llama):
    """Text that spells the family's own BOS and EOS, next to spaces and newlines."""
    bos, eos = llama.special_text("bos"), llama.special_text("eos")
    return f"{bos}user\nHi there!{eos}\n{bos} next  {eos}{eos}x"


def assert_as_llama_cpp(llama, hf, specials, text):
    ids = llama.tokenize(text)
    assert hf.tokenize(text) == ids
    for special in (False, True):
        assert b"".join(hf.piece(t, special) for t in ids) == b"".join(llama.piece(t, special) for t in ids)
    if not any(s in text for s in specials):  # (the tokenizers library always matches special tokens spelled)
        assert hf.tokenize(text, special=False) == llama.tokenize(text, special=False)


@pytest.mark.models
@pytest.mark.parametrize("case", [*HARD, "special tokens spelled"])
def test_a_family_tokenizes_hard_strings_as_llama_cpp(vocab, case):
    llama, hf, specials, _ = vocab
    assert_as_llama_cpp(llama, hf, specials, HARD[case] if case in HARD else spelled_specials(llama))


@pytest.mark.models
def test_a_family_tokenizes_llama_cpps_own_test_strings(vocab):
    llama, hf, _, strings = vocab
    assert len(strings) > 40
    assert [t for t in strings if hf.tokenize(t) != llama.tokenize(t)] == []


@pytest.mark.models
def test_a_family_has_llama_cpps_fingerprint_and_bytes_for_every_id(vocab):
    llama, hf, _, _ = vocab
    assert hf.n_vocab == llama.n_vocab and hf.vocab_fingerprint == llama.vocab_fingerprint
    for special in (False, True):
        wrong = [t for t in range(llama.n_vocab) if hf.piece(t, special) != llama.piece(t, special)
                 and llama.piece(t, True) != b"[PAD%d]" % t]  # (padding renders as nothing: core/vocab.py)
        assert not wrong, [(t, llama.piece(t, special)) for t in wrong[:5]]


# -- what it refuses ------------------------------------------------------------------------------------------------
@pytest.mark.models
@pytest.mark.parametrize("name, model, pre", [("deepseek-coder", "gpt2", "deepseek-coder"),
                                              ("bert-bge", "bert", "bert-bge")])
def test_a_family_it_cannot_convert_is_refused_by_name(name, model, pre):
    path = llama_vocab.vocab(name)
    LlamaModel(path, vocab_only=True)  # (llama.cpp itself reads it)
    for convert in (tokenizer_json, family):
        with pytest.raises(UnsupportedTokenizer, match=f"tokenizer '{model}' with pre-tokenizer '{pre}' has no "
                                                        "tokenizer.json conversion .*SentencePiece"):
            convert(path)


@pytest.mark.parametrize("model, pre", [("gpt2", "made-up"), ("t5", "default"), ("llama", "default")])
def test_a_tokenizer_it_cannot_convert_is_refused_by_name(tmp_path, model, pre):
    """(the "llama" file has no scores: nothing to rank SentencePiece's merges by)"""
    from gguf import GGUFWriter
    writer = GGUFWriter(tmp_path / "vocab.gguf", "qwen2")
    writer.add_string("tokenizer.ggml.model", model)
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(UnsupportedTokenizer, match=f"tokenizer '{model}' with pre-tokenizer '{pre}'"):
        tokenizer_json(tmp_path / "vocab.gguf")
