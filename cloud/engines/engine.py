"""The verifier engine protocol (engines are picked by name in cloud/engines/__init__.py).

An engine owns forward passes and KV caches, nothing else: it never sees protobuf, sessions, sampling or limits.
Per sequence it keeps the invariant "the cache holds every committed token except the last one"; the last
committed token is the root of the next tree and is evaluated together with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from tandem.core.tree import DraftTree


@dataclass(frozen=True)
class TreeJob:
    """One session's share of a verify forward: its sequence, its root (last committed token) and its tree."""
    seq: Any
    root: int
    tree: DraftTree

    @property
    def n_tokens(self) -> int:
        return len(self.tree) + 1


@dataclass(frozen=True)
class PrefillChunk:
    """The next prompt tokens of a sequence being prefilled, computed in a verify forward beside other sessions'
    trees (chunked prefill): they go after the sequence's cached tokens, in order, and no logits come back."""
    seq: Any
    tokens: tuple[int, ...]


class VerifierEngine(Protocol):
    name: str  # engine name as in config, e.g. "llama.cpp"
    model_id: str  # identity of the target model (file name and description)
    vocab_size: int
    n_ctx: int  # tokens per sequence (prompt + generated + one tree)
    max_tree_nodes: int  # most nodes one tree may have on this engine
    max_batch_tokens: int  # most tokens one forward_batch may hold (all sessions' roots + nodes)
    # optional: chat_template, bos_token, eos_token (str) -- the target's conversation format, published in Health

    @property
    def vocab_fingerprint(self) -> str:
        """sha256 over every token's text in id order (``core.vocab``)."""

    def new_sequence(self) -> Any:
        """Allocate the cache of one session; returns an opaque handle."""

    def prefill(self, seq: Any, tokens: Sequence[int], generated: int = 0, partition: str = "") -> int | None:
        """Put ``tokens`` (all committed tokens but the last) into the empty cache of ``seq``; returns how many of
        them an engine with a prefix cache copied from an earlier sequence instead of computing (None or 0
        otherwise). ``generated``: how many of the last ``tokens`` were computed by verify forwards before (a
        resume: the prompt's last token and the earlier output); an engine in deterministic mode computes them as
        verify forwards do. ``partition`` (core.tenancy): the only cache partition ``seq`` may read from, and the
        one its history is kept in when it is released."""

    def forward_tree(self, seq: Any, root_token: int, tree: DraftTree) -> np.ndarray:
        """One forward over the root (last committed token) and every tree node. Returns logits of shape
        ``(len(tree) + 1, vocab)``: row 0 predicts the token after the root, row i + 1 the token after node i.
        The view is valid until the next call on this engine."""

    def forward_batch(self, jobs: Sequence[TreeJob]) -> list[np.ndarray]:
        """``forward_tree`` for several sessions in ONE forward; returns each job's logits in job order."""

    # optional, for chunked prefill: see ``ChunkedPrefillEngine``

    def keep_path(self, seq: Any, tree: DraftTree, path: Sequence[int]) -> None:
        """After ``forward_tree``: keep the root and the nodes of ``path`` (root's child first) in the cache and
        drop every other node."""

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation for this model."""

    def vocab_fingerprint_of(self, n: int) -> str:
        """The vocabulary fingerprint of ids [0, n) alone: a drafter with fewer ids (a target that pads its
        family's vocabulary) is compatible when its own fingerprint equals this."""

    def piece(self, token: int) -> bytes:
        """The bytes ``token`` renders as in generated text (control tokens as nothing)."""

    def release(self, seq: Any) -> None:
        """Free the cache of ``seq``."""


class ChunkedPrefillEngine(VerifierEngine, Protocol):
    """An engine with chunked prefill (``mixed_prefill`` true): the scheduler then computes prompts in its verify
    forwards instead of one prompt per forward between them."""

    @property
    def mixed_prefill(self) -> bool:
        """Whether prompts can be computed in verify forwards now (an engine may turn it off)."""

    def begin_prefill(self, seq: Any, tokens: Sequence[int], generated: int = 0, partition: str = "") -> int:
        """What ``prefill`` does before computing (the partition's cached prefix copied in); returns the tokens
        reused, the rest to come in chunks."""

    def forward_mixed(self, jobs: Sequence[TreeJob], chunks: Sequence[PrefillChunk]) -> list[np.ndarray]:
        """``forward_batch`` with the chunks' tokens computed in the same forward; returns the jobs' logits."""
