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
import os
import re
from pathlib import Path
from typing import Iterable

_FINGERPRINT = re.compile(r"[0-9a-f]{64}")  # sha256, lowercase hex (``fingerprint``)


def is_fingerprint(s: str) -> bool:
    """Whether ``s`` has a fingerprint's form: what a fingerprint from elsewhere (a verifier's) must have before it
    names a file."""
    return _FINGERPRINT.fullmatch(s) is not None


def fingerprint(texts: Iterable[bytes]) -> str:
    """The fingerprint of a vocabulary given its token texts in id order (from id 0)."""
    h = hashlib.sha256()
    for token, text in enumerate(texts):
        if text != b"[PAD%d]" % token:
            h.update(text)
        h.update(b"\0")
    return h.hexdigest()


def write_vocab_gguf(src: str | Path, dst: str | Path) -> Path:
    """Write a vocabulary-only copy of the GGUF model ``src`` (every metadata key, no tensor: what llama.cpp
    needs to tokenize with ``vocab_only``; a few MB against the model's GBs), atomically; returns ``dst``."""
    from gguf import GGUFReader, GGUFWriter, Keys

    dst = Path(dst)
    reader = GGUFReader(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    writer = GGUFWriter(tmp, reader.fields[Keys.General.ARCHITECTURE].contents())
    copy_metadata(reader, writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def copy_metadata(reader, writer, replaced: dict | None = None) -> None:
    """Every metadata key of a ``gguf.GGUFReader`` into a ``gguf.GGUFWriter``, with the values in ``replaced``
    instead of the file's (the architecture and the file's own counts are the writer's to write)."""
    from gguf import GGUFValueType, Keys

    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        value = (replaced or {}).get(field.name)
        writer.add_key_value(
            field.name,
            field.contents() if value is None else value,
            kind,
            sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None,
        )


def served_vocab_gguf(src: str | Path, fingerprint_hex: str) -> Path:
    """The vocabulary-only GGUF a verifier offers for the model ``src`` (whose vocabulary has ``fingerprint_hex``):
    written into the cache the first time, read from it after."""
    from .cache import cache_dir

    path = cache_dir() / "verifier" / "tokenizers" / f"{fingerprint_hex[:32]}.gguf"
    return path if path.is_file() else write_vocab_gguf(src, path)
