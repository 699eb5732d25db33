"""Batch-invariant decoding on llama.cpp's CPU backend: the logits of a position do not depend on batch shape.

Why the default engine is not: ggml picks its kernels by shape. Measured on the pinned pair (Qwen2.5-Coder, Q4_K_M;
llama-cpp-python 0.3.36, AVX2 and AVX-512 variants, 1..4 threads), per-position logits are bit-identical across
forwards of 2..7 query tokens with flash attention on and weight repacking off, and differ (by up to ~0.6 in a
logit) in every other case:
- 1 query token with >= 512 cached cells takes flash attention's split-KV path (the cells are cut into one chunk
  per thread and the partial softmaxes merged), so one-token decoding rounds differently from any batch;
- 8 or more query tokens round differently again (64 or more also take the tiled attention path);
- repacked weights (``use_extra_bufts``) switch between a gemv and a gemm kernel at 4 columns;
- without flash attention, the softmax and the V product are SIMD reductions over all cells, masked ones included,
  so where a token's cells sit in the cache changes the lanes its values are summed in.
Flash attention's one-query kernel walks the cells in cache order and skips masked ones with an online softmax:
its result depends on the order of the visible cells, never on gaps between them. So a position's logits are the
same bits whatever the batch, provided (a) every forward over generated positions holds 2..``MAX_QUERY_TOKENS``
tokens (a lone token gets a throw-away companion in a seq id nobody attends to), and (b) each sequence's cells sit
in position order (a context of its own per session, and the accepted path re-placed after its cells when a tree
left gaps). A prompt needs neither: it is always prefilled the same way (fixed chunks from position 0), so its
cells are the same bits in every run; only positions that speculation and cloud-only decoding compute in different
batches (the prompt's last token onwards, including a resume's earlier output) go through the invariant runs.

``self_check`` measures (a) for a given model and build at start-up, so a model or CPU where the bound does not
hold is refused instead of silently rounding differently.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from tandem.core.llama_runtime import LlamaContext
from tandem.core.tree import DraftTree

MAX_QUERY_TOKENS = 7  # the largest forward measured to round like every smaller one (see above)
SELF_CHECK_TEXT = "def fib(n):\n    return n if n < 2 else fib(n - 1)"  # ~16 tokens: every run size occurs


class NotBatchInvariant(RuntimeError):
    """This model and llama.cpp build give different logits for one position in different batch shapes."""


def pieces(n: int, cap: int = MAX_QUERY_TOKENS) -> list[tuple[int, int]]:
    """Split ``n`` tokens into the fewest consecutive runs of at most ``cap``, as even as possible, so that no run
    has a single token unless ``n`` is 1 (a lone token needs a pad, and a pad's freed cell in the middle of a
    sequence would later be filled out of position order)."""
    if n <= 0:
        return []
    k = -(-n // cap)
    size, extra = divmod(n, k)
    out, lo = [], 0
    for i in range(k):
        hi = lo + size + (i < extra)
        out.append((lo, hi))
        lo = hi
    return out


def kept_prefix(order: Sequence[int], path: Sequence[int]) -> int:
    """How many nodes of an accepted ``path`` lie in the first cells after the root when a tree's nodes were
    decoded in ``order``: those cells are already in position order and stay; the rest of the path is re-placed."""
    k = 0
    while k < len(path) and k < len(order) and order[k] == path[k]:
        k += 1
    return k


class InvariantDecoder:
    """Decodes through a ``LlamaContext`` in batch-invariant forwards only (2..MAX_QUERY_TOKENS tokens each)."""

    def __init__(self, ctx: LlamaContext, pad_seq: int):
        if ctx.n_batch < MAX_QUERY_TOKENS + 1:
            raise ValueError(f"the context's batch ({ctx.n_batch}) cannot hold {MAX_QUERY_TOKENS} tokens and a pad")
        self.ctx = ctx
        self.pad_seq = pad_seq  # a seq id no real token carries: the pad attends to itself alone

    def decode(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        seq_sets: Sequence[Sequence[int]],
        logits: bool,
        progress: Callable[[int, int], None] | None = None,
    ) -> np.ndarray:
        """Decode ``tokens`` in order; returns a copy of every token's logits row (``logits``) or an empty array."""
        rows = []
        for lo, hi in pieces(len(tokens)):
            if progress is not None and lo // 512 != hi // 512:
                progress(hi, len(tokens))
            toks, pos, sets = list(tokens[lo:hi]), list(positions[lo:hi]), list(seq_sets[lo:hi])
            flags = [logits] * len(toks)
            if len(toks) == 1:  # pad after the real token, so its freed cell is the last one
                toks, pos, sets, flags = toks + [toks[0]], pos + [0], sets + [(self.pad_seq,)], flags + [False]
            out = self.ctx.decode(toks, pos, sets, flags)
            if logits:
                rows.append(np.array(out))
            if len(tokens) == 1:
                self.ctx.seq_rm(self.pad_seq)
        if not logits:
            return np.empty((0, self.ctx.model.n_vocab), dtype=np.float32)
        return np.concatenate(rows)


def preorder(tree: DraftTree) -> list[int]:
    """Nodes in depth-first order, preferred child first: the drafter's first choice at every level becomes one
    run of consecutive cells, so accepting it leaves no gaps (and needs no re-placing)."""
    out: list[int] = []
    stack = list(reversed(tree.children[0]))
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(tree.children[node + 1]))
    return out


def self_check(ctx: LlamaContext, tokens: Sequence[int], pad_seq: int) -> float:
    """Decode ``tokens`` one at a time (padded) and again in forwards of 2..MAX_QUERY_TOKENS; returns the largest
    |logit difference| between the two for the same positions (0.0 when the build is batch-invariant here).
    Uses seq 0 of ``ctx`` and leaves it empty."""
    dec = InvariantDecoder(ctx, pad_seq)
    n = len(tokens)
    try:
        single = np.concatenate([dec.decode([t], [i], [(0,)], True) for i, t in enumerate(tokens)])
        worst = 0.0
        for size in range(2, MAX_QUERY_TOKENS + 1):
            ctx.seq_rm(0)
            for lo in range(0, n - 1, size):  # runs of `size` (the last may be shorter, never a lone token)
                hi = min(n, lo + size)
                got = ctx.decode(tokens[lo:hi], range(lo, hi), [(0,)] * (hi - lo), [True] * (hi - lo))
                worst = max(worst, float(np.abs(got - single[lo:hi]).max()))
        return worst
    finally:
        ctx.seq_rm(0)
