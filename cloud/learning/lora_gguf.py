"""A LoRA adapter as llama.cpp loads one at run time: a GGUF of ``general.type = adapter``, ``adapter.type =
lora`` and ``adapter.lora.alpha``, holding for each adapted weight ``<base>.weight.lora_a`` ([r, in] in torch's
order, ggml's ne = [in, r]) and ``<base>.weight.lora_b`` ([out, r]), under llama.cpp's tensor names for the
architecture (gguf's own name map). llama.cpp computes ``W x + (alpha / r) * scale * B (A x)`` with them, scale
being the one the loader passes (1 here).

The adapter's identity is its bytes' sha256; ``tandem.adapter.base`` names the drafter it was trained on (the
edge applies it only to that drafter) and ``tandem.adapter.version`` counts the partition's adapters.
"""
from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np

FORMAT = "gguf-lora"
BASE_KEY, VERSION_KEY = "tandem.adapter.base", "tandem.adapter.version"


class AdapterFormatError(ValueError):
    pass


def llama_arch(model_type: str):
    """gguf's ``MODEL_ARCH`` for a transformers ``model_type`` whose llama.cpp architecture has the same name
    (llama, qwen2, qwen3, gemma2, phi3, ...)."""
    import gguf
    by_name = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
    if model_type not in by_name:
        raise AdapterFormatError(f"no llama.cpp architecture named {model_type!r}: its adapters cannot be written")
    return by_name[model_type]


def lora_gguf(lora: Mapping[str, tuple[np.ndarray, np.ndarray]], alpha: float, model_type: str, n_blocks: int,
              base: str, version: int) -> bytes:
    """The adapter file's bytes. ``lora``: Hugging Face module name -> (A [r, in], B [out, r]) (``Distiller.lora``);
    the tensors are written as float16."""
    import gguf
    arch = llama_arch(model_type)
    names = gguf.get_tensor_name_map(arch, n_blocks)
    with tempfile.TemporaryDirectory() as tmp:  # (GGUFWriter writes to a path)
        path = Path(tmp) / "adapter.gguf"
        w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        w.add_string(BASE_KEY, base)
        w.add_uint32(VERSION_KEY, version)
        for module in sorted(lora):
            a, b = lora[module]
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
                raise AdapterFormatError(f"{module}: A {a.shape} and B {b.shape} are not a LoRA pair")
            name = names.get_name(module)
            if name is None:
                raise AdapterFormatError(f"{module} has no llama.cpp tensor name in architecture {model_type}")
            w.add_tensor(f"{name}.weight.lora_a", np.ascontiguousarray(a, dtype=np.float16))
            w.add_tensor(f"{name}.weight.lora_b", np.ascontiguousarray(b, dtype=np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
