"""Model ids: the short name a model is served and measured under, from a verifier's identity string."""

from __future__ import annotations

import hashlib
from pathlib import Path


def model_slug(target_model: str) -> str:
    """A model id from the verifier's identity ("name.gguf (description)" or "name (arch, dtype)"): the name,
    lower-case, without the directory or the file extension."""
    name = target_model.split(" (")[0].strip().rsplit("/", 1)[-1]
    for ext in (".gguf", ".bin", ".safetensors"):
        if name.lower().endswith(ext):
            name = name[: -len(ext)]
    return name.lower() or "tandem"


_digests: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | Path) -> str:
    """The file's sha256 (hex), remembered per path, size and mtime: a model's identity by content, for what is
    made for one model only (a drafter's adapters)."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _digests:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _digests[key] = h.hexdigest()
    return _digests[key]


def transformers_source(path: str | Path) -> tuple[str, dict]:
    """What ``from_pretrained`` takes for a model at ``path``: (directory, extra keyword arguments) for a GGUF file
    (transformers' GGUF loader) or a Hugging Face directory; ``ValueError`` for anything else."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), {"gguf_file": p.name}
    if p.is_dir() and (p / "config.json").is_file():
        return str(p), {}
    raise ValueError(f"{p} is neither a GGUF file nor a Hugging Face model directory (with config.json)")
