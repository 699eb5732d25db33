"""Vocabulary fingerprints: whether two models' token ids carry the same texts.

A fingerprint is sha256 over the token texts in id order, each followed by a zero byte. Padding is hashed as
empty: a vocabulary padded past its tokenizer (Qwen2.5's embeddings have 151,936 or 152,064 rows for 151,665
tokens) has no text at those ids in a Hugging Face tokenizer, while llama.cpp's GGUF converter writes the
placeholder ``[PAD<id>]`` there (and a tokenizer loaded back from a GGUF keeps it). Hashing both as empty lets a
GGUF drafter pair with a Hugging Face target of the same family; every other text, special tokens included, is
hashed as it is, so a real token never matches padding.
"""

from __future__ import annotations

import hashlib
from typing import Iterable


def fingerprint(texts: Iterable[bytes]) -> str:
    """The fingerprint of a vocabulary given its token texts in id order (from id 0)."""
    h = hashlib.sha256()
    for token, text in enumerate(texts):
        if text != b"[PAD%d]" % token:
            h.update(text)
        h.update(b"\0")
    return h.hexdigest()
