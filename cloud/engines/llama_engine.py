"""llama.cpp verifier engine: draft trees of many sessions in ONE ``llama_decode``, then only accepted paths kept.

All sessions share one context with a unified KV cache; session s owns the seq-id block
``[s * B, (s + 1) * B)`` (B = ``block``), so sessions never see each other's cells. The first id of a block holds the
session's committed prefix. For a tree with leaf branches 0..L-1 we copy the prefix into ids 1..L-1 of the block
(metadata only, the cache is unified), tag every node with the branches through it (``DraftTree.leaf_sets``) and the
root with all of them, and decode every session's root + tree in the same batch. Afterwards each accepted path lies
on one branch b: we cut b after the path, keep b only within the block and move it back to the block's first id.

Prefix cache (``prefix_cache_tokens`` > 0): a few seq ids past the sessions' blocks keep finished sessions'
committed tokens (cloud/caches/prefix_cache.py decides which); a new session's prefill copies the longest cached prefix
of its prompt that its own partition stored (core/tenancy.py) into its block (metadata only) and computes the rest.
The KV of a reused prefix was computed for the same tokens at the same positions, so the only difference from a
fresh prefill is batch-shape rounding, the same near-tie noise any batch shape has.

Deterministic mode (``deterministic=True``): a position's logits are the same bits whatever the batch shape, so
speculative output is bit-identical to this engine's own cloud-only (one token per forward) decoding, with no
near-ties. How (cloud/engines/deterministic.py): no weight repacking, flash attention on, every forward over generated
positions cut into runs of 2..7 tokens (a lone token padded; the prompt goes in fixed chunks), one context per
session so each session's cells stay in position order, tree
tree nodes decoded depth-first with the drafter's first choices first, and an accepted path that left gaps behind
re-decoded into place. Its prefix cache keeps whole prompt chunks only: a prompt's cells are computed in fixed
chunks from position 0, so the cells of a chunk are the same bits in every session whose prompt starts with the
same chunks; they are kept as llama.cpp serializes them and loaded into the next session's own context, and the
rest of its prompt is computed from the chunk boundary, exactly as an uncached prefill would. (Cells a verify
forward computed, a previous turn's answer, were not computed in prompt chunks and are never reused.)

Cell checks: before every forward each session's cells must be exactly its committed positions, each once, and
its branch ids empty (llama.cpp's per-seq position range and the seq's cell count); ``check_cells="full"`` also
reads every cell's position back (a copy of the session's K/V: for tests and debugging).
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np

from .deterministic import (SELF_CHECK_TEXT, InvariantDecoder, MAX_QUERY_TOKENS, NotBatchInvariant, kept_prefix,
                            preorder, self_check)
from .engine import PrefillChunk, TreeJob
from .ownership import Ownership
from ..caches.prefix_cache import PrefixCache
from tandem.core.llama_runtime import LlamaContext, LlamaModel
from tandem.core.tenancy import SHARED
from tandem.core.tree import DraftTree

log = logging.getLogger("tandem.cloud.llama")

MAX_SEQ = 256  # llama.cpp's limit on seq ids in one context
PREFIX_SLOTS = 8  # seq ids kept for cached prefixes (when the cache is on)


PREFILL_CHUNK = 64  # deterministic mode: the least batch of a session's own context, a prompt's fixed chunk size


CHECKS = ("count", "full")
FULL_CHECK_EVERY = 4  # "full": a session's every cell is read back at its first forward and every 4th after (a
# stray cell stays until something removes it, so it is caught within 4 forwards at a quarter of the copying)


class _Seq:
    __slots__ = ("block", "first", "n_past", "tokens", "root", "ctx", "order", "partition", "released", "forwards")

    def __init__(self, block: int, first: int, ctx: LlamaContext):
        self.block = block
        self.first = first  # seq id holding the committed prefix
        self.ctx = ctx  # the context holding its cells (shared, or its own in deterministic mode)
        self.order: list[int] = []  # deterministic mode: the order the last tree's nodes were decoded in
        self.n_past = 0  # tokens in the cache = committed length - 1
        self.tokens: list[int] = []  # those tokens (what the prefix cache keeps when the session ends)
        self.root = -1  # the root of the tree last forwarded
        self.partition = SHARED  # the prefix-cache partition it reads from and is stored into (core.tenancy)
        self.released = False
        self.forwards = 0  # forwards it was in (the full cell check reads its cells every FULL_CHECK_EVERY)


class LlamaVerifierEngine:
    name = "llama.cpp"

    def __init__(self, model_path: str | Path, n_ctx: int = 4096, max_tree_nodes: int = 64,
                 n_threads: int | None = None, n_batch: int = 512, max_sessions: int = 4,
                 prefix_cache_tokens: int = 0, deterministic: bool = False, check_cells: str = "count"):
        """``prefix_cache_tokens``: KV cells kept for finished sessions' histories (0: no prefix cache), reused by
        later sessions whose prompts start the same way (the next turn of a chat). ``deterministic``: logits
        independent of batch shape (see the module docstring); refused for a model where that does not hold.
        ``check_cells``: "count" (every forward, cheap) or "full" (also every cell's position; see above)."""
        if check_cells not in CHECKS:
            raise ValueError(f"check_cells must be one of {CHECKS}, got {check_cells!r}")
        self.deterministic, self.check_cells = deterministic, check_cells
        self._ownership = Ownership("llama.cpp engine")  # one thread at a time inside (cloud/engines/ownership.py)
        self.owned = self._ownership.owned
        self.model = LlamaModel(model_path, repack=not deterministic)
        self.model_id = self.model.identity
        self.chat_template = self.model.chat_template
        self.bos_token, self.eos_token = self.model.special_text("bos"), self.model.special_text("eos")
        self.vocab_size = self.model.n_vocab
        self.n_ctx = min(n_ctx, self.model.n_ctx_train)  # per session
        self.max_sessions = max_sessions
        # every leaf of a tree needs its own seq id inside the session's block, and leaves <= nodes
        spare = PREFIX_SLOTS if prefix_cache_tokens > 0 else 0
        self.block = max(1, min(max_tree_nodes, (MAX_SEQ - spare) // max_sessions))
        self.max_tree_nodes = min(self.block, n_batch - 1)
        self.n_batch = self.max_batch_tokens = n_batch
        # granted limits keep committed + tree depth within n_ctx; a tree's siblings need up to one block more
        first_spare = self.block * max_sessions
        self.prefix_cache = PrefixCache(range(first_spare, first_spare + spare), prefix_cache_tokens) if spare \
            else None
        self._free = list(range(max_sessions))
        self._lock = threading.Lock()
        if deterministic:
            self._init_deterministic(max_tree_nodes, max_sessions, n_threads, prefix_cache_tokens)
            return
        self._ctx = LlamaContext(self.model, (self.n_ctx + self.block) * max_sessions + max(0, prefix_cache_tokens),
                                 n_seq_max=first_spare + spare, n_batch=n_batch, n_threads=n_threads)
        self._ctx.count_cells_from(0, 0)  # (every seq id is empty yet)

    def _init_deterministic(self, max_tree_nodes: int, max_sessions: int, n_threads: int | None,
                            prefix_cache_tokens: int) -> None:
        # a context per session: seq ids 0..block-1 are its tree branches, id `block` the pad of lone tokens
        # (llama.cpp sizes its output buffer for n_seq_max rows, so the batch is at least that many)
        self.block = self.max_tree_nodes = max(1, min(max_tree_nodes, MAX_SEQ - 1))
        chunk = max(PREFILL_CHUNK, self.block + 1)  # a prompt's fixed chunk: the contexts' batch size
        self._ctxs = [LlamaContext(self.model, self.n_ctx + self.block, n_seq_max=self.block + 1,
                                   n_batch=chunk, n_threads=n_threads, flash_attn=True)
                      for _ in range(max_sessions)]
        # cached prompt chunks live as serialized cells, keyed by virtual slots of the same bookkeeping
        self.prefix_cache = PrefixCache(range(PREFIX_SLOTS), prefix_cache_tokens, min_tokens=chunk) \
            if prefix_cache_tokens > 0 else None
        self._states: dict[int, bytes] = {}
        self._decoders = [InvariantDecoder(ctx, pad_seq=self.block) for ctx in self._ctxs]
        for ctx in self._ctxs:
            ctx.count_cells_from(0, 0)
        worst = self_check(self._ctxs[0], self.model.tokenize(SELF_CHECK_TEXT), pad_seq=self.block)
        if worst:
            raise NotBatchInvariant(
                f"{self.model.identity}: logits move by up to {worst:.3g} between forwards of 1..{MAX_QUERY_TOKENS} "
                "tokens with this llama.cpp build on this CPU, so deterministic mode cannot hold; run without it")

    @property
    def vocab_fingerprint(self) -> str:
        return self.model.vocab_fingerprint

    def vocab_fingerprint_of(self, n: int) -> str:
        return self.model.vocab_fingerprint_of(n)

    def piece(self, token: int) -> bytes:
        return self.model.piece(token)

    def tokenizer_file(self) -> tuple[str, Path]:
        """A vocabulary-only GGUF of the target (what an edge with another tokenizer loads to translate its drafts
        into the target's ids), written once per vocabulary into the cache."""
        from tandem.core.vocab import served_vocab_gguf
        return "gguf-vocab", served_vocab_gguf(self.model.path, self.vocab_fingerprint)

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def new_sequence(self) -> _Seq:
        self._ownership.check()
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {self.max_sessions} session slots of this engine are in use")
            block = self._free.pop(0)
        if self.deterministic:
            return _Seq(block, 0, self._ctxs[block])
        return _Seq(block, block * self.block, self._ctx)

    def sequences_in_use(self) -> int:
        """KV blocks held by sequences not yet released (a leak shows here)."""
        with self._lock:
            return self.max_sessions - len(self._free)

    def release(self, seq: _Seq) -> None:
        self._ownership.check()
        if seq.released:  # a second release would clear the cells of whichever session holds the block by now
            raise RuntimeError(f"sequence of block {seq.block} released twice: refusing to clear the cells of the "
                               f"session that may hold the block now")
        seq.released = True
        if self.deterministic:
            seq.ctx.clear()  # its own context: the next session starts at cell 0
        else:
            if self.prefix_cache is not None and seq.n_past:
                slot, dropped = self.prefix_cache.store(seq.tokens[:seq.n_past], seq.partition)
                for s in dropped:
                    self._ctx.seq_rm(s)
                if slot is not None:  # its cells gain the slot's id: they outlive the session's
                    self._ctx.seq_cp(seq.first, slot, 0, seq.n_past)
            for s in range(seq.first, seq.first + self.block):
                self._ctx.seq_rm(s)
        with self._lock:
            self._free.append(seq.block)
        seq.n_past = 0
        seq.tokens = []
        seq.partition = SHARED

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and free its cells (call between batches, as the engine loop's other calls)."""
        self._ownership.check()
        if self.prefix_cache is not None:
            for slot in self.prefix_cache.clear():
                if self.deterministic:
                    self._states.pop(slot, None)
                else:
                    self._ctx.seq_rm(slot)

    def prefill(self, seq: _Seq, tokens: Sequence[int], generated: int = 0, partition: str = SHARED) -> int:
        """Returns how many of ``tokens`` came from ``partition``'s prefix cache instead of being computed."""
        self._ownership.check()
        if seq.n_past:
            raise RuntimeError("prefill needs an empty sequence")
        tokens = list(tokens)
        seq.partition = partition
        progress = None
        if len(tokens) > 4 * self.n_batch:
            progress = lambda done, total: log.info("prefill %d/%d tokens", done, total)  # noqa: E731
        if self.deterministic:
            return self._prefill_invariant(seq, tokens, generated, partition, progress)
        reused = 0
        if self.prefix_cache is not None:
            slot, reused = self.prefix_cache.lookup(tokens, partition)
            if slot is not None:
                self._ctx.seq_cp(slot, seq.first, 0, reused)
        self._ctx.prefill(tokens[reused:], reused, seq=seq.first, progress=progress)
        seq.n_past = len(tokens)
        seq.tokens = tokens
        return reused

    def _prefill_invariant(self, seq: _Seq, tokens: list[int], generated: int, partition: str, progress) -> int:
        """Deterministic mode: the prompt in fixed chunks from position 0 (a prompt is always computed the same
        way, so any fixed chunking is deterministic), whole chunks loaded from the partition's cache where it has
        them, then what verify forwards computed before in batch-invariant runs."""
        split = len(tokens) - min(generated, len(tokens))
        prompt, ctx, chunk = tokens[:split], seq.ctx, seq.ctx.n_batch
        reused = 0
        if self.prefix_cache is not None:
            slot, n = self.prefix_cache.lookup(prompt, partition)
            reused = n // chunk * chunk
            if slot is not None and reused:
                ctx.set_seq_state(0, self._states[slot])  # (its cells in order, from cell 0 of a cleared context)
                ctx.seq_rm(0, reused, -1)
        ctx.prefill(prompt[reused:], reused, seq=0, progress=progress)
        whole = split // chunk * chunk
        if self.prefix_cache is not None and whole > reused:  # chunks this prompt computed: kept for the next
            slot, dropped = self.prefix_cache.store(prompt[:whole], partition)
            for d in dropped:
                self._states.pop(d, None)
            if slot is not None:
                self._states[slot] = ctx.seq_state(0)  # (cells past `whole` too: cut when loaded)
        self._decoders[seq.block].decode(tokens[split:], range(split, len(tokens)), [(0,)] * (len(tokens) - split),
                                         False)
        seq.n_past = len(tokens)
        seq.tokens = tokens
        return reused

    @property
    def mixed_prefill(self) -> bool:
        """Prompts can be computed in verify forwards (chunked prefill); not in deterministic mode, whose prompts
        go in fixed chunks from position 0 in a context of their own."""
        return not self.deterministic

    def begin_prefill(self, seq: _Seq, tokens: Sequence[int], generated: int = 0, partition: str = SHARED) -> int:
        """``prefill`` up to the computing: the partition's cached prefix of ``tokens`` copied in (metadata only);
        returns how many that is. The rest comes in ``forward_mixed`` chunks, in order."""
        self._ownership.check()
        if self.deterministic:
            raise RuntimeError("deterministic mode prefills whole prompts in fixed chunks: use prefill")
        if seq.n_past:
            raise RuntimeError("prefill needs an empty sequence")
        seq.partition, reused = partition, 0
        if self.prefix_cache is not None:
            slot, reused = self.prefix_cache.lookup(list(tokens), partition)
            if slot is not None:
                self._ctx.seq_cp(slot, seq.first, 0, reused)
        seq.n_past, seq.tokens = reused, list(tokens[:reused])
        return reused

    def forward_tree(self, seq: _Seq, root_token: int, tree: DraftTree) -> np.ndarray:
        return self.forward_batch([TreeJob(seq, root_token, tree)])[0]

    def forward_batch(self, jobs: Sequence[TreeJob]) -> list[np.ndarray]:
        self._ownership.check()
        if self.deterministic:
            for job in jobs:  # (a tree with too many leaves is refused by _forward_invariant)
                self._check_cells(job.seq, min(self.block, max(1, len(job.tree.leaves))))
            return [self._forward_invariant(job) for job in jobs]
        return self.forward_mixed(jobs, ())

    def forward_mixed(self, jobs: Sequence[TreeJob], chunks: Sequence[PrefillChunk]) -> list[np.ndarray]:
        """The sessions' trees and other sequences' prompt chunks in ONE ``llama_decode`` (each chunk after its
        sequence's cached tokens, no logits); returns the trees' logits in job order."""
        self._ownership.check()
        if self.deterministic:
            raise RuntimeError("deterministic mode computes one session per forward")
        branches = [max(1, len(job.tree.leaves)) for job in jobs]
        for job, n_branches in zip(jobs, branches):  # every check before any cell changes: a refused batch leaves
            if n_branches > self.block:  # every session as it was; ids past the block belong to another session
                raise ValueError(f"tree has {n_branches} leaves, over this engine's {self.block} seq ids per session")
            self._check_cells(job.seq, n_branches)
        for chunk in chunks:
            self._check_cells(chunk.seq, 1)
        tokens, positions, seq_sets = [], [], []
        for job, n_branches in zip(jobs, branches):
            seq, tree, base = job.seq, job.tree, job.seq.n_past
            seq.root = job.root
            for b in range(1, n_branches):
                self._ctx.seq_cp(seq.first, seq.first + b)
            tokens += [job.root, *tree.tokens]
            positions += [base] + [base + d for d in tree.depths]
            seq_sets += [tuple(range(seq.first, seq.first + n_branches))]
            seq_sets += [tuple(seq.first + b for b in leaves) for leaves in tree.leaf_sets]
        rows = len(tokens)
        for chunk in chunks:
            base = chunk.seq.n_past
            tokens += chunk.tokens
            positions += range(base, base + len(chunk.tokens))
            seq_sets += [(chunk.seq.first,)] * len(chunk.tokens)
        if len(tokens) > self.n_batch:
            raise ValueError(f"{len(tokens)} tokens do not fit one batch of {self.n_batch}")
        logits = self._ctx.decode(tokens, positions, seq_sets, [True] * rows + [False] * (len(tokens) - rows))
        for chunk in chunks:
            chunk.seq.n_past += len(chunk.tokens)
            chunk.seq.tokens += chunk.tokens
        out, row = [], 0
        for job in jobs:
            out.append(logits[row: row + len(job.tree) + 1])
            row += len(job.tree) + 1
        return out

    def _check_cells(self, seq: _Seq, n_branches: int) -> None:
        """The session's cells are exactly its committed positions 0..n_past-1, each once, and its branch ids are
        empty, or the forward would attend to the wrong tokens and commit a wrong one silently: the position range
        and the number of cells of its first id (a stray cell, or a hole, changes one or the other unless a hole
        and a duplicate meet), and in "full" mode every cell's position. A violation is a bug (of the engine's
        bookkeeping, or a second thread using this context): the forward fails loudly instead."""
        ctx = seq.ctx
        lo, hi = ctx.seq_pos_min(seq.first), ctx.seq_pos_max(seq.first)  # both -1 for an empty seq id
        count = ctx.seq_cell_count(seq.first)
        stray = next((b for b in range(seq.first + 1, seq.first + n_branches) if ctx.seq_pos_max(b) >= 0), None)
        if (lo, hi) != ((0, seq.n_past - 1) if seq.n_past else (-1, -1)) or count != seq.n_past or stray is not None:
            raise RuntimeError(f"KV cells of the session in seq block {seq.block} are inconsistent (positions "
                               f"{lo}..{hi} in {count} cells for {seq.n_past} committed, stray branch {stray}): "
                               f"refusing to verify")
        seq.forwards += 1
        if self.check_cells == "full" and seq.forwards % FULL_CHECK_EVERY == 1:
            positions = sorted(pos for pos, _ in ctx.cells(seq.first))
            if positions != list(range(seq.n_past)):
                missing = sorted(set(range(seq.n_past)) - set(positions))[:8]
                extra = sorted(p for p, n in Counter(positions).items() if n > 1 or not 0 <= p < seq.n_past)[:8]
                raise RuntimeError(f"KV cells of the session in seq block {seq.block} are inconsistent (positions "
                                   f"missing {missing}, doubled or out of range {extra}): refusing to verify")

    def _forward_invariant(self, job: TreeJob) -> np.ndarray:
        """One session's root + tree in its own context, nodes depth-first, in batch-invariant forwards."""
        seq, tree, base = job.seq, job.tree, job.seq.n_past
        seq.root = job.root
        n_branches = max(1, len(tree.leaves))
        if n_branches > self.block:
            raise ValueError(f"tree has {n_branches} leaves, over this engine's {self.block} seq ids per session")
        for b in range(1, n_branches):
            seq.ctx.seq_cp(0, b)
        seq.order = order = preorder(tree)
        tokens = [job.root] + [tree.tokens[i] for i in order]
        positions = [base] + [base + tree.depths[i] for i in order]
        seq_sets = [tuple(range(n_branches))] + [tree.leaf_sets[i] for i in order]
        rows = self._decoders[seq.block].decode(tokens, positions, seq_sets, True)
        out = np.empty_like(rows)
        out[0] = rows[0]
        out[[1 + i for i in order]] = rows[1:]
        return out

    def keep_path(self, seq: _Seq, tree: DraftTree, path: Sequence[int]) -> None:
        self._ownership.check()
        ctx, base = seq.ctx, seq.n_past
        branch = seq.first + (tree.leaf_sets[path[-1]][0] if path else 0)
        # deterministic mode keeps only the path's nodes that sit right after the root and re-decodes the rest
        # after them, so the session's cells stay in position order
        kept = kept_prefix(seq.order, path) if self.deterministic else len(path)
        ctx.seq_rm(branch, base + 1 + kept, -1)  # nodes of this branch below the kept part of the path
        for s in range(seq.first, seq.first + max(1, len(tree.leaves))):  # the other branches of this block
            if s != branch:
                ctx.seq_rm(s)
        if branch != seq.first:
            ctx.seq_cp(branch, seq.first)
            ctx.seq_rm(branch)
        if kept < len(path):
            rest = [tree.tokens[i] for i in path[kept:]]
            self._decoders[seq.block].decode(rest, range(base + 1 + kept, base + 1 + len(path)),
                                             [(seq.first,)] * len(rest), False)
        seq.n_past = base + 1 + len(path)
        seq.tokens += [seq.root, *(tree.tokens[i] for i in path)]
