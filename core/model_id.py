"""Model ids: the short name a model is served and measured under, from a verifier's identity string."""

from __future__ import annotations


def model_slug(target_model: str) -> str:
    """A model id from the verifier's identity ("name.gguf (description)" or "name (arch, dtype)"): the name,
    lower-case, without the directory or the file extension."""
    name = target_model.split(" (")[0].strip().rsplit("/", 1)[-1]
    for ext in (".gguf", ".bin", ".safetensors"):
        if name.lower().endswith(ext):
            name = name[: -len(ext)]
    return name.lower() or "tandem"
