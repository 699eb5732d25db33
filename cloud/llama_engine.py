"""llama.cpp verifier engine: a whole draft tree in ONE ``llama_decode``, then only the accepted path kept.

Each session gets its own context (isolation; the model weights are shared), so sessions never see each other's
cache. Within a context, seq 0 holds the committed prefix. For a tree with leaf branches 0..L-1 we copy seq 0
into seqs 1..L-1 (metadata only, the cache is unified), tag every node with the branches through it
(``DraftTree.leaf_sets``) and the root with all of them, and decode. Afterwards the accepted path lies on one
branch b: we cut b after the path, ``seq_keep(b)`` and move b back to seq 0.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from .llama_runtime import LlamaContext, LlamaModel
from .tree import DraftTree

log = logging.getLogger("tandem.cloud.llama")


class _Seq:
    __slots__ = ("ctx", "n_past")

    def __init__(self, ctx: LlamaContext):
        self.ctx = ctx
        self.n_past = 0  # tokens in the cache = committed length - 1


class LlamaVerifierEngine:
    name = "llama.cpp"

    def __init__(self, model_path: str | Path, n_ctx: int = 4096, max_tree_nodes: int = 64,
                 n_threads: int | None = None, n_batch: int = 512):
        self.model = LlamaModel(model_path)
        self.model_id = self.model.identity
        self.vocab_size = self.model.n_vocab
        self.n_ctx = min(n_ctx, self.model.n_ctx_train)
        # the root + all nodes go into one batch, and every leaf needs its own seq id
        self.max_tree_nodes = min(max_tree_nodes, n_batch - 1, 255)
        self.n_threads = n_threads
        self.n_batch = n_batch

    @property
    def vocab_fingerprint(self) -> str:
        return self.model.vocab_fingerprint

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def new_sequence(self) -> _Seq:
        return _Seq(LlamaContext(self.model, self.n_ctx, n_seq_max=max(1, self.max_tree_nodes),
                                 n_batch=self.n_batch, n_threads=self.n_threads))

    def prefill(self, seq: _Seq, tokens: Sequence[int]) -> None:
        if seq.n_past:
            raise RuntimeError("prefill needs an empty sequence")
        progress = None
        if len(tokens) > 4 * self.n_batch:
            progress = lambda done, total: log.info("prefill %d/%d tokens", done, total)  # noqa: E731
        seq.ctx.prefill(list(tokens), 0, progress=progress)
        seq.n_past = len(tokens)

    def forward_tree(self, seq: _Seq, root_token: int, tree: DraftTree) -> np.ndarray:
        ctx, base = seq.ctx, seq.n_past
        n_branches = max(1, len(tree.leaves))
        for b in range(1, n_branches):
            ctx.seq_cp(0, b)
        tokens = [root_token, *tree.tokens]
        positions = [base] + [base + d for d in tree.depths]
        seq_sets = [tuple(range(n_branches))] + list(tree.leaf_sets)
        return ctx.decode(tokens, positions, seq_sets, [True] * len(tokens))

    def keep_path(self, seq: _Seq, tree: DraftTree, path: Sequence[int]) -> None:
        ctx, base = seq.ctx, seq.n_past
        branch = tree.leaf_sets[path[-1]][0] if path else 0
        ctx.seq_rm(branch, base + 1 + len(path), -1)  # nodes of this branch below the accepted path
        ctx.seq_keep(branch)  # every other branch; survivors now carry only this id
        if branch != 0:
            ctx.seq_cp(branch, 0)
            ctx.seq_rm(branch)
        seq.n_past = base + 1 + len(path)

    def release(self, seq: _Seq) -> None:
        seq.ctx.close()
