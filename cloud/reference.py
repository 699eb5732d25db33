"""Target-only decoding on a verifier engine: the baseline every speculative output is compared with.

Uses the same engine, model file and prefill as the verifier, one token per forward (an empty tree), and the same
choice of token (``core.sampling.target_token``: argmax, or the warped distribution at the position's draw), so
the only difference from speculative decoding is the shape of the verify batches. With the same draws (a pinned
seed), sampled speculative output equals this too, up to batch-shape noise. Also measures that noise: it decides
which divergences are near-ties (see DESIGN.md, Numerics).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tandem.core.messages import Constraint
from tandem.core.penalties import History
from tandem.core.sampling import Draws, Sampling, logprobs, target_token, warp
from tandem.core.tree import DraftTree

from .constraint import GrammarMask
from .engine import VerifierEngine

EMPTY = DraftTree()


@dataclass
class Reference:
    tokens: list[int]
    top2_gap: list[float]  # logit gap between the best and second-best token at each generated position
    wall_s: float  # prefill + generation, seconds
    # sampled decoding: distance (in probability) from the position's draw to the nearest edge of the chosen
    # token's CDF interval; a small margin is where noise in the logits can change the token
    cdf_margin: list[float] | None = None
    logprobs: list[float] = field(default_factory=list)  # the target's log-probability of each generated token


def decode(engine: VerifierEngine, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = Sampling(),
           draws: Draws | None = None, constraint: Constraint | None = None) -> Reference:
    """Target-only decoding, greedy or sampled (``draws``: default from ``sampling.seed``); stops after an
    end-of-generation token or ``max_new_tokens``."""
    draws = draws or Draws.for_sampling(sampling)
    t0 = time.perf_counter()
    seq = engine.new_sequence()
    try:
        engine.prefill(seq, prompt[:-1])
        root, tokens, gaps, margins, lps = prompt[-1], [], [], [], []
        history = History(prompt) if sampling.shapes_logits else None
        grammar = GrammarMask(engine, constraint) if constraint is not None else None
        while len(tokens) < max_new_tokens:
            raw = engine.forward_tree(seq, root, EMPTY)[0]
            row = history.shape(raw, sampling) if history is not None else raw
            if grammar is not None:
                row = grammar.apply(row[None, :], EMPTY)[0]
            top2 = np.partition(row, -2)[-2:]
            u = draws.uniform(len(prompt) + len(tokens))
            root = target_token(row, sampling, u)
            if not sampling.greedy:
                cdf = np.cumsum(warp(row, sampling))
                lo = cdf[root - 1] if root else 0.0
                margins.append(float(min(u * cdf[-1] - lo, cdf[root] - u * cdf[-1])))
            engine.keep_path(seq, EMPTY, [])
            tokens.append(root)
            if history is not None:
                history.extend([root])
            if grammar is not None:
                grammar.commit([root])
            lps.append(logprobs(raw, root, 0)[0])
            gaps.append(float(top2[1] - top2[0]))
            if engine.is_eog(root):
                break
        return Reference(tokens, gaps, time.perf_counter() - t0, None if sampling.greedy else margins, lps)
    finally:
        engine.release(seq)


def greedy(engine: VerifierEngine, prompt: Sequence[int], max_new_tokens: int) -> Reference:
    """Greedy target-only decoding; stops after an end-of-generation token or ``max_new_tokens``."""
    return decode(engine, prompt, max_new_tokens)


def batch_shape_noise(engine: VerifierEngine, prompt: Sequence[int], continuation: Sequence[int],
                      width: int = 4) -> float:
    """Largest |logit difference| for the same positions computed one token per forward versus inside tree
    batches: a chain of ``continuation`` and the same chain with ``width - 1`` extra siblings at every level.

    A logit can move by this much with batch shape alone, so a top-2 gap can move by up to twice as much.
    """
    def rows_for(tree: DraftTree, chain_nodes: list[int]) -> np.ndarray:
        seq = engine.new_sequence()
        try:
            engine.prefill(seq, prompt[:-1])
            logits = engine.forward_tree(seq, prompt[-1], tree)
            return np.array(logits[[0] + [n + 1 for n in chain_nodes]])
        finally:
            engine.release(seq)

    cont = list(continuation)
    width = max(1, min(width, engine.max_tree_nodes // max(1, len(cont))))  # stay within the engine's tree limit
    seq = engine.new_sequence()  # one token per forward
    single = []
    try:
        engine.prefill(seq, prompt[:-1])
        for tok in [prompt[-1]] + cont:
            single.append(np.array(engine.forward_tree(seq, tok, EMPTY)[0]))
            engine.keep_path(seq, EMPTY, [])
    finally:
        engine.release(seq)
    single = np.stack(single)

    chain = rows_for(DraftTree.chain(cont), list(range(len(cont))))
    # widened: each chain token gets width-1 siblings (tokens not equal to it), placed after it
    tokens, parents, chain_nodes, prev = [], [], [], -1
    for tok in cont:
        chain_nodes.append(len(tokens))
        tokens.append(tok)
        parents.append(prev)
        for s in range(1, width):
            tokens.append((tok + 7919 * s) % engine.vocab_size)
            parents.append(prev)
        prev = chain_nodes[-1]
    wide = rows_for(DraftTree(tuple(tokens), tuple(parents)), chain_nodes)
    return float(max(np.abs(chain - single).max(), np.abs(wide - single).max()))


def classify(spec: Sequence[int], ref: Reference, noise: float) -> tuple[str, int | None]:
    """Compare a speculative output with the reference: ``("exact", None)``, ``("near_tie", i)`` when they first
    differ at a position whose reference top-2 gap is within what batch-shape noise can flip (2 * noise), else
    ``("other", i)`` — a real divergence, i.e. a bug."""
    for i, (a, b) in enumerate(zip(spec, ref.tokens)):
        if a != b:
            return ("near_tie" if ref.top2_gap[i] < 2 * noise else "other"), i
    if len(spec) != len(ref.tokens):
        return "other", min(len(spec), len(ref.tokens))
    return "exact", None


def emitted_counts(engine: VerifierEngine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   progress=None) -> Counter:
    """Token counts of the target's own greedy outputs on calibration prompts (what a VocabTrim head keeps,
    edge.vocabtrim)."""
    counts: Counter = Counter()
    for i, prompt in enumerate(prompts):
        counts.update(greedy(engine, prompt, max_new_tokens).tokens)
        if progress:
            progress(i + 1, len(prompts))
    return counts
