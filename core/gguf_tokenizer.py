"""A GGUF model's tokenizer as a Hugging Face ``tokenizer.json``: for clients that cannot run llama.cpp (a browser
with tokenizers.js or ``@huggingface/transformers``) and must tokenize exactly as a GGUF target does.

Built from the file's own vocabulary with the ``gguf`` package: ``tokenizer.ggml.tokens`` (the texts, in id order),
``token_type`` (control, unknown and user-defined tokens become added tokens, matched whole in text, as llama.cpp
matches them when it parses special tokens), and ``merges`` or ``scores``. The families converted (``FAMILIES``):

- byte-level BPE (``tokenizer.ggml.model`` "gpt2") with a pre-tokenizer this module knows (``tokenizer.ggml.pre``,
  ``BYTE_LEVEL``: the split llama.cpp applies before BPE): Qwen2 and Llama 3;
- SentencePiece (``tokenizer.ggml.model`` "llama": Llama 2, Mistral, Gemma 1-3) and Gemma 4's BPE over U+2581
  spaces (``tokenizer.ggml.model`` "gemma4"): ``core.spm_tokenizer``.

Anything else is refused by name rather than approximated. No normalizer beyond what llama.cpp applies (none for
byte-level BPE, spaces as U+2581 for SentencePiece). Tests hold the result to llama.cpp's tokenization of the
same file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from . import spm_tokenizer
from .errors import TandemError
from .gguf_meta import read_metadata

# llama.cpp's pre-tokenizer splits (llama-vocab.cpp), as the regex Hugging Face's Split pre-tokenizer takes, and
# whether a split that is a token whole is that token without merging (llama.cpp's ``ignore_merges``)
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL = {
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
        False,
    ),
    # Llama 3 (and the names llama.cpp gives the same split)
    "llama-bpe": (_LLAMA3, True),
    "llama3": (_LLAMA3, True),
    "llama-v3": (_LLAMA3, True),
}
FAMILIES = f"byte-level BPE ('gpt2') with {', '.join(sorted(BYTE_LEVEL))}; SentencePiece ('llama'); Gemma 4 ('gemma4')"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # llama.cpp's token types (all but NORMAL: matched whole)

# Token texts llama.cpp (0.3.36's llama-vocab.cpp) makes control tokens whatever type the file gives them: its
# end-of-generation texts always; each group of fill-in-the-middle texts when the file names no token of that
# role (keys: "tokenizer.ggml.<key>_token_id"). A control token renders as nothing in generated text and is
# matched whole only when special tokens are parsed, so the conversion has to know them.
FORCED_CONTROL = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
)  # fmt: skip
FORCED_FIM = {
    ("fim_pre", "prefix"): ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                            "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    ("fim_suf", "suffix"): ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                            "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    ("fim_mid", "middle"): ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                            "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    ("fim_pad",): ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("fim_rep",): ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("fim_sep",): ("<|file_sep|>",),
}  # fmt: skip


class UnsupportedTokenizer(TandemError, ValueError):
    pass


def tokenizer_json(path: str | Path, reader: Any = None) -> str:
    """The ``tokenizer.json`` of the GGUF at ``path`` (a model or a vocabulary-only file); ``reader``: that file's
    ``gguf.GGUFReader`` when the caller has one open, else its metadata is read here (``core.gguf_meta``)."""
    value = _metadata(path, reader)
    name = family(path, value)
    tokens: list[str] = value("tokenizer.ggml.tokens")
    if name == "sentencepiece":
        # (llama.cpp prefixes a space unless the file says not to)
        prefix = bool(value("tokenizer.ggml.add_space_prefix", True))
        parts = spm_tokenizer.sentencepiece(tokens, value("tokenizer.ggml.scores"), prefix)
    elif name == "gemma4":
        parts = spm_tokenizer.gemma4(tokens, value("tokenizer.ggml.merges"))
    else:
        parts = _byte_level(tokens, value("tokenizer.ggml.merges", []), *BYTE_LEVEL[value("tokenizer.ggml.pre")])
    return json.dumps(
        {"version": "1.0", "truncation": None, "padding": None, "added_tokens": _added_tokens(value), **parts,
         "post_processor": None},
        ensure_ascii=False,
    )  # fmt: skip


def family(path: str | Path, value: Callable[..., Any] | None = None) -> str:
    """Which converted family the GGUF at ``path`` has ("byte-level", "sentencepiece" or "gemma4"); a tokenizer
    this module does not convert raises ``UnsupportedTokenizer`` naming its model and pre-tokenizer."""
    value = value or _metadata(path, None)
    model, pre = value("tokenizer.ggml.model"), value("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre in BYTE_LEVEL and value("tokenizer.ggml.merges") is not None:
        return "byte-level"
    if model == "llama" and value("tokenizer.ggml.scores") is not None:
        return "sentencepiece"
    if model == "gemma4" and value("tokenizer.ggml.merges") is not None:
        return "gemma4"
    raise UnsupportedTokenizer(
        f"{Path(path).name}: tokenizer {model!r} with pre-tokenizer {pre!r} has no tokenizer.json conversion "
        f"({FAMILIES} only)"
    )


def _metadata(path: str | Path, reader: Any) -> Callable[..., Any]:
    """``value(key, default=None)`` of the file's metadata."""
    fields = reader.fields if reader is not None else read_metadata(path)

    def value(key: str, default=None):
        if key not in fields:
            return default
        return fields[key].contents() if reader is not None else fields[key]

    return value


def _added_tokens(value: Callable[..., Any]) -> list[dict[str, Any]]:
    """The tokens llama.cpp matches whole in text (control and unknown ones only when it parses special tokens),
    with the types llama.cpp gives them."""
    tokens: list[str] = value("tokenizer.ggml.tokens")
    types: list[int] = list(value("tokenizer.ggml.token_type", [1] * len(tokens)))
    forced = set(FORCED_CONTROL)
    for keys, texts in FORCED_FIM.items():
        if all(value(f"tokenizer.ggml.{key}_token_id") is None for key in keys):
            forced.update(texts)
    normal_s = "<|tool_response>" in tokens  # (Gemma 4's "</s>" is plain text: llama.cpp knows it by this token)
    for i, t in enumerate(tokens):
        if t == "</s>" and normal_s:
            types[i] = NORMAL
        elif t in forced:
            types[i] = CONTROL
    # llama.cpp strips the whitespace after a Phi-3 special token (by the model's name: the file does not say)
    name = str(value("general.name", "")).lower()
    phi3 = "phi-3" in name or "phi3" in name
    return [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "normalized": False,
         "rstrip": phi3 and t not in ("<unk>", "<s>", "<|endoftext|>"), "special": kind != USER_DEFINED}
        for i, (t, kind) in enumerate(zip(tokens, types))
        if kind in (UNKNOWN, CONTROL, USER_DEFINED)
    ]  # fmt: skip


def _byte_level(tokens: list[str], merges: list[str], regex: str, ignore_merges: bool) -> dict[str, Any]:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }  # fmt: skip
