"""Target-only decoding on a verifier engine: the baseline every speculative output is compared with.

Uses the same engine, model file and prefill as the verifier, one token per forward (an empty tree), and the same
choice of token (``core.sampling.target_token``: argmax, or the warped distribution at the position's draw), so
the only difference from speculative decoding is the shape of the verify batches. With the same draws (a pinned
seed), sampled speculative output equals this too, up to batch-shape noise. Also measures that noise, on a path
that does not go through the tree forwards under test: it decides which divergences are near-ties, and how many of
them noise can explain (docs/design.md, Numerics).
"""
from __future__ import annotations

import math
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
from .engines.engine import TreeJob, VerifierEngine
from .engines.ownership import owned

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
    # sampled decoding: the token across the nearest edge of the chosen token's CDF interval (the one noise can move
    # the draw to), -1 where there is none
    cdf_neighbour: list[int] | None = None
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
                       cdf_neighbour=None if self.cdf_neighbour is None else self.cdf_neighbour[:n],
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
            tokens: list[int] = []
            root, gaps, margins, neighbours, lps, tops = prompt[-1], [], [], [], [], []
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
                    below, above = u * cdf[-1] - lo, cdf[root] - u * cdf[-1]
                    margins.append(float(min(below, above)))
                    neighbours.append(_across(cdf, root, below <= above))
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

    return Reference(tokens, gaps, time.perf_counter() - t0, None if sampling.greedy else margins,
                     None if sampling.greedy else neighbours, lps, tops, resume, engine.is_eog)


def _across(cdf: np.ndarray, token: int, lower: bool) -> int:
    """The token whose CDF interval borders ``token``'s on its lower (else upper) edge: the nearest id on that
    side with probability above zero; -1 when there is none."""
    p = np.diff(cdf, prepend=0.0)
    ids = np.flatnonzero(p[:token] > 0) if lower else token + 1 + np.flatnonzero(p[token + 1:] > 0)
    return int(ids[-1] if lower else ids[0]) if ids.size else -1


def greedy(engine: VerifierEngine, prompt: Sequence[int], max_new_tokens: int) -> Reference:
    """Greedy target-only decoding; stops after an end-of-generation token or ``max_new_tokens``."""
    return decode(engine, prompt, max_new_tokens)


class Noise(float):
    """Batch-shape noise: the largest |logit difference| between the same position computed in batches of
    different shapes (the float), with the measured ``swaps``: how far the gap between a position's best token and
    each of its runners-up moved between shapes, both ways (sorted). A top-2 gap ``g`` is overturned by noise alone
    with about the probability that a swap exceeds ``g`` (``swap_probability``): the measured frequency, or, in the
    tail a few hundred samples see too rarely to count, an exponential fitted through the swaps' 90th and 99th
    percentiles, whichever is larger (on the real pair the tail falls off exponentially: ``bench.noise``)."""

    swaps: np.ndarray

    def __new__(cls, value: float, swaps: Sequence[float] | np.ndarray = ()) -> "Noise":
        noise = super().__new__(cls, value)
        noise.swaps = np.sort(np.asarray(swaps, dtype=np.float64))
        return noise

    @classmethod
    def of(cls, noises: Sequence["Noise"]) -> "Noise":
        """Several measurements as one: the largest noise, every swap."""
        return cls(max(float(n) for n in noises), np.concatenate([n.swaps for n in noises]))

    def swap_probability(self, gap: float) -> float:
        """How often noise alone puts a token ``gap`` logits below the best above it: the measured swaps'
        frequency, or their fitted exponential tail, whichever is larger; with too few measured (a plain float's
        bound), each logit moving uniformly within +-noise."""
        n = float(self)
        if self.swaps.size < MIN_SWAPS:
            return 0.0 if gap >= 2 * n or n <= 0 else (2 * n - max(gap, 0.0)) ** 2 / (8 * n * n)
        measured = float(self.swaps.size - np.searchsorted(self.swaps, gap, side="right")) / self.swaps.size
        q90, q99 = np.quantile(self.swaps, (0.9, 0.99))
        if q99 <= q90 or gap <= q90:
            return measured
        scale = (q99 - q90) / math.log(10.0)  # P(swap > g) = 0.1 exp(-(g - q90) / scale) through both points
        return max(measured, min(1.0, 0.1 * math.exp(-(gap - q90) / scale)))


def batch_shape_noise(engine: VerifierEngine, prompt: Sequence[int], continuation: Sequence[int],
                      companions: Sequence[int] = (3, 15, 47), top: int = TOP) -> Noise:
    """The noise of the positions ``[prompt[-1]] + continuation`` decoded one token per forward alone, against
    the same one-token forwards sharing their batch with another sequence of ``c`` tokens (each ``c`` of
    ``companions``: batch shapes of 4, 16 and 48 tokens by default, which round differently: other kernels,
    other cell layouts).

    Measured without the tree forwards under test: a position's row here is a lone root with nothing but its
    committed history to attend to, so a bug in tree attention cannot widen the excuse it is judged by. A logit can
    move by this much with batch shape alone, so a top-2 gap can move by up to twice as much; ``Noise.swaps``
    says how often it does."""
    cont = list(continuation)
    steps = [prompt[-1]] + cont
    companions = [c for c in companions if c + 1 <= min(engine.max_tree_nodes + 1, engine.max_batch_tokens)]
    with owned(engine):
        single = _decoded_alone(engine, prompt, steps)
        shaped = [_decoded_beside(engine, prompt, steps, c) for c in companions]
    worst, swaps = 0.0, []
    for rows in shaped:
        worst = max(worst, float(np.abs(rows - single).max()))
        for ref_row, row in zip(single, rows):
            best = np.argsort(-ref_row, kind="stable")[:top]
            moved = (ref_row[best[0]] - ref_row[best[1:]]) - (row[best[0]] - row[best[1:]])
            swaps.extend(moved.tolist())
            swaps.extend((-moved).tolist())
    return Noise(worst, swaps)


def _decoded_alone(engine: VerifierEngine, prompt: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    seq = engine.new_sequence()
    try:
        engine.prefill(seq, prompt[:-1])
        rows = []
        for tok in steps:
            rows.append(np.array(engine.forward_tree(seq, tok, EMPTY)[0]))
            engine.keep_path(seq, EMPTY, [])
        return np.stack(rows)
    finally:
        engine.release(seq)


def _decoded_beside(engine: VerifierEngine, prompt: Sequence[int], steps: Sequence[int], width: int) -> np.ndarray:
    """The one-token rows of ``steps``, each forward shared with a companion sequence (the prompt's first tokens)
    decoding a chain of ``width`` tokens that only its own root is kept of."""
    seq, other = engine.new_sequence(), engine.new_sequence()
    try:
        engine.prefill(seq, prompt[:-1])
        head = list(prompt[: max(2, min(len(prompt), 16))])
        engine.prefill(other, head[:-1])
        root, filler = head[-1], DraftTree.chain([(head[-1] + 7919 * (i + 1)) % engine.vocab_size
                                                  for i in range(width)])
        rows = []
        for tok in steps:
            mine, _ = engine.forward_batch([TreeJob(seq, tok, EMPTY), TreeJob(other, root, filler)])
            rows.append(np.array(mine[0]))
            engine.keep_path(seq, EMPTY, [])
            engine.keep_path(other, filler, [])
        return np.stack(rows)
    finally:
        engine.release(seq)
        engine.release(other)


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
    """(near tie?, what was seen) at position ``i`` of ``ref``, where the output emitted ``spec_token``. Judged on
    the reference's own row only: a reference that kept no row for the position excuses nothing."""
    if i >= len(ref.top):
        return False, (f"emitted {spec_token}, reference {ref.tokens[i]}: the reference kept no row here to judge a "
                       f"near-tie by")
    top = dict(ref.top[i])
    best_token, best = ref.top[i][0]
    if spec_token in top:
        gap = best - top[spec_token]
        return gap < 2 * noise, (f"emitted {spec_token}, reference {best_token}: the reference's logit of the "
                                 f"emitted token is {gap:.4f} below its best (near-tie below {2 * noise:.4f}, "
                                 f"batch-shape noise {noise:.4f})")
    return False, (f"emitted {spec_token}, reference {best_token}: the emitted token is not among the reference's "
                   f"{len(top)} best (the last {best - ref.top[i][-1][1]:.4f} below the best; batch-shape noise "
                   f"{noise:.4f})")


MIN_SWAPS = 100  # fewer measured swaps say nothing of their tail: the uniform bound is used instead
NEAR_TIE_ALPHA = 1e-4  # how unlikely a count of near-ties may be under the measured noise before it is a failure
# how far the expected number of swaps is raised before the bound: the one-token path's swaps match the tree
# forwards' in the bulk but sample the tail thinner (bench.noise measures both; bench/results/2026-12-07/noise)
SWAP_SAFETY = 2.0


def near_ties_explained(expected: float, alpha: float = NEAR_TIE_ALPHA) -> int:
    """The most near-ties noise explains when it is expected to swap ``expected`` positions: the smallest k with
    P(Poisson(expected) > k) < ``alpha`` (swaps are rare and independent across positions)."""
    k, term = 0, math.exp(-expected)
    tail = 1.0 - term
    while tail >= alpha:
        k += 1
        term *= expected / k
        tail -= term
    return k


def _expected_swaps(ref: Reference, upto: int, noise: float) -> float:
    """How many of ``ref``'s first ``upto`` positions noise is expected to swap (top-2 gaps against the swaps)."""
    swap = noise.swap_probability if isinstance(noise, Noise) else Noise(noise).swap_probability
    return sum(swap(g) for g in ref.top2_gap[:upto])


def classify(spec: Sequence[int], ref: Reference, noise: float) -> Comparison:
    """Compare a greedy speculative output with the greedy reference, divergence after divergence. At each
    divergence the emitted token must be within what batch-shape noise can swap with the reference's best (its
    logit within 2 * noise of the best, on the reference's own row); the comparison then goes on against the
    reference resumed from the output's own tokens (both paths are the target's from there), so a token after a
    near-tie is checked too. An output that took an end-of-generation token at a near-tie ended there, so that token
    must be its last. And there may be no more near-ties than noise explains over the positions compared
    (``near_ties_explained``, from ``Noise.swaps`` when measured): an acceptor that takes runners-up within the
    window every time it can is caught by their number even where each one alone looks like noise."""
    near: list[int] = []  # positions of the near-ties passed
    spec, offset, first, expected = list(spec), 0, None, 0.0
    while True:
        i = next((j for j, (a, b) in enumerate(zip(spec[offset:], ref.tokens)) if a != b), None)
        expected += _expected_swaps(ref, len(ref.tokens) if i is None else i + 1, noise)
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
        # (one near-tie is always possible: it passed the window above, whatever the swaps sampled)
        if len(near) > (allowed := max(1, near_ties_explained(SWAP_SAFETY * expected))):
            return Comparison("other", offset + i, f"{len(near)} near-ties at {near}, where batch-shape noise "
                                                   f"explains at most {allowed} (it is expected to swap "
                                                   f"{expected:.3f} of the positions compared): {detail}", tuple(near))
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
    """Compare a sampled speculative output with the sampled reference decoded with the same draws, divergence
    after divergence. At each divergence the position's draw must lie within ``SAMPLED_BOUNDARY`` of an edge of the
    reference token's CDF interval, and the emitted token must be the one across that edge (the only token
    batch-shape noise in the logits can move the draw to); the comparison then goes on against the reference
    resumed from the output's own tokens with the same draws, so every later token is checked too."""
    near: list[int] = []  # positions of the near-ties passed
    spec, offset = list(spec), 0
    while True:
        assert ref.cdf_margin is not None, "a greedy reference: use classify"
        i = next((j for j, (a, b) in enumerate(zip(spec[offset:], ref.tokens)) if a != b), None)
        if i is None:
            if len(spec) - offset != len(ref.tokens):
                at = offset + min(len(spec) - offset, len(ref.tokens))
                return Comparison("other", at, f"lengths differ after position {at}: output {len(spec)} tokens, "
                                               f"reference {offset + len(ref.tokens)}", tuple(near))
            return Comparison("near_tie" if near else "exact", near[0] if near else None, "", tuple(near))
        a, b, margin = spec[offset + i], ref.tokens[i], ref.cdf_margin[i]
        across = ref.cdf_neighbour[i] if ref.cdf_neighbour is not None else -1
        detail = (f"emitted {a}, reference {b}: the draw lies {margin:.4f} from the CDF edge (noise can move it "
                  f"below {SAMPLED_BOUNDARY}), across which lies {across}")
        if margin >= SAMPLED_BOUNDARY or a != across:
            return Comparison("other", offset + i, detail, tuple(near))
        near.append(offset + i)
        if ref.is_eog is not None and ref.is_eog(a):
            if offset + i == len(spec) - 1:
                return Comparison("near_tie", near[0], detail + "; the output ended on it", tuple(near))
            return Comparison("other", offset + i + 1, f"tokens after the output's end-of-generation token {a}",
                              tuple(near))
        if ref.resume is None:
            return Comparison("near_tie", near[0], detail + "; later tokens not checked", tuple(near))
        ref = ref.resume(spec[offset:offset + i + 1])
        offset += i + 1


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
