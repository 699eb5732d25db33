"""The SentencePiece-style vocabularies of GGUF files as Hugging Face ``tokenizer.json`` parts
(``core.gguf_tokenizer`` assembles them): spaces written as U+2581, text no token covers written as ``<0xNN>``
byte tokens, no byte-level mapping.

Two of llama.cpp's tokenizers read such vocabularies:

- ``tokenizer.ggml.model`` "llama" (Llama 2, Mistral, Gemma 1-3): llama.cpp's SPM tokenizer. It has no merge
  list: starting from characters, it keeps merging the adjacent pair whose concatenation is the vocabulary's
  highest-scoring token. That is BPE with a merge for every way of cutting a token in two (both halves tokens),
  ranked by the whole token's score, which is how Hugging Face converts SentencePiece models too. A space is
  prefixed to the text, and again after every special token, when ``tokenizer.ggml.add_space_prefix`` says so
  (llama.cpp's default for this model is yes): Hugging Face's ``Prepend`` normalizer runs on each stretch of
  text between added tokens, which is the same thing.
- ``tokenizer.ggml.model`` "gemma4": BPE with the file's own merges over U+2581 spaces, the text split only
  between newline runs and the rest (llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_GEMMA4``).
"""

from __future__ import annotations

from typing import Any, Sequence

SPACE = "\u2581"


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[list[str]]:
    """Every cut of a token into two tokens, best-scoring whole first: llama.cpp's SPM merge order as ranks.
    Every token takes part, special ones too: llama.cpp merges into any token whose text the pair spells."""
    ids = {t: i for i, t in enumerate(tokens)}
    cuts = []
    for i, text in enumerate(tokens):
        for k in range(1, len(text)):
            left, right = text[:k], text[k:]
            if left in ids and right in ids:
                # Ties in score go by the halves' ids, as Hugging Face's SentencePiece converter orders them.
                # Where two overlapping pairs tie, llama.cpp merges the leftmost and Hugging Face the lower rank:
                # they differ only when both spell tokens of one score (Llama 2's runs of spaces all score
                # -1e9, which the tests' whitespace strings cover).
                cuts.append((-scores[i], ids[left], ids[right], left, right))
    cuts.sort()
    return [[left, right] for *_, left, right in cuts]


def _escape(add_space_prefix: bool) -> dict[str, Any]:
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    if not add_space_prefix:
        return replace
    return {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace]}


def _decoder() -> dict[str, Any]:
    """What turns ids back into text (tokenizers.js decodes with it): U+2581 as a space, byte tokens as their
    bytes. A dummy prefix's space is kept, as llama.cpp's pieces keep it (the edge renders text by pieces)."""
    return {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ],
    }


def _bpe(tokens: Sequence[str], merges: list, ignore_merges: bool = False) -> dict[str, Any]:
    # byte_fallback: a character no token holds becomes its UTF-8 bytes' <0xNN> tokens, as in llama.cpp
    return {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": True, "ignore_merges": ignore_merges,
            "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges}  # fmt: skip


def sentencepiece(tokens: Sequence[str], scores: Sequence[float], add_space_prefix: bool) -> dict[str, Any]:
    """The normalizer, pre-tokenizer, decoder and model of a ``tokenizer.ggml.model`` "llama" vocabulary."""
    return {
        "normalizer": _escape(add_space_prefix),
        "pre_tokenizer": None,  # SPM merges across the whole stretch of text
        "decoder": _decoder(),
        "model": _bpe(tokens, spm_merges(tokens, scores)),
    }


def gemma4(tokens: Sequence[str], merges: Sequence[str]) -> dict[str, Any]:
    """The same parts for a ``tokenizer.ggml.model`` "gemma4" vocabulary (its merges: "left right" strings)."""
    return {
        "normalizer": _escape(False),
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": "[^\\n]+|[\\n]+"},
            "behavior": "Isolated",
            "invert": False,
        },  # fmt: skip
        "decoder": _decoder(),
        # (cut at the first space after the first character, as llama.cpp reads them)
        "model": _bpe(tokens, [[m[: m.find(" ", 1)], m[m.find(" ", 1) + 1 :]] for m in merges]),
    }
