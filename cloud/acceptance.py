"""Acceptance maths: which draft nodes the target accepts, and the bonus token.

Vocabulary (used the same way everywhere in Tandem):

- ``p``: the target distribution at a tree position, i.e. softmax(logits / temperature) restricted by top-k then
  top-p and renormalised (``warp``). Row 0 of a logits matrix is the root (the last committed token), row i+1 is
  tree node i; the distribution in row r is over the token that *follows* that position.
- accepted tokens: the tree nodes on the path the target agrees with, root to deepest.
- bonus token: the target's own token after the accepted path; every verify forward commits at least this one.
- tau: committed tokens per verify forward = len(accepted) + 1.
- alpha_d: the fraction of rounds reaching depth d-1 in which a depth-d node was accepted.

Greedy (temperature 0): walk from the root; at each node accept the child whose token is ``argmax p``; when none
matches (or at a leaf) stop and the bonus is ``argmax p``. The committed sequence is exactly greedy decoding of the
target.

Sampling: the multi-draft rule with point-mass proposals. At a node with children x_1..x_k (drafter's order),
accept x_j with probability p[x_j]; on rejection set p[x_j] = 0, renormalise and try x_{j+1}; when all are rejected
(or at a leaf) the bonus is drawn from the residual p. Why it is exact: the first committed token equals x_1 with
probability p[x_1]; given rejection, the residual is p conditioned on "not x_1", so by induction the committed token
is distributed as p, and no draft probability needs to cross the network.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tree import DraftTree


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class Acceptance:
    accepted: tuple[int, ...]  # node indices, root's child first
    bonus: int  # token id

    def committed_tokens(self, tree: DraftTree) -> list[int]:
        return [tree.tokens[i] for i in self.accepted] + [self.bonus]


def warp(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Target probabilities for one position: temperature, then top-k, then top-p (float64, sums to 1)."""
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
    return p


def accept_greedy(tree: DraftTree, logits: np.ndarray) -> Acceptance:
    """Greedy walk; ``logits[0]`` is the root row, ``logits[i + 1]`` node i's row."""
    node, accepted = -1, []
    while True:
        best = int(np.argmax(logits[node + 1]))
        nxt = next((c for c in tree.children[node + 1] if tree.tokens[c] == best), None)
        if nxt is None:
            return Acceptance(tuple(accepted), best)
        accepted.append(nxt)
        node = nxt


def _draw(p: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), p.size - 1))


def accept_sampling(tree: DraftTree, logits: np.ndarray, sampling: Sampling,
                    rng: np.random.Generator) -> Acceptance:
    """Multi-draft point-mass acceptance (see module docstring); exact in distribution."""
    node, accepted = -1, []
    while True:
        p = warp(logits[node + 1], sampling)
        nxt = None
        for c in tree.children[node + 1]:
            x = tree.tokens[c]
            if rng.random() < p[x]:
                nxt = c
                break
            rest = 1.0 - p[x]
            if rest <= 0.0:  # p was a point mass on x up to rounding: rejecting it had probability 0
                nxt = c
                break
            p[x] = 0.0
            p /= rest
        if nxt is None:
            return Acceptance(tuple(accepted), _draw(p, rng))
        accepted.append(nxt)
        node = nxt


def accept(tree: DraftTree, logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> Acceptance:
    if sampling.greedy:
        return accept_greedy(tree, logits)
    return accept_sampling(tree, logits, sampling, rng)
