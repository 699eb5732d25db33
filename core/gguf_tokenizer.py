"""A GGUF model's tokenizer as a Hugging Face ``tokenizer.json``: for clients that cannot run llama.cpp (a browser
with tokenizers.js or ``@huggingface/transformers``) and must tokenize exactly as a GGUF target does.

Built from the file's own vocabulary with the ``gguf`` package: ``tokenizer.ggml.tokens`` (the texts, in id order),
``token_type`` (control and user-defined tokens become added tokens, matched whole in text, as llama.cpp matches
them when it parses special tokens) and ``merges``. Only byte-level BPE (``tokenizer.ggml.model`` "gpt2") with a
pre-tokenizer this module knows (``tokenizer.ggml.pre``, ``PRE_TOKENIZERS``: the split llama.cpp applies before
BPE) is converted; anything else is refused by name rather than approximated. No normalizer: llama.cpp applies
none to these vocabularies. Tests hold the result to llama.cpp's tokenization of the same file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import TandemError

# llama.cpp's pre-tokenizer splits (llama-vocab.cpp), as the regex Hugging Face's Split pre-tokenizer takes
PRE_TOKENIZERS = {
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    ),
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types that are matched whole in text


class UnsupportedTokenizer(TandemError, ValueError):
    pass


def tokenizer_json(path: str | Path, reader: Any = None) -> str:
    """The ``tokenizer.json`` of the GGUF at ``path`` (a model or a vocabulary-only file); ``reader``: that file's
    ``gguf.GGUFReader`` when the caller has one open (opening one parses the whole vocabulary: seconds)."""
    from gguf import GGUFReader

    fields = (reader or GGUFReader(path)).fields

    def value(key: str, default=None):
        return fields[key].contents() if key in fields else default

    model, pre = value("tokenizer.ggml.model"), value("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise UnsupportedTokenizer(
            f"{Path(path).name}: tokenizer {model!r} with pre-tokenizer {pre!r} has no tokenizer.json conversion "
            f"(byte-level BPE with {', '.join(sorted(PRE_TOKENIZERS))} only)"
        )
    tokens: list[str] = value("tokenizer.ggml.tokens")
    types: list[int] = value("tokenizer.ggml.token_type", [1] * len(tokens))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": kind == CONTROL}
        for i, (t, kind) in enumerate(zip(tokens, types))
        if kind in (CONTROL, USER_DEFINED)
    ]  # fmt: skip
    return json.dumps({
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRE_TOKENIZERS[pre]}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": value("tokenizer.ggml.merges", [])},
    }, ensure_ascii=False)  # fmt: skip
