"""The drafter protocol (what the edge client needs from a draft engine) and the registry picking one by name.

The drafter mirrors the committed history of a session: ``start`` with the prompt, ``draft`` a tree below the
last committed token, ``commit`` the verdict (accepted nodes of that tree + the committed tokens) so the drafter
can roll its cache back to the committed path instead of recomputing it. ``commit`` with no tree and no nodes just
appends committed tokens (evaluated at the next ``catch_up``). Only the round loop's drafter thread calls these.

Optional: ``speculate(built, path, shape)`` / ``adopt()`` draft the next tree while a verdict is in flight.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

from tandem.core.tree import TreeShape

from .drafting import BuiltTree


class Tokenizer(Protocol):
    n_vocab: int

    @property
    def vocab_fingerprint(self) -> str: ...

    def tokenize(self, text: str, special: bool = True) -> list[int]: ...

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes ``token`` renders as; ``special``: control tokens spelled out (else as nothing)."""

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends a generation (EOS, end of turn)."""

    def chat_prompt(self, messages: Sequence[dict]) -> str: ...


class Drafter(Protocol):
    name: str
    n_ctx: int

    @property
    def tokenizer(self) -> Tokenizer: ...

    def start(self, prompt: Sequence[int]) -> None:
        """Begin a session on ``prompt`` (committed history = prompt). A drafter may keep the cells of the last
        session's history that ``prompt`` starts with; ``start([])`` forgets every kept cell."""

    def pending(self) -> int:
        """Committed tokens the drafter has not evaluated yet."""

    def catch_up(self) -> None:
        """Evaluate committed tokens not yet in the drafter's cache (the prompt, or a run the verifier decoded
        alone), so that the next ``draft`` costs only its tree. ``draft`` does it itself when not called."""

    def draft(self, shape: TreeShape) -> BuiltTree:
        """A tree below the last committed token, at most ``shape`` in size."""

    def commit(self, built: BuiltTree, accepted: Sequence[int], tokens: Sequence[int]) -> None:
        """The verifier accepted tree nodes ``accepted`` of ``built`` and committed ``tokens`` (accepted + bonus)."""


class SpeculativeDrafter(Drafter, Protocol):
    """A drafter that drafts the next tree while a verdict is in flight (the round loop's ``speculate``)."""

    def speculate(self, built: BuiltTree, path: Sequence[int], shape: TreeShape) -> BuiltTree | None:
        """While ``built`` is being verified, the next tree, drafted assuming the verifier accepts its nodes
        ``path``; None when the drafter cannot."""

    def adopt(self) -> BuiltTree:
        """The guess held: the history grows by the path, and the speculative tree becomes the tree in flight."""


def _llama(**kw) -> Drafter:
    from .llama_drafter import LlamaDrafter
    return LlamaDrafter(**kw)


def _onnx(model_path, n_ctx: int = 4096, n_threads: int | None = None, vocab: str | None = None,
          quant: str = "int4", learn_vocab: bool = True, **kw) -> Drafter:
    """ONNX Runtime drafter for a GGUF (exported once through transformers, then cached); ``vocab``: a VocabTrim
    head vocabulary (.npy of sorted ids) to score instead of the full vocabulary, kept current with the traffic
    served unless ``learn_vocab`` is False (``vocabtrim.LiveVocab``, ranked from the calibration counts saved beside
    the vocabulary when there are some)."""
    from collections import Counter

    from . import vocabtrim
    from .onnx_drafter import OnnxDrafter
    from .export.onnx_export import export
    model_dir = export(model_path, quant)
    ids = None
    if vocab:
        import json
        ids = vocabtrim.load(vocab, json.loads((model_dir / "meta.json").read_text())["vocab_size"])
    d = OnnxDrafter(model_dir, tokenizer_gguf=model_path, n_ctx=n_ctx, n_threads=n_threads, vocab_ids=ids, **kw)
    if vocab and ids is not None and learn_vocab:  # (ids come with a vocab)
        tok = d.tokenizer
        counts = vocabtrim.load_counts(vocab) or Counter(dict.fromkeys(ids.tolist(), 1))
        d.learn(vocabtrim.LiveVocab(counts, ids, always=[t for t in range(tok.n_vocab) if tok.is_eog(t)],
                                    n_vocab=tok.n_vocab))
    return d


def _auto(model_path, vocab: str | None = None, **kw) -> Drafter:
    """ONNX Runtime where the drafter exports without torch (a Qwen2 GGUF, the default drafter) or is exported
    already, and onnxruntime is installed (the onnx extra): it drafts faster than llama.cpp on the CPUs measured
    (``bench.drafter``, bench/results/2026-12-05/onnx-export/); llama.cpp otherwise. A VocabTrim head (``vocab``)
    needs ONNX Runtime."""
    try:
        from .export.onnx_export import exports_without_torch
        onnx = exports_without_torch(model_path)
    except ImportError:  # the onnx extra is not installed
        onnx = False
    if onnx:
        return _onnx(model_path, vocab=vocab, **kw)
    if vocab:
        raise ValueError("a VocabTrim head vocabulary needs the ONNX drafter (the onnx extra, and a Qwen2 GGUF or "
                         "the torch extra to export it)")
    return _llama(model_path=model_path, **kw)


DRAFTERS: dict[str, Callable[..., Drafter]] = {"auto": _auto, "llama.cpp": _llama, "onnx": _onnx}


def load_drafter(name: str, warm: bool = True, **kwargs) -> Drafter:
    """The drafter engine ``name`` built from ``kwargs``; ``warm``: draft once on a short text before returning."""
    try:
        factory = DRAFTERS[name]
    except KeyError:
        raise ValueError(f"unknown drafter engine {name!r}; known: {', '.join(sorted(DRAFTERS))}") from None
    drafter = factory(**kwargs)
    if warm:
        warm_up(drafter)
    return drafter


WARM_TEXT = "def add(a, b):\n    return a + b\n"


def warm_up(drafter: Drafter) -> None:
    """One small draft, then an empty history: at load, not in the first request. The first draft of a fresh
    engine costs 4x a warm one (236 against 57 ms for a chain of 4, ONNX int4 on 2 cores: the runtime's arenas
    and kernels are set up on first use), and the policy's first phase timed the verifier beside it: on shared
    cores it priced cloud-only decoding at 10 tokens/s where it runs at 25-30, for the client's life."""
    prompt = drafter.tokenizer.tokenize(WARM_TEXT, special=False)
    if prompt:
        drafter.start(prompt)
        drafter.draft(TreeShape(1, 2, 2))
    drafter.start([])
