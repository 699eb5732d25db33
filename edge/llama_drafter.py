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
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from tandem.core.llama_runtime import LlamaContext, LlamaModel, LoraAdapter, top_k_logprobs
from tandem.core.model_id import file_sha256
from tandem.core.tree import DraftTree, TreeShape, common_prefix

from .drafting import BuiltTree, TopK, build_tree

log = logging.getLogger("tandem.edge.drafter")


@dataclass
class _Speculation:
    path: list[int]  # node indices of the tree in flight assumed accepted
    tokens: list[int]  # their tokens
    built: BuiltTree  # the tree drafted on history + tokens
    seq_of: dict[int, int]  # its candidates -> seq ids
    root_seq: int  # seq holding history + path
    id_range: int
    n_cached: int  # cells in root_seq = len(history) + len(tokens)


class LlamaDrafter:
    name = "llama.cpp"

    def __init__(self, model_path: str | Path, n_ctx: int = 4096, max_nodes: int = 64,
                 n_threads: int | None = None, n_batch: int = 512):
        self.model = LlamaModel(model_path)
        self.tokenizer = self.model
        self.n_ctx = min(n_ctx, self.model.n_ctx_train)
        self.max_nodes = max_nodes
        # seq 0 + two ranges of (1 + max_nodes) ids: the tree in flight, and the speculative next tree (its root
        # seq + one seq per evaluated node; a tree evaluates at most k * (d - 1) <= max_nodes nodes). Positions are
        # capped at n_ctx; cells also hold both trees' evaluated nodes (and the guessed path), so they get room.
        self._ctx = LlamaContext(self.model, self.n_ctx + 2 * (max_nodes + 1) + 32,
                                 n_seq_max=1 + 2 * (max_nodes + 1), n_batch=n_batch, n_threads=n_threads)
        self.history: list[int] = []
        self._n_kv = 0
        self._seq_of: dict[int, int] = {}  # candidate index -> seq id, for candidates evaluated this round
        self._range = 0  # id range of the tree in flight
        self._spec: _Speculation | None = None
        self._root_logits: np.ndarray | None = None  # drafter logits after the whole history, from catch_up()
        self._lora: LoraAdapter | None = None  # the LoRA adapter drafts are computed with (set_adapter)

    @property
    def base_sha256(self) -> str:
        """The model file's sha256: what an adapter names as the drafter it was trained on."""
        return file_sha256(self.model.path)

    def set_adapter(self, path: str | Path | None) -> None:
        """Draft with the LoRA adapter file at ``path`` from now on (None: the base weights alone). Between
        generations only: every kept cell was computed with the weights before, so all of them go. A file that
        does not fit the model is refused (``LlamaError``) and changes nothing."""
        new = LoraAdapter(self.model, path) if path is not None else None
        try:
            self._ctx.set_lora(new)
        except BaseException:
            if new is not None:
                new.close()
            raise
        if self._lora is not None:
            self._lora.close()
        self._lora = new
        self._ctx.clear()
        self._n_kv = 0
        self._seq_of, self._spec, self._root_logits = {}, None, None

    def _first_id(self, id_range: int) -> int:
        return 1 + id_range * (self.max_nodes + 1)

    def start(self, prompt: Sequence[int]) -> None:
        """A new session on ``prompt``. The cells of the previous session's evaluated history that ``prompt``
        starts with stay (the next turn of a chat re-evaluates only its new tokens); everything else goes."""
        keep = common_prefix(self.history[:self._n_kv], prompt)
        for seq in range(1, self._ctx.n_seq_max):  # trees and speculations of the previous session
            self._ctx.seq_rm(seq)
        self._ctx.seq_rm(0, keep, -1)
        self.history = list(prompt)
        self._n_kv = keep
        self._seq_of = {}
        self._spec = None
        self._root_logits = None

    def pending(self) -> int:
        return len(self.history) - self._n_kv

    def catch_up(self) -> None:
        self._discard_speculation()
        if 0 < len(self.history) < self.n_ctx:  # past the context (or before any token) nothing to draft on
            self._root_logits = self._catch_up()

    def _catch_up(self) -> np.ndarray:
        """Evaluate committed tokens not yet in the cache; returns the drafter's logits after the last one."""
        logits, self._root_logits = self._root_logits, None
        if logits is not None and self._n_kv == len(self.history):
            return logits
        if self._n_kv >= len(self.history):  # root evaluated, but its logits are gone (discarded draft): redo it
            self._n_kv = len(self.history) - 1
            self._ctx.seq_rm(0, self._n_kv, -1)
        pending = self.history[self._n_kv:]
        logits = self._ctx.prefill(pending, self._n_kv, seq=0, logits_last=True)
        self._n_kv = len(self.history)
        return logits[0]

    def _check(self, shape: TreeShape) -> None:
        evaluations = shape.k * (shape.d - 1)  # nodes evaluated per draft, each needing its own seq id
        if evaluations > self.max_nodes:
            raise ValueError(f"tree shape {shape} evaluates up to {evaluations} nodes per draft, over the "
                             f"drafter's max_nodes={self.max_nodes}")

    def _grow(self, shape: TreeShape, root_seq: int, base: int, root_logits: np.ndarray,
              first_id: int) -> tuple[BuiltTree, dict[int, int]]:
        """Build a tree below a root at position ``base`` whose context is in ``root_seq``; every evaluated node
        gets a fresh seq id from ``first_id`` on, holding the root's context plus its ancestors."""
        seq_of: dict[int, int] = {}
        depth_of: dict[int, int] = {}

        def expand(nodes: list[int], tokens: Sequence[int], parents: Sequence[int]) -> list[TopK]:
            positions, seq_sets = [], []
            for c in nodes:
                p = parents[c]
                depth_of[c] = 1 if p < 0 else depth_of[p] + 1
                seq = first_id + len(seq_of)
                seq_of[c] = seq
                # the parent's cells up to its position: committed prefix + ancestors of c
                parent_seq, parent_pos = (root_seq, base) if p < 0 else (seq_of[p], base + depth_of[p])
                self._ctx.seq_cp(parent_seq, seq, 0, parent_pos + 1)
                positions.append(base + depth_of[c])
                seq_sets.append((seq,))
            logits = self._ctx.decode([tokens[c] for c in nodes], positions, seq_sets, [True] * len(nodes))
            return [top_k_logprobs(row, shape.k) for row in logits]

        return build_tree(top_k_logprobs(root_logits, shape.k), expand, shape), seq_of

    def draft(self, shape: TreeShape) -> BuiltTree:
        self._check(shape)
        self._discard_speculation()
        room = self.n_ctx - len(self.history)  # a depth-d node sits at position len(history) - 1 + d
        if room < 1:  # drafter context full: let the verifier decode plainly (empty trees); checked before any
            return BuiltTree(DraftTree(), (), (), full=True)  # catch-up, which would not fit either
        logits = self._catch_up()
        self._range = 0
        built, self._seq_of = self._grow(TreeShape(shape.k, shape.n, min(shape.d, room)), 0,
                                         len(self.history) - 1, logits, self._first_id(0) + 1)
        return built

    def commit(self, built: BuiltTree, accepted: Sequence[int], tokens: Sequence[int]) -> None:
        self._discard_speculation()
        self._root_logits = None
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

    # -- proactive drafting -----------------------------------------------------------------------------------------
    def speculate(self, built: BuiltTree, path: Sequence[int], shape: TreeShape) -> BuiltTree | None:
        """While ``built`` is being verified: draft the next tree now, assuming the verifier accepts ``path``
        (node indices of ``built``, root's child first). Uses the other seq-id range, so the tree in flight is
        untouched; ``adopt`` makes the guess real, ``commit``/``draft`` discard it."""
        self._check(shape)
        self._discard_speculation()
        tokens = [built.tree.tokens[i] for i in path]
        room = self.n_ctx - len(self.history) - len(tokens)
        if not path or room < 1 or self._n_kv != len(self.history):
            return None
        evaluated = [n for n in path if built.candidate[n] in self._seq_of]
        src = self._seq_of[built.candidate[evaluated[-1]]] if evaluated else 0
        r = 1 - self._range
        root_seq = self._first_id(r)
        n_cached = len(self.history) + len(evaluated)
        if len(evaluated) == len(path):  # the path's last node was evaluated, its logits are gone: redo it
            n_cached -= 1
        self._ctx.seq_cp(src, root_seq, 0, n_cached)
        pending = tokens[n_cached - len(self.history):]
        logits = self._ctx.decode(pending, range(n_cached, n_cached + len(pending)), [(root_seq,)] * len(pending),
                                  [False] * (len(pending) - 1) + [True])
        spec, seq_of = self._grow(TreeShape(shape.k, shape.n, min(shape.d, room)), root_seq,
                                  len(self.history) + len(tokens) - 1, logits[0], root_seq + 1)
        self._spec = _Speculation(list(path), tokens, spec, seq_of, root_seq, r, len(self.history) + len(tokens))
        return spec

    def adopt(self) -> BuiltTree:
        """The verifier accepted the speculated path: history grows by it and the speculative tree becomes the tree
        in flight (commit its verdict against it). Returns that tree."""
        s = self._spec
        if s is None:
            raise RuntimeError("no speculation to adopt")
        for seq in self._seq_of.values():  # the old tree; its path cells survive in the speculative root seq
            self._ctx.seq_rm(seq)
        self._ctx.seq_cp(s.root_seq, 0)
        self._ctx.seq_rm(s.root_seq)
        self.history.extend(s.tokens)
        self._n_kv = s.n_cached
        self._seq_of, self._range, self._spec = s.seq_of, s.id_range, None
        return s.built

    def _discard_speculation(self) -> None:
        if self._spec is not None:
            for seq in (self._spec.root_seq, *self._spec.seq_of.values()):
                self._ctx.seq_rm(seq)
            self._spec = None
