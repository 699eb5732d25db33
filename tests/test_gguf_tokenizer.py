"""A GGUF's tokenizer as tokenizer.json (core/gguf_tokenizer.py), as a device gets it from the gateway
(GET /v1/edge/tokenizer: the verifier's vocabulary fetched and converted), held to llama.cpp's tokenization of the
target: the same ids on code, chat-template text with special tokens, digits, whitespace runs, contractions and
non-Latin scripts, the same vocabulary fingerprint, and a clear refusal of a tokenizer it cannot convert."""
import pytest

from scripted_gateway import KEY

from tandem.core.gguf_tokenizer import UnsupportedTokenizer, tokenizer_json
from tandem.core.hf_tokenizer import HfTokenizer
from tandem.core.llama_runtime import LlamaModel

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


@pytest.mark.parametrize("model, pre", [("gpt2", "made-up"), ("llama", "default")])
def test_a_tokenizer_it_cannot_convert_is_refused_by_name(tmp_path, model, pre):
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
