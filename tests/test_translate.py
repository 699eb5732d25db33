"""Drafting for a target with another tokenizer (edge/translate.py): the drafter's history follows the committed
text across token boundaries and split characters, drafts become whole target tokens, and through the real stack
the output is the target's, token for token."""
from pathlib import Path

import pytest

from tandem.core.tree import TreeShape, common_prefix
from tandem.edge.drafting import BuiltTree
from tandem.core.tree import DraftTree
from tandem.edge.translate import TranslatingDrafter, _complete_utf8


class Vocab:
    """A byte-level tokenizer: greedy longest match over its token byte strings (every single byte is one)."""

    def __init__(self, words, eog=()):
        self.tokens = [bytes([b]) for b in range(256)] + [w.encode() for w in words]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.n_vocab, self.vocab_fingerprint, self.eog = len(self.tokens), "|".join(words), set(eog)

    def tokenize(self, text, special=True):
        data, out, i = text.encode(), [], 0
        while i < len(data):
            n = max(n for n in range(1, len(data) - i + 1) if data[i:i + n] in self.ids)
            out.append(self.ids[data[i:i + n]])
            i += n
        return out

    def piece(self, token, special=False):
        return self.tokens[token]

    def is_eog(self, token):
        return token in self.eog

    def word(self, w):
        return self.ids[w.encode()]


TARGET = Vocab(["def", " add", "(a", ", b", "):", "\n   ", " return", " a", " +", " b", "ll", "llo", "é"])
DRAFTER = Vocab([" a", "dd", "(", "a,", " b)", ":\n", "  ", "re", "turn", "ell", "lo"])


class ScriptDrafter:
    """Drafts the next characters of ``script`` after its history's text, in its own tokenizer's ids."""
    name, n_ctx = "script", 4096

    def __init__(self, script):
        self.tokenizer, self.script, self.history, self.starts = DRAFTER, script, [], []

    def start(self, prompt):
        self.history = list(prompt)
        self.starts.append(list(prompt))

    def pending(self):
        return 0

    def catch_up(self):
        pass

    def text(self):
        return b"".join(DRAFTER.piece(t) for t in self.history).decode()

    def draft(self, shape):
        done = self.text()
        assert self.script.startswith(done), (done, self.script)
        chain = DRAFTER.tokenize(self.script[len(done):])[:shape.d]
        return BuiltTree(DraftTree(tuple(chain), tuple(range(-1, len(chain) - 1))), (), ())

    def commit(self, built, accepted, tokens):
        raise AssertionError("the translating drafter re-syncs with start(), never commits in drafter ids")


SCRIPT = "def add(a, b):\n    return a + b"


def ids(*words):
    return [TARGET.word(w) for w in words]


@pytest.mark.parametrize("committed, depth, expected", [
    # 8 drafter tokens spell " add(a, b):\n    ", 7 " add(a, b):\n  ": "\n   " and "\n" differ, " " may grow
    (["def"], 6, [" add", "(a", ", b", "):"]),
    (["def"], 2, [" add"]),  # 4 drafter tokens " add(a,": "(a" is spelled "(" without "a,"
    (["def", " add"], 6, ["(a", ", b", "):", "\n   "]),
    ([], 3, ["def"]),  # nothing to anchor on: the draft is tokenised alone
])
def test_a_draft_becomes_whole_target_tokens(committed, depth, expected):
    inner = ScriptDrafter(SCRIPT)
    d = TranslatingDrafter(inner, TARGET)
    d.start(ids(*committed))
    built = d.draft(TreeShape(1, depth, depth))
    assert [TARGET.tokens[t].decode() for t in built.tree.tokens] == expected
    assert built.tree.parents == tuple(range(-1, len(expected) - 1))  # a chain


def test_the_drafters_history_is_its_own_tokenisation_of_the_committed_text():
    inner = ScriptDrafter("Hello")
    d = TranslatingDrafter(inner, Vocab(["H", "e", "ll", "o"]))
    d.start([d.tokenizer.word("H"), d.tokenizer.word("e")])
    for w in ("ll", "o"):  # "He" + "ll" -> the drafter's "H" "ell"; + "o" -> "H" "ell" "o"
        d.commit(None, (), [d.tokenizer.word(w)])
        text = b"".join(d.tokenizer.piece(t) for t in d._committed).decode()
        assert inner.history == DRAFTER.tokenize(text)
    assert inner.starts[-1] == [DRAFTER.ids[b"H"], DRAFTER.word("ell"), DRAFTER.ids[b"o"]]


def test_a_character_split_between_target_tokens_waits_for_its_end():
    target = Vocab([])  # bytes only: "é" is two tokens
    inner = ScriptDrafter("é!")
    d = TranslatingDrafter(inner, target)
    first, second = "é".encode()
    d.start([first])
    assert inner.history == []  # half a character: nothing the drafter can read yet
    d.commit(None, (), [second])
    assert inner.text() == "é"
    assert [target.tokens[t] for t in d.draft(TreeShape(1, 4, 4)).tree.tokens] == []  # "!": one token, unstable


def test_a_draft_stops_at_the_drafters_end_of_generation():
    eos = Vocab([" add", "<e>"], eog=[257])  # drafter id 257 ("<e>") ends generation

    class Eos(ScriptDrafter):
        def draft(self, shape):
            chain = (eos.word(" add"), eos.word("<e>"), eos.word(" add"), eos.word(" add"))
            return BuiltTree(DraftTree(chain, (-1, 0, 1, 2)), (), ())
    inner = Eos("")
    inner.tokenizer = eos
    d = TranslatingDrafter(inner, TARGET)
    d.start(ids("def"))
    assert d.draft(TreeShape(1, 6, 6)).tree.tokens == ()  # " add" alone, unstable: nothing past the end


@pytest.mark.parametrize("data, complete", [
    (b"", 0), (b"abc", 3), ("é".encode(), 2), ("é".encode()[:1], 0), (b"a" + "你".encode()[:2], 1),
    ("你".encode(), 3), ("😀".encode()[:3], 0), ("😀".encode(), 4),
])
def test_complete_utf8(data, complete):
    assert _complete_utf8(data) == complete


def test_the_tokenizer_is_for_key_holders_and_an_engine_without_one_says_so():
    import grpc

    from scripted import ScriptedEngine, succ
    from tandem.cloud.server import serve
    from tandem.core.auth import ApiKeys
    from tandem.protos import verifier_pb2 as pb
    from tandem.protos import verifier_pb2_grpc as pb_grpc
    srv, port = serve(ScriptedEngine(succ), "127.0.0.1:0", keys=ApiKeys.of(["k-one"]))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                                   ((("authorization", "Bearer k-one"),), grpc.StatusCode.UNIMPLEMENTED)):
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Tokenizer(pb.TokenizerRequest(), metadata=metadata, timeout=10))
                assert e.value.code() == code
    finally:
        srv.stop(grace=None)


# -- real vocabularies of other families (llama.cpp's vocabulary-only GGUFs) ---------------------------------------
class TextDrafter:
    """Drafts the next tokens of ``text`` after its history's text, in ``tokenizer``'s ids (as a continuation)."""
    name, n_ctx = "text", 4096

    def __init__(self, tokenizer, text):
        from tandem.edge.translate import Continuation
        self.tokenizer, self.text, self.history, self._tokenize = tokenizer, text, [], Continuation(tokenizer)

    def start(self, prompt):
        self.history = list(prompt)

    def pending(self):
        return 0

    def catch_up(self):
        pass

    def draft(self, shape):
        done = b"".join(self.tokenizer.piece(t, special=True) for t in self.history).decode()
        assert self.text.startswith(done), (done, self.text)  # the history spells the committed text
        chain = self._tokenize(self.text[len(done):], special=False)[:shape.d]
        return BuiltTree(DraftTree(tuple(chain), tuple(range(-1, len(chain) - 1))), (), ())


LLAMA_TEXT = "The quick brown fox jumps over the lazy dog.\n    def f(x):\n\t\treturn x  +  1\n日本語のテキスト 🤖 done"


@pytest.mark.models
@pytest.mark.parametrize("target, drafter", [("llama-spm", "qwen2"), ("qwen2", "llama-spm"),
                                             ("llama-bpe", "llama-spm"), ("llama-spm", "llama-bpe"),
                                             ("gemma-4", "llama-spm"), ("qwen2", "llama-bpe")])
def test_a_sentencepiece_vocabulary_translates_without_its_dummy_prefix(target, drafter):
    """Llama 2's tokenizer writes a space before any text it is given (llama.cpp's add_space_prefix): on either
    side of a translation, text from the middle of the conversation must not get one. A drafter that knows the
    text then drafts only the target's own next tokens, and most of them."""
    from llama_vocab import vocab
    from tandem.core.llama_runtime import LlamaModel
    from tandem.edge.translate import Continuation
    target, drafter = (LlamaModel(vocab(name), vocab_only=True) for name in (target, drafter))
    ids = target.tokenize(LLAMA_TEXT)
    text = b"".join(target.piece(t) for t in ids).decode()
    d = TranslatingDrafter(TextDrafter(drafter, text), target)
    d.start(ids[:3])
    at, accepted, sent = 3, 0, 0
    while at < len(ids):
        tokens = list(d.draft(TreeShape(1, 4, 4)).tree.tokens)
        n = common_prefix(tokens, ids[at:])
        assert n == len(tokens), (tokens, ids[at:at + len(tokens)])  # every drafted token is the target's own
        accepted, sent = accepted + n, sent + len(tokens)
        d.commit(None, (), ids[at:at + n + 1])
        at += n + 1
    assert accepted >= len(ids) // 2
    for tok in (target, drafter):
        prefixed = b"".join(tok.piece(t) for t in tok.tokenize("fox", special=False)) == b" fox"
        assert prefixed == (tok.path.name == "ggml-vocab-llama-spm.gguf")
        assert b"".join(tok.piece(t) for t in Continuation(tok)("fox", special=False)) == b"fox"


# -- the real stack ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def permuted_drafter(drafter_path):
    """The 0.5B drafter with its token ids shuffled: it segments text as the target does, but shares no id with it,
    so the verifier refuses it as it is."""
    from bench.gguf_copies import CACHE, permuted_copy
    from tandem.edge.llama_drafter import LlamaDrafter
    return LlamaDrafter(permuted_copy(drafter_path, CACHE), n_ctx=2048)


@pytest.mark.models
def test_a_drafter_with_another_tokenizer_drafts_for_the_target_token_exact(engine, permuted_drafter,
                                                                             humaneval_chats, target_greedy):
    from tandem.cloud import reference
    from tandem.cloud.server import serve
    from tandem.edge.client import EdgeClient, RemoteError
    from tandem.edge.planner import FixedPlanner
    from tandem.edge.translate import SUFFIX, tokenizer_cache
    from test_lossless import RecordingEngine
    rec = RecordingEngine(engine)
    srv, port = serve(rec, "127.0.0.1:0", max_sessions=2)
    client = EdgeClient(permuted_drafter, f"127.0.0.1:{port}", TreeShape(1, 6, 6), stream=False)
    planner = FixedPlanner(TreeShape(1, 6, 6), False)
    try:
        prompt = engine.model.tokenize(engine.model.chat_prompt(humaneval_chats[0]))
        with pytest.raises(RemoteError, match="fingerprint"):  # as it is, the verifier refuses it
            client.generate(prompt, max_new_tokens=4, planner=planner).result()
        for kind in SUFFIX:  # fetched over gRPC, not from the cache (in any format: the same vocabulary)
            tokenizer_cache(engine.vocab_fingerprint, kind).unlink(missing_ok=True)
        assert client.pair_with_target() == "translated"
        assert tokenizer_cache(engine.vocab_fingerprint, "gguf-vocab").is_file()  # this engine offers its GGUF's
        assert client.prompt_tokens(humaneval_chats[0]) == prompt  # prompts now in the target's ids
        accepted = 0
        for chat in humaneval_chats[:2]:
            prompt = engine.model.tokenize(engine.model.chat_prompt(chat))
            ref = target_greedy(engine, prompt, 48)
            rec.expected = []
            gen = client.generate(prompt, max_new_tokens=48, planner=planner)
            text = "".join(gen)
            assert gen.tokens == rec.expected[: len(gen.tokens)]  # each token is the verifier's own argmax
            verdict = reference.classify(gen.tokens, ref, reference.batch_shape_noise(engine, prompt, ref.tokens[:8]))
            assert verdict[0] in ("exact", "near_tie"), verdict
            assert text == b"".join(engine.model.piece(t) for t in gen.tokens).decode()
            accepted += gen.stats.accepted_tokens
        assert accepted >= 24, "translated drafts of the same model family should mostly be accepted"
    finally:
        client.close()
        srv.stop(grace=None)


@pytest.mark.models
def test_gemma_drafts_for_the_qwen_target_through_translation_token_exact(engine, humaneval_chats, target_greedy):
    """Gemma 3 270M (SentencePiece-BPE, 262,144 ids, trained apart) drafting for the Qwen target: paired by
    translation, every token the verifier's own argmax, the answer the target's, and some drafts accepted; sampled
    with a pinned seed (position-keyed draws), what target-only sampling draws, up to a draw within batch-shape
    noise of a CDF boundary."""
    from tandem.cloud import reference
    from tandem.cloud.server import serve
    from tandem.edge.client import EdgeClient
    from tandem.edge.llama_drafter import LlamaDrafter
    from tandem.core.sampling import Sampling
    from tandem.edge.planner import FixedPlanner
    from tandem.orchestrator import models
    from test_lossless import RecordingEngine
    rec = RecordingEngine(engine)
    srv, port = serve(rec, "127.0.0.1:0", max_sessions=2)
    client = EdgeClient(LlamaDrafter(models.fetch("gemma3-270m", progress=False), n_ctx=2048),
                        f"127.0.0.1:{port}", TreeShape(1, 4, 4), stream=False)
    try:
        assert client.pair_with_target() == "translated"
        prompt = engine.model.tokenize(engine.model.chat_prompt(humaneval_chats[0]))
        assert client.prompt_tokens(humaneval_chats[0]) == prompt
        ref = target_greedy(engine, prompt, 40)
        rec.expected = []
        gen = client.generate(prompt, max_new_tokens=40, planner=FixedPlanner(TreeShape(1, 4, 4), False))
        text = "".join(gen)
        assert gen.tokens == rec.expected[: len(gen.tokens)]
        verdict = reference.classify(gen.tokens, ref, reference.batch_shape_noise(engine, prompt, ref.tokens[:8]))
        assert verdict[0] in ("exact", "near_tie"), verdict
        assert text == b"".join(engine.model.piece(t) for t in gen.tokens).decode()
        assert gen.stats.drafted_nodes > 0 and gen.stats.accepted_tokens > 0
        for seed in (1, 2):
            s = Sampling(0.8, top_p=0.95, seed=seed)
            gen = client.generate(prompt, max_new_tokens=24, sampling=s,
                                  planner=FixedPlanner(TreeShape(1, 4, 4), False)).result()
            ref = reference.decode(engine, prompt, 24, s)
            first = next((i for i, (a, b) in enumerate(zip(gen.tokens, ref.tokens)) if a != b), None)
            assert first is None or ref.cdf_margin[first] < 0.02, (seed, first, ref.cdf_margin[first])
            assert len(gen.tokens) == len(ref.tokens) or first is not None
            assert gen.stats.drafted_nodes > 0
    finally:
        client.close()
        srv.stop(grace=None)


@pytest.mark.models
def test_a_hugging_face_tokenizer_json_tokenizes_and_renders_as_llama_cpp_does(drafter_path, tmp_path):
    """The edge's reader of a target's tokenizer.json (core/hf_tokenizer.py) against llama.cpp's reading of the
    same vocabulary: the same ids for text, the same bytes for ids, the same fingerprint."""
    transformers = pytest.importorskip("transformers")
    from tandem.core.hf_tokenizer import HfTokenizer
    from tandem.core.llama_runtime import LlamaModel
    path = Path(drafter_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours, llama = HfTokenizer(hf.backend_tokenizer.to_str(), vocab_size=152064), LlamaModel(path, vocab_only=True)
    assert ours.n_vocab == 152064 and ours.vocab_fingerprint_of(llama.n_vocab) == llama.vocab_fingerprint
    for text in ("def add(a, b):\n    return a + b\n", "héllo 你好 😀 — naïve café", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.tokenize(text) == llama.tokenize(text)
    for t in [*range(0, llama.n_vocab, 97), 151643, 151645, 151665, 151935]:
        assert ours.piece(t) == llama.piece(t) and ours.piece(t, special=True) == llama.piece(t, special=True), t
    assert ours.piece(152000) == b""  # padding past the tokenizer's ids
