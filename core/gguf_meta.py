"""A GGUF file's metadata (its key-value header) as plain Python values, read without the ``gguf`` package.

``gguf.GGUFReader`` maps every element of every array as a numpy view, which takes seconds for a vocabulary of
a few hundred thousand token texts and merges; what a tokenizer conversion needs is those arrays as lists of
strings and numbers, which a sequential read of the header gives in a fraction of that. Tensor descriptions
and data, which follow the header, are not read.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from .errors import TandemError

# GGUF value types (gguf's GGUFValueType): fixed-size scalars by their struct / numpy code
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GgufError(TandemError, ValueError):
    pass


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of the GGUF at ``path`` and its value (arrays as lists)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise GgufError(f"{Path(path).name} is not a GGUF file")
        version, _, n_kv = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):  # (a big-endian file reads as a huge version)
            raise GgufError(f"{Path(path).name}: GGUF version {version} is not one this reader knows (2, 3)")
        reader = _Reader(data, 24)
        out = {}
        for _ in range(n_kv):
            key = reader.string()
            out[key] = reader.value(reader.scalar("I"))
        return out


class _Reader:
    def __init__(self, data: mmap.mmap, at: int):
        self.data, self.at = data, at

    def scalar(self, code: str) -> Any:
        (v,) = struct.unpack_from("<" + code, self.data, self.at)
        self.at += struct.calcsize(code)
        return v

    def string(self) -> str:
        n = self.scalar("Q")
        self.at += n
        return self.data[self.at - n : self.at].decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GgufError(f"unknown GGUF value type {kind}")
        item, n = self.scalar("I"), self.scalar("Q")
        if item in _SCALARS:  # numbers: one read of the whole array
            dtype = np.dtype("<" + _SCALARS[item])
            values = np.frombuffer(self.data, dtype, n, self.at).tolist()
            self.at += dtype.itemsize * n
            return values
        return [self.value(item) for _ in range(n)]
