"""Copies of a GGUF model with its vocabulary changed, written with the gguf package (cached by name in
the cache's test/ folder), to test pairs the default models do not make.

``padded_copy``: the vocabulary padded, the way Qwen2.5 7B and up pad the small models' (151,936 -> 152,064 ids):
the extra ids are "[PAD<id>]" tokens of type UNUSED (they render as nothing), their embedding and output rows
zero, so the copy decodes exactly as the original. ``mirror={pad_id: token}`` makes one extra id a louder twin of a
real token: its embedding row is the token's and its output row the token's with every block scale times
``boost``, so wherever the original's argmax is ``token`` (with a positive logit) the copy commits ``pad_id`` and
then goes on as the original would after ``token``: a target that commits ids its drafter does not have.

``permuted_copy``: the same model with its token ids shuffled (texts, types, embedding and output rows, special
ids moved together; merges are texts and stay): a model that segments text exactly as the original but shares
no id with it, the smallest pair with "another tokenizer".
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, Keys, TokenType

from tandem.core.cache import cache_dir
from tandem.core.vocab import copy_metadata

VERSION = 1  # bump when what is written changes: the cached copy is rebuilt
CACHE = cache_dir() / "test"
OUTPUT_ROWS = ("output.weight", "token_embd.weight")  # the head; the embedding doubles as it when tied
SCALED = {"Q8_0": 34, "Q5_0": 22, "Q4_0": 18}  # block bytes of formats whose block scale is the leading fp16


def _rows(data: np.ndarray, n_extra: int, mirror: dict[int, int], n_vocab: int, type_name: str,
          boost: float) -> np.ndarray:
    extra = np.zeros((n_extra, data.shape[1]), dtype=data.dtype)
    for pad, token in mirror.items():
        row = np.array(data[token])
        if boost != 1.0 and type_name in ("F16", "F32"):
            row = (row * boost).astype(row.dtype)
        elif boost != 1.0:
            if type_name not in SCALED:
                raise ValueError(f"cannot scale a {type_name} row (supported: {', '.join(SCALED)}, F16, F32)")
            blocks = row.reshape(-1, SCALED[type_name])
            scales = blocks[:, :2].copy().view(np.float16)
            blocks[:, :2] = (scales.astype(np.float32) * boost).astype(np.float16).view(np.uint8)
            row = blocks.reshape(-1)
        extra[pad - n_vocab] = row
    return np.concatenate([np.asarray(data), extra])


def _rewrite(src: Path, dst: Path, fields: dict, rows) -> Path:
    """Copy ``src`` to ``dst`` with the metadata values in ``fields`` replaced and each vocabulary-sized tensor's
    rows replaced by ``rows(name, data, type_name)``."""
    reader = GGUFReader(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(f".tmp{os.getpid()}")
    writer = GGUFWriter(tmp, reader.fields[Keys.General.ARCHITECTURE].contents())
    copy_metadata(reader, writer, fields)
    tensors = []
    for t in reader.tensors:
        data = rows(t.name, t.data, t.tensor_type.name) if t.name in OUTPUT_ROWS else t.data
        tensors.append(data)
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in tensors:
        writer.write_tensor_data(data)
    writer.close()
    tmp.rename(dst)
    return dst


def padded_copy(src: str | Path, dst_dir: str | Path, n_extra: int = 128, mirror: dict[int, int] | None = None,
                boost: float = 1.1) -> Path:
    """Write (once; cached by name) the padded copy of ``src`` into ``dst_dir``; returns its path."""
    src, mirror = Path(src), dict(mirror or {})
    tag = "-".join(f"{p}m{t}" for p, t in sorted(mirror.items())) or "plain"
    dst = Path(dst_dir) / f"{src.stem}-pad{n_extra}-{tag}-b{boost}-v{VERSION}.gguf"
    if dst.exists():
        return dst
    reader = GGUFReader(src)
    n_vocab = len(reader.fields[Keys.Tokenizer.LIST].data)
    if any(not n_vocab <= p < n_vocab + n_extra for p in mirror):
        raise ValueError(f"mirrored ids must be extra ids in [{n_vocab}, {n_vocab + n_extra})")
    f = reader.fields
    fields = {Keys.Tokenizer.LIST: f[Keys.Tokenizer.LIST].contents() + [f"[PAD{i}]" for i in
                                                                          range(n_vocab, n_vocab + n_extra)],
              Keys.Tokenizer.TOKEN_TYPE: f[Keys.Tokenizer.TOKEN_TYPE].contents() + [int(TokenType.UNUSED)] * n_extra}
    if Keys.Tokenizer.SCORES in f:
        fields[Keys.Tokenizer.SCORES] = f[Keys.Tokenizer.SCORES].contents() + [0.0] * n_extra
    names = {t.name for t in reader.tensors}

    def rows(name, data, type_name):
        head = name == "output.weight" or "output.weight" not in names  # the embedding is the head when tied
        return _rows(data, n_extra, mirror, n_vocab, type_name, boost if head else 1.0)
    return _rewrite(src, dst, fields, rows)


def permuted_copy(src: str | Path, dst_dir: str | Path, seed: int = 0) -> Path:
    """Write (once; cached by name) ``src`` with its token ids shuffled; returns its path."""
    src = Path(src)
    dst = Path(dst_dir) / f"{src.stem}-perm{seed}-v{VERSION}.gguf"
    if dst.exists():
        return dst
    f = GGUFReader(src).fields
    n_vocab = len(f[Keys.Tokenizer.LIST].data)
    old_of = np.random.default_rng(seed).permutation(n_vocab)  # new id i is old id old_of[i]
    new_of = np.argsort(old_of)
    fields = {}
    for key in (Keys.Tokenizer.LIST, Keys.Tokenizer.TOKEN_TYPE, Keys.Tokenizer.SCORES):
        if key in f:
            values = f[key].contents()
            fields[key] = [values[o] for o in old_of]
    fields |= {key: int(new_of[f[key].contents()]) for key in f if key.startswith("tokenizer.ggml.")
               and key.endswith("_token_id")}
    return _rewrite(src, dst, fields, lambda name, data, type_name: np.asarray(data)[old_of])

NEWLINE = 198  # "\n" in Qwen2.5's vocabulary


def newline_twin_target(drafter_path: str | Path) -> tuple[Path, int]:
    """The drafter's own model as a target padded to 152,064 ids (Qwen2.5-7B's size), one extra id a louder twin
    of "\n": wherever the model would write a newline, this target commits an id the drafter does not have (and
    renders nothing). Returns its path and that id."""
    twin = len(GGUFReader(drafter_path).fields[Keys.Tokenizer.LIST].data) + 7
    path = padded_copy(drafter_path, CACHE, n_extra=128, mirror={twin: NEWLINE})
    return path, twin
