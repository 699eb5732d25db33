"""llama.cpp drafter: builds draft trees level by level, one ``llama_decode`` per level, and keeps its KV cache
across rounds, rolling back only what the verifier rejected.

Cache layout: seq 0 holds the committed tokens the drafter has evaluated (``n_kv`` of them). Each tree node the
drafter evaluates gets a fresh seq id whose cells are first copied from its parent's seq up to the parent's
position (metadata only, unified cache), so the node attends to exactly the committed prefix and its ancestors.
After a verdict, the deepest accepted node that was evaluated carries the committed prefix plus the accepted path:
that seq becomes seq 0 and everything else is dropped. Accepted nodes that were never evaluated (leaves) and the
bonus token are evaluated at the start of the next draft, together with nothing else.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from cloud.llama_runtime import LlamaContext, LlamaModel, top_k_logprobs
from cloud.tree import DraftTree

from .drafting import BuiltTree, TreeShape, TopK, build_tree

log = logging.getLogger("tandem.edge.drafter")


class LlamaDrafter:
    name = "llama.cpp"

    def __init__(self, model_path: str | Path, n_ctx: int = 4096, max_nodes: int = 64,
                 n_threads: int | None = None, n_batch: int = 512):
        self.model = LlamaModel(model_path)
        self.tokenizer = self.model
        self.n_ctx = min(n_ctx, self.model.n_ctx_train)
        self.max_nodes = max_nodes
        # seq 0 + one seq per evaluated node; a tree evaluates at most k * (d - 1) <= max_nodes nodes
        self._ctx = LlamaContext(self.model, self.n_ctx, n_seq_max=max_nodes + 1, n_batch=n_batch,
                                 n_threads=n_threads)
        self.history: list[int] = []
        self._n_kv = 0
        self._seq_of: dict[int, int] = {}  # candidate index -> seq id, for candidates evaluated this round

    def start(self, prompt: Sequence[int]) -> None:
        self._ctx.clear()
        self.history = list(prompt)
        self._n_kv = 0
        self._seq_of = {}

    def _catch_up(self) -> np.ndarray:
        """Evaluate committed tokens not yet in the cache; returns the drafter's logits after the last one."""
        if self._n_kv >= len(self.history):  # root evaluated, but its logits are gone (discarded draft): redo it
            self._n_kv = len(self.history) - 1
            self._ctx.seq_rm(0, self._n_kv, -1)
        pending = self.history[self._n_kv:]
        logits = self._ctx.prefill(pending, self._n_kv, seq=0, logits_last=True)
        self._n_kv = len(self.history)
        return logits[0]

    def draft(self, shape: TreeShape) -> BuiltTree:
        evaluations = shape.k * (shape.d - 1)  # nodes evaluated per draft, each needing its own seq id
        if evaluations > self.max_nodes:
            raise ValueError(f"tree shape {shape} evaluates up to {evaluations} nodes per draft, over the "
                             f"drafter's max_nodes={self.max_nodes}")
        room = self.n_ctx - len(self.history)  # a depth-d node sits at position len(history) - 1 + d
        if room < 1:  # drafter context full: let the verifier decode plainly (empty trees)
            return BuiltTree(DraftTree(), (), ())
        root = top_k_logprobs(self._catch_up(), shape.k)
        depth = min(shape.d, room)
        self._seq_of = {}
        base = len(self.history) - 1  # position of the root (last committed token)
        depth_of: dict[int, int] = {}

        def expand(nodes: list[int], tokens: Sequence[int], parents: Sequence[int]) -> list[TopK]:
            positions, seq_sets = [], []
            for c in nodes:
                p = parents[c]
                depth_of[c] = 1 if p < 0 else depth_of[p] + 1
                seq = len(self._seq_of) + 1
                self._seq_of[c] = seq
                # the parent's cells up to its position: committed prefix + ancestors of c
                parent_seq, parent_pos = (0, base) if p < 0 else (self._seq_of[p], base + depth_of[p])
                self._ctx.seq_cp(parent_seq, seq, 0, parent_pos + 1)
                positions.append(base + depth_of[c])
                seq_sets.append((seq,))
            logits = self._ctx.decode([tokens[c] for c in nodes], positions, seq_sets, [True] * len(nodes))
            return [top_k_logprobs(row, shape.k) for row in logits]

        return build_tree(root, expand, TreeShape(shape.k, shape.n, depth))

    def commit(self, built: BuiltTree, accepted: Sequence[int], tokens: Sequence[int]) -> None:
        evaluated = [n for n in accepted if built.candidate[n] in self._seq_of]
        # evaluated accepted nodes form a prefix of the accepted path (a node is evaluated only if its parent was)
        keep = self._seq_of[built.candidate[evaluated[-1]]] if evaluated else 0
        if keep:
            self._ctx.seq_keep(keep)
            self._ctx.seq_cp(keep, 0)
            self._ctx.seq_rm(keep)
        else:
            self._ctx.seq_keep(0)
        # after draft() the cache held the whole history (root included); without a draft nothing was added
        self._n_kv += len(evaluated)
        self.history.extend(tokens)
        self._seq_of = {}
