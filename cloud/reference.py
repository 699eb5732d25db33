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
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from tandem.core.messages import Constraint
from tandem.core.penalties import History
from tandem.core.sampling import Draws, Sampling, logprobs, target_token, warp
from tandem.core.tree import DraftTree

from .constraint import GrammarMask
from .engine import VerifierEngine
from .ownership import owned

EMPTY = DraftTree()


TOP = 8  # the reference's most probable tokens kept per position (what a divergence is judged against)


@dataclass
class Reference:
    tokens: list[int]
    top2_gap: list[float]  # logit gap between the best and second-best token at each generated position
    wall_s: float  # prefill + generation, seconds
    # sampled decoding: distance (in probability) from the position's draw to the nearest edge of the chosen
    # token's CDF interval; a small margin is where noise in the logits can change the token
    cdf_margin: list[float] | None = None
    logprobs: list[float] = field(default_factory=list)  # the target's log-probability of each generated token
    # the TOP best (token, logit) of each position's shaped row, best first
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    # decodes the continuation after this reference's prompt + ``tokens[:n]`` (n >= 1), for checking past a near-tie
    resume: Callable[[Sequence[int]], "Reference"] | None = field(default=None, repr=False, compare=False)
    # the engine's end-of-generation test: an output that took one at a near-tie ended there (nothing to resume)
    is_eog: Callable[[int], bool] | None = field(default=None, repr=False, compare=False)

    def head(self, n: int) -> "Reference":
        """This reference as if decoded for ``n`` tokens: a decode of more tokens runs the same forwards up to there
        (each position's choice depends only on the tokens before it); ``n`` at most the ``max_new_tokens`` it was
        decoded for. Resumes are cut to the same end."""
        if n >= len(self.tokens):
            return self
        resume = self.resume
        return replace(self, tokens=self.tokens[:n], top2_gap=self.top2_gap[:n], logprobs=self.logprobs[:n],
                       top=self.top[:n], cdf_margin=None if self.cdf_margin is None else self.cdf_margin[:n],
                       resume=None if resume is None else lambda prefix: resume(prefix).head(n - len(prefix)))


def decode(engine: VerifierEngine, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = Sampling(),
           draws: Draws | None = None, constraint: Constraint | None = None, prior_output: int = 0) -> Reference:
    """Target-only decoding, greedy or sampled (``draws``: default from ``sampling.seed``); stops after an
    end-of-generation token or ``max_new_tokens``. ``prior_output``: the prompt's last tokens are this generation's
    earlier output (penalties count them, the grammar has consumed them). Owns the engine throughout (a forward's
    rows are only valid until the engine's next call)."""
    draws = draws or Draws.for_sampling(sampling)
    t0 = time.perf_counter()
    with owned(engine):
        seq = engine.new_sequence()
        try:
            engine.prefill(seq, prompt[:-1])
            root, tokens, gaps, margins, lps, tops = prompt[-1], [], [], [], [], []
            history = History(prompt, prior_output) if sampling.shapes_logits else None
            grammar = GrammarMask(engine, constraint) if constraint is not None else None
            if grammar is not None and prior_output:
                grammar.commit(prompt[len(prompt) - prior_output:])
            while len(tokens) < max_new_tokens:
                raw = engine.forward_tree(seq, root, EMPTY)[0]
                row = history.shape(raw, sampling) if history is not None else raw
                if grammar is not None:
                    row = grammar.apply(row[None, :], EMPTY)[0]
                k = min(TOP, row.size)
                best = np.argpartition(row, -k)[-k:]
                best = best[np.argsort(-row[best], kind="stable")]
                tops.append(tuple((int(t), float(row[t])) for t in best))
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
                gaps.append(float(tops[-1][0][1] - tops[-1][1][1]))
                if engine.is_eog(root):
                    break
        finally:
            engine.release(seq)

    def resume(prefix: Sequence[int]) -> Reference:
        return decode(engine, list(prompt) + list(prefix), max_new_tokens - len(prefix), sampling, draws, constraint,
                      prior_output + len(prefix))

    return Reference(tokens, gaps, time.perf_counter() - t0, None if sampling.greedy else margins, lps, tops, resume,
                     engine.is_eog)


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
    with owned(engine):
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


@dataclass(frozen=True)
class Comparison:
    """A speculative output against the reference: ``kind`` "exact", "near_tie" (every divergence is at a position
    where the reference's best and the emitted token's logits are within what batch-shape noise can swap), or
    "other" (a real divergence: a bug); ``at`` the first divergence; ``detail`` what was compared. Reads as the pair
    ``(kind, at)`` (unpacked or indexed)."""
    kind: str
    at: int | None = None
    detail: str = ""
    near_ties: tuple[int, ...] = ()  # every divergence found a near-tie, in order

    @property
    def ok(self) -> bool:
        return self.kind in ("exact", "near_tie")

    def __iter__(self):
        return iter((self.kind, self.at))

    def __getitem__(self, i: int):
        return (self.kind, self.at)[i]

    def __str__(self) -> str:
        return f"{self.kind} at {self.at}: {self.detail}" if self.detail else self.kind


def _divergence(spec_token: int, ref: Reference, i: int, noise: float) -> tuple[bool, str]:
    """(near tie?, what was seen) at position ``i`` of ``ref``, where the output emitted ``spec_token``."""
    top = dict(ref.top[i]) if i < len(ref.top) else {}
    best_token, best = (ref.top[i][0] if i < len(ref.top) else (ref.tokens[i], float("nan")))
    if spec_token in top:
        gap = best - top[spec_token]
        return gap < 2 * noise, (f"emitted {spec_token}, reference {best_token}: the reference's logit of the "
                                 f"emitted token is {gap:.4f} below its best (near-tie below {2 * noise:.4f}, "
                                 f"batch-shape noise {noise:.4f})")
    if not top:  # a reference without its rows: the top-2 gap is all there is to judge by
        gap = ref.top2_gap[i]
        return gap < 2 * noise, (f"emitted {spec_token}, reference {best_token}: top-2 gap {gap:.4f} (near-tie "
                                 f"below {2 * noise:.4f}, batch-shape noise {noise:.4f}; emitted token's logit "
                                 f"not recorded)")
    return False, (f"emitted {spec_token}, reference {best_token}: the emitted token is not among the reference's "
                   f"{len(top)} best (the last {best - ref.top[i][-1][1]:.4f} below the best; batch-shape noise "
                   f"{noise:.4f})")


def classify(spec: Sequence[int], ref: Reference, noise: float) -> Comparison:
    """Compare a greedy speculative output with the greedy reference, divergence after divergence. At each
    divergence the emitted token must be within what batch-shape noise can swap with the reference's best (its
    logit within 2 * noise of the best); the comparison then goes on against the reference resumed from the
    output's own tokens (both paths are the target's from there), so a token after a near-tie is checked too. An
    output that took an end-of-generation token at a near-tie ended there, so that token must be its last."""
    spec, offset, near, first = list(spec), 0, [], None
    while True:
        i = next((j for j, (a, b) in enumerate(zip(spec[offset:], ref.tokens)) if a != b), None)
        if i is None:
            if len(spec) - offset != len(ref.tokens):
                at = offset + min(len(spec) - offset, len(ref.tokens))
                return Comparison("other", at, f"lengths differ after position {at}: output {len(spec)} tokens, "
                                               f"reference {offset + len(ref.tokens)}", tuple(near))
            return Comparison("near_tie" if near else "exact", first, "", tuple(near))
        tie, detail = _divergence(spec[offset + i], ref, i, noise)
        if not tie:
            if ref.resume is not None:  # which side was wrong: the same position decoded again from scratch
                again = ref.resume(spec[offset:offset + i])
                if again.tokens:
                    who = ("the output's token: the reference's row was wrong (cells or numerics)"
                           if again.tokens[0] == spec[offset + i] else
                           "the reference's token again: the verifier's row differed (cells or numerics)"
                           if again.tokens[0] == ref.tokens[i] else "a third token")
                    detail += f"; decoded again from scratch this position gives {again.tokens[0]}, {who}"
            return Comparison("other", offset + i, detail, tuple(near))
        near.append(offset + i)
        first = near[0]
        if ref.is_eog is not None and ref.is_eog(spec[offset + i]):
            if offset + i == len(spec) - 1:
                return Comparison("near_tie", first, detail + "; the output ended on it", tuple(near))
            return Comparison("other", offset + i + 1, f"{len(spec) - offset - i - 1} tokens after the output's "
                                                       f"end-of-generation token {spec[offset + i]}", tuple(near))
        if ref.resume is None:  # cannot see past it
            return Comparison("near_tie", first, detail + "; later tokens not checked", tuple(near))
        ref = ref.resume(spec[offset:offset + i + 1])
        offset += i + 1


SAMPLED_BOUNDARY = 0.02  # a sampled divergence within this probability of a CDF edge is batch-shape noise


def classify_sampled(spec: Sequence[int], ref: Reference) -> Comparison:
    """Compare a sampled speculative output with the sampled reference decoded with the same draws. The first
    divergence must be a near-tie: the position's draw within ``SAMPLED_BOUNDARY`` of an edge of the chosen token's
    CDF interval, where batch-shape noise in the logits can move it to the neighbour. The comparison stops there:
    past it the two answers are different texts, each the target's."""
    assert ref.cdf_margin is not None, "a greedy reference: use classify"
    for i, (a, b) in enumerate(zip(spec, ref.tokens)):
        if a != b:
            margin = ref.cdf_margin[i]
            detail = f"emitted {a}, reference {b}: the draw lies {margin:.4f} from the CDF edge"
            return Comparison("near_tie" if margin < SAMPLED_BOUNDARY else "other", i, detail, (i,))
    if len(spec) != len(ref.tokens):
        at = min(len(spec), len(ref.tokens))
        return Comparison("other", at, f"lengths differ: output {len(spec)} tokens, reference {len(ref.tokens)}")
    return Comparison("exact")


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
