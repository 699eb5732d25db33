"""A drafter whose vocabulary a target pads (Qwen2.5 7B and up: 152,064 ids against the 0.5B drafter's 151,936):
accepted when the drafter's ids carry the target's texts, refused otherwise, and lossless when the target commits
ids the drafter does not have."""
import pytest

from bench.gguf_copies import NEWLINE, newline_twin_target
from tandem.cloud.session import MAX_EXTRA_IDS, Refused, check_vocabulary, extra_pieces
from tandem.edge.actions import Job
from tandem.edge.extra_ids import ExtraIds
from tandem.edge.rounds import NO_TREE


class Vocab:
    """A target's vocabulary from its token texts: fingerprints are the texts joined, prefixes by length."""

    def __init__(self, texts: list[str]):
        self.texts = texts
        self.vocab_size = len(texts)
        self.vocab_fingerprint = self.vocab_fingerprint_of(len(texts))

    def vocab_fingerprint_of(self, n: int) -> str:
        return "|".join(self.texts[:n])

    def piece(self, token: int) -> bytes:
        return b"" if self.texts[token].startswith("[PAD") else self.texts[token].encode()


TARGET = ["a", "b", "c", "d", "[PAD4]", "[PAD5]"]


@pytest.mark.parametrize("size, fingerprint, refused", [
    (6, "a|b|c|d|[PAD4]|[PAD5]", None),  # the same vocabulary
    (6, "", None),  # the same size, text check skipped (as before)
    (0, "", None),  # nothing claimed
    (6, "a|b|x|d|[PAD4]|[PAD5]", "same size but different token texts"),
    (4, "a|b|c|d", None),  # the target pads the drafter's vocabulary
    (4, "a|b|x|d", "over the drafter's 4 ids"),
    (4, "", "send the vocabulary fingerprint"),  # a smaller vocabulary must prove its texts
    (7, "a|b|c|d|[PAD4]|[PAD5]|e", "the drafter's is larger"),
])
def test_a_drafter_is_accepted_when_its_ids_carry_the_targets_texts(size, fingerprint, refused):
    engine = Vocab(TARGET)
    if refused is None:
        check_vocabulary(engine, size, fingerprint)
    else:
        with pytest.raises(Refused, match=refused):
            check_vocabulary(engine, size, fingerprint)


def test_too_many_extra_ids_is_not_a_padded_vocabulary():
    engine = Vocab(["t"] * 8 + ["[PAD]"] * (MAX_EXTRA_IDS + 1))
    with pytest.raises(Refused, match="more than the"):
        check_vocabulary(engine, 8, engine.vocab_fingerprint_of(8))


def test_the_verifier_renders_the_ids_past_the_drafters():
    engine = Vocab(["a", "b", "c", "<|x|>", "[PAD4]"])
    assert extra_pieces(engine, 3) == (b"<|x|>", b"")
    assert extra_pieces(engine, 5) == () == extra_pieces(engine, 0)


class Tok:
    n_vocab = 4
    texts = {" ": [3], "<|x|>": [1, 2], "": []}

    def tokenize(self, text, special=True):
        return self.texts.get(text, [0])

    def piece(self, token):
        return f"<{token}>".encode()


def test_the_edge_shows_extra_ids_with_the_targets_text_and_feeds_the_drafter_its_own():
    extra = ExtraIds(Tok(), [b"<|x|>", b""])  # ids 4 and 5
    assert extra.stand_in == (1, 3)  # the first token of the same text; a space for an empty one
    assert [extra.piece(Tok(), t) for t in (2, 4, 5)] == [b"<2>", b"<|x|>", b""]
    with pytest.raises(ValueError, match="past the target's vocabulary of 6"):
        extra.piece(Tok(), 6)
    job = Job(7, (("start", [0, 4]), ("catch_up",), ("extend", [5, 1]), ("commit", NO_TREE, [0], [2, 4])))
    assert extra.job(job) == Job(7, (("start", [0, 1]), ("catch_up",), ("extend", [3, 1]),
                                     ("commit", NO_TREE, [0], [2, 1])))


# -- the real model, padded ------------------------------------------------------------------------------------------
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def padded(drafter_path):
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    path, twin = newline_twin_target(drafter_path)
    return LlamaVerifierEngine(path, n_ctx=2048, max_sessions=2), twin


@pytest.mark.models
def test_a_padded_target_is_token_exact_with_a_drafter_that_lacks_its_extra_ids(padded, drafter, humaneval_chats):
    from tandem.cloud import reference
    from tandem.cloud.server import serve
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.planner import FixedPlanner
    from test_lossless import RecordingEngine
    engine, twin = padded
    assert engine.vocab_size == drafter.tokenizer.n_vocab + 128
    assert engine.vocab_fingerprint != drafter.tokenizer.vocab_fingerprint  # the old rule refused this pair
    rec = RecordingEngine(engine)
    srv, port = serve(rec, "127.0.0.1:0", max_sessions=2)
    client = EdgeClient(drafter, f"127.0.0.1:{port}", TreeShape.parse("1,6,6"), stream=False)
    committed_twins = 0
    try:
        for chat in humaneval_chats[:2]:
            prompt = engine.model.tokenize(engine.model.chat_prompt(chat))
            ref = reference.greedy(engine, prompt, NEW_TOKENS)  # (the padded twin: not the shared engine)
            rec.expected = []
            gen = client.generate(prompt, max_new_tokens=NEW_TOKENS, planner=FixedPlanner(TreeShape(1, 6, 6), False))
            text = "".join(gen)
            # every committed token is the verifier's own argmax, and the answer target-only decoding's (up to
            # batch-shape near-ties, as in test_lossless)
            assert gen.tokens == rec.expected[: len(gen.tokens)]
            noise = reference.batch_shape_noise(engine, prompt, ref.tokens[:8])
            verdict = reference.classify(gen.tokens, ref, noise)
            assert verdict[0] in ("exact", "near_tie"), verdict
            assert text == b"".join(engine.piece(t) for t in gen.tokens).decode()
            committed_twins += gen.tokens.count(twin)
            assert gen.stats.accepted_tokens > 0  # the drafter still drafts after the ids it lacks
            assert NEWLINE not in gen.tokens  # (the twin out-shouts the newline it mirrors)
    finally:
        client.close()
        srv.stop(grace=None)
    assert committed_twins >= 2, "the target never committed an id past the drafter's: the test proves nothing"


@pytest.mark.parametrize("a, b, same", [
    ([b"a", b"[PAD1]", b"[PAD2]"], [b"a", b"", b""], True),  # GGUF's padding placeholder = a tokenizer's no token
    ([b"a", b"[PAD2]"], [b"a", b""], False),  # a placeholder naming another id is a real text
    ([b"a", b"<|im_end|>"], [b"a", b""], False),  # a special token is not padding
    ([b"ab", b""], [b"a", b"b"], False),  # the separators keep texts apart
])
def test_fingerprints_hash_padding_as_empty(a, b, same):
    from tandem.core.vocab import fingerprint
    assert (fingerprint(a) == fingerprint(b)) is same
