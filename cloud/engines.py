"""Verifier engines by name, as configured (``tandem serve --engine``); each is imported only when asked for."""
from __future__ import annotations

from typing import Callable

from .engine import VerifierEngine


def _llama(**kw) -> VerifierEngine:
    from .llama_engine import LlamaVerifierEngine
    return LlamaVerifierEngine(**kw)


def _torch(**kw) -> VerifierEngine:
    from .torch_engine import TorchVerifierEngine
    return TorchVerifierEngine(**kw)


ENGINES: dict[str, Callable[..., VerifierEngine]] = {"llama.cpp": _llama, "torch": _torch}


def load_engine(name: str, **kwargs) -> VerifierEngine:
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown verifier engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None
    return factory(**kwargs)
