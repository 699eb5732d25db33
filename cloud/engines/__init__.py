"""Verifier engines behind ``engine.VerifierEngine``, by name as configured (``tandem serve --engine``; each is
imported only when asked for): llama.cpp (``llama_engine``, batch-invariant with ``deterministic``), PyTorch
(``torch_engine``, batch-invariant with ``torch_invariant``), a scripted rule (``scripted_engine``); a real engine
paced to a cost curve (``pacing``), and which thread may use an engine now (``ownership``)."""
from __future__ import annotations

from typing import Callable

from .engine import VerifierEngine


def _llama(**kw) -> VerifierEngine:
    from .llama_engine import LlamaVerifierEngine
    return LlamaVerifierEngine(**kw)


def _torch(**kw) -> VerifierEngine:
    from .torch_engine import TorchVerifierEngine
    return TorchVerifierEngine(**kw)


def _scripted(**kw) -> VerifierEngine:
    from .scripted_engine import ScriptedEngine
    return ScriptedEngine(**kw)


ENGINES: dict[str, Callable[..., VerifierEngine]] = {"llama.cpp": _llama, "torch": _torch, "scripted": _scripted}
MODEL_FREE = ("scripted",)  # engines that load no model: --target is not resolved (nor fetched) for them


def load_engine(name: str, **kwargs) -> VerifierEngine:
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown verifier engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None
    return factory(**kwargs)
