"""How the target's token is chosen at each position: sampling parameters, their warping, and the random draws.

Randomness is a function of the position, not a stream: the draw for the token at committed position t (its index
in prompt + generated) is ``u_t = PRF(key, t)``, a keyed BLAKE2b of t mapped to [0, 1). The token is the inverse
CDF of the warped target distribution p_t at u_t. Consequences, which are why Tandem samples this way:

- exactness for any drafting: the committed token depends only on p_t and u_t, and u_t is independent of every
  draw before it, so it is independent of the tree it judges, however that tree was built (drafter context,
  prompt lookup, other sessions' caches, a guess made before a verdict) — nothing a drafter does can bias it;
- a resume, a retry or a new turn continues at later positions with their own draws and never replays one;
- with a pinned seed the key is derived from the seed, so the output is a function of (seed, prompt, target)
  alone: the same with or without drafting, with any tree shape, across resumes, and equal to Tandem's own
  target-only sampling with that seed (up to batch-shape noise at a CDF boundary, as greedy has near-ties);
- without a seed the key is fresh entropy for every session.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass

import numpy as np

from .errors import TandemError


MAX_LOGIT_BIAS = 1024  # tokens per request (OpenAI allows 300)
MAX_TOP_K = 1 << 20  # above any vocabulary (a top-k at or over the vocabulary keeps every token)


class SamplingError(TandemError, ValueError):
    """Sampling parameters that cannot be honoured; the message names the field."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1 (or 0 on the wire): off
    seed: int | None = None  # None: fresh entropy per session
    min_p: float = 0.0  # 0: off
    # history-dependent shaping of the logits (core.penalties), applied before everything above
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of tokens in prompt or output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits are shaped by the history or a bias before warping (see core.penalties)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    def check(self, vocab_size: int = 0) -> "Sampling":
        """Raise ``SamplingError`` for values no sampler can honour (NaN/inf included); top_p 0 means off.
        ``vocab_size``: when given, logit-bias ids must lie in the vocabulary."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in [0, 1], got {self.top_p}")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise SamplingError(f"top_k must be in [0, {MAX_TOP_K}], got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise SamplingError(f"seed must be an unsigned 64-bit integer, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or not -2.0 <= v <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {v}")
        if not math.isfinite(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise SamplingError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
                raise SamplingError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
            if token < 0 or (vocab_size and token >= vocab_size):
                raise SamplingError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})")
        return self if self.top_p else dataclasses.replace(self, top_p=1.0)


def warp(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Target probabilities for one position: temperature, then top-k, then top-p, then min-p (float64, sums to 1).

    min-p keeps tokens with p >= min_p * max(p) of the distribution top-k and top-p left (the most probable token
    always stays), the order vLLM and llama.cpp apply them in."""
    z = np.asarray(logits, dtype=np.float64) / sampling.temperature
    if 0 < sampling.top_k < z.size:
        kth = np.partition(z, -sampling.top_k)[-sampling.top_k]
        z = np.where(z >= kth, z, -np.inf)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if 0.0 < sampling.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # smallest prefix whose mass reaches top_p (always at least one token)
        keep = int(np.searchsorted(cum, sampling.top_p, side="left")) + 1
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if sampling.min_p > 0.0:
        p = np.where(p >= sampling.min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def inverse_cdf(p: np.ndarray, u: float) -> int:
    """The token whose cumulative-probability interval (in id order) holds ``u`` in [0, 1): distributed as p.
    Tokens of probability 0 own an empty interval and are never chosen."""
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), p.size - 1))


def target_token(logits_row: np.ndarray, sampling: Sampling, u: float) -> int:
    """The target's own token at a position: argmax when greedy, else the warped distribution at draw ``u``."""
    if sampling.greedy:
        return int(np.argmax(logits_row))
    return inverse_cdf(warp(logits_row, sampling), u)


def logprobs(logits_row: np.ndarray, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The model's own log-probability of ``token`` at a position (log-softmax of the raw logits: before
    temperature and the other controls, as OpenAI and vLLM report it) and the ``top`` most probable tokens."""
    z = np.asarray(logits_row, dtype=np.float64)
    lse = z.max() + np.log(np.exp(z - z.max()).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = np.argpartition(-z, top - 1)[:top] if top < z.size else np.arange(z.size)
        ids = ids[np.argsort(-z[ids], kind="stable")]
        best = tuple((int(i), float(z[i] - lse)) for i in ids)
    return float(z[token] - lse), best


class Draws:
    """The random draws of one session: ``uniform(t)`` for committed position t (see the module docstring)."""

    def __init__(self, key: bytes):
        self.key = key

    @classmethod
    def fresh(cls) -> "Draws":
        return cls(os.urandom(32))

    @classmethod
    def pinned(cls, seed: int) -> "Draws":
        return cls(hashlib.blake2b(seed.to_bytes(8, "little"), person=b"tandem-seed").digest())

    @classmethod
    def for_sampling(cls, sampling: Sampling) -> "Draws":
        return cls.fresh() if sampling.seed is None else cls.pinned(sampling.seed)

    def uniform(self, position: int) -> float:
        h = hashlib.blake2b(position.to_bytes(8, "little"), key=self.key, digest_size=8).digest()
        return (int.from_bytes(h, "little") >> 11) * 2.0**-53
