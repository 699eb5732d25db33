"""A verifier engine whose target is a rule, not a model: ``tandem serve --engine scripted``.

For client implementers in any language (``docs/protocol.md``): a real verifier (the same servicer, scheduler,
acceptance and sampling as with a model) that starts at once, needs no weights and answers predictably, so a
client's round loop can be tested against it before any drafter exists. The target's greedy next token after t
is ``t + 1`` (counting up to the end-of-generation token ``EOS``, then ``EOS`` again): a drafter that counts up
has every node accepted, one that does not sees exactly where it went wrong. Token t reads as the text
``"<t> "`` (``EOS`` as nothing). Each logits row puts ``LOGIT`` on the rule's token and 0 elsewhere, so sampling
at temperature 1 picks it with probability e^10 / (e^10 + V - 1), about 0.989 for V = 256.

Tests of the server's own logic use it with other rules and sizes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from tandem.core.tree import DraftTree
from tandem.core.vocab import fingerprint

from .engine import PrefillChunk, TreeJob

LOGIT = 10.0


class ScriptedEngine:
    """The target ``nxt`` (default: count up) over ``vocab_size`` ids, the last of them the end of generation."""

    name = "scripted"

    def __init__(self, nxt: Callable[[int], int] | None = None, vocab_size: int = 256, n_ctx: int = 4096,
                 max_tree_nodes: int = 64, max_batch_tokens: int = 512, model_id: str = "scripted-count-up",
                 **_ignored: Any):
        """``_ignored``: what ``tandem serve`` passes every engine (model path, threads, caches): a rule has none."""
        self.vocab_size, self.eos = vocab_size, vocab_size - 1
        self.nxt = nxt or (lambda t: min(t + 1, self.eos))
        self.n_ctx, self.max_tree_nodes, self.max_batch_tokens = n_ctx, max_tree_nodes, max_batch_tokens
        self.model_id = model_id
        self.vocab_fingerprint = self.vocab_fingerprint_of(vocab_size)
        self.released = 0
        self.batches: list[int] = []  # sessions per forward_batch call

    def piece(self, token: int) -> bytes:
        return b"" if token == self.eos else b"%d " % token

    def vocab_fingerprint_of(self, n: int) -> str:
        return fingerprint(self.piece(t) for t in range(n))

    def new_sequence(self) -> dict:
        return {"cache": []}

    def prefill(self, seq: dict, tokens: Sequence[int], generated: int = 0, partition: str = "") -> int | None:
        seq["cache"] = list(tokens)
        return None  # nothing reused (a subclass with a prefix cache says how much)

    mixed_prefill = True

    def begin_prefill(self, seq: dict, tokens: Sequence[int], generated: int = 0, partition: str = "") -> int:
        """A rule needs no cache: ``prefill`` takes the prompt at once (what it reports reused, a subclass's
        prefix cache, is not sent again); the chunks that follow only cost a paced engine their time."""
        return self.prefill(seq, tokens, generated, partition) or 0

    def forward_mixed(self, jobs: Sequence[TreeJob], chunks: Sequence[PrefillChunk]) -> list[np.ndarray]:
        return self.forward_batch(jobs) if jobs else []

    def forward_batch(self, jobs: Sequence[TreeJob]) -> list[np.ndarray]:
        if sum(j.n_tokens for j in jobs) > self.max_batch_tokens:  # what llama.cpp does past n_batch
            raise ValueError(f"{sum(j.n_tokens for j in jobs)} tokens do not fit one batch")
        self.batches.append(len(jobs))
        return [self.forward_tree(j.seq, j.root, j.tree) for j in jobs]

    def forward_tree(self, seq: dict, root_token: int, tree: DraftTree) -> np.ndarray:
        rows = np.zeros((len(tree) + 1, self.vocab_size), dtype=np.float32)
        for r, token in enumerate((root_token, *tree.tokens)):
            rows[r, self.nxt(token)] = LOGIT
        seq["pending"] = (root_token, tree)
        return rows

    def keep_path(self, seq: dict, tree: DraftTree, path: Sequence[int]) -> None:
        root, _ = seq.pop("pending")
        seq["cache"] += [root] + [tree.tokens[i] for i in path]

    def is_eog(self, token: int) -> bool:
        return token == self.eos

    def release(self, seq: dict) -> None:
        self.released += 1
