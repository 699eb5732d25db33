"""Cross-request verify budget: which tree nodes of all sessions go into one forward of at most B tokens.

A verify forward's time grows with the tokens in it (on a GPU once it leaves the memory-bound regime, on a CPU
from the first token), so under load a forward holding every session's whole tree makes everyone wait. With a
budget the scheduler spends B tokens where they buy the most committed tokens: every session's root first (one
token each: every forward commits at least its bonus token), then nodes best-first by the drafter's path
probability across all trees, a node only after its parent. A node's path probability estimates the chance the
target accepts the whole path to it, so the expected tokens committed by a set of nodes is the sum of their path
probabilities, and best-first is the greedy choice for it (D-Cut / dynamic-budget tree verification). A pruned
node's subtree goes with it.

Pruning is lossless: the acceptance rule (cloud/acceptance.py) commits the target's own token at every position
whatever the tree, so a smaller tree only settles fewer positions per forward.

The budget can be given in tokens, or as a latency target in milliseconds: ``ForwardCost`` fits the replica's
forward time to its token count from the forwards it just ran (the cost grows with the KV the sessions hold, the
host's load, the GPU's regime: a fixed curve would go stale), and the target's budget is the most tokens whose
predicted forward fits what the target leaves after queueing. A draft's verify latency is its wait for the
forward in progress plus its own forward; with sessions in lock-step nobody waits, with many desynchronised ones
a draft waits about a whole forward. ``forward_target_ms`` takes the recent longest wait off the target, so the
latency a draft sees, not only the forward, stays near the target however many sessions there are.

Pure functions over literal trees, and a small fitted model; ``cloud.scheduler`` applies them.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from tandem.core.tree import DraftTree

UNSCORED_LEVEL_LOGP = math.log(0.5)  # a tree sent without probabilities: each level halves a node's value
MIN_SPREAD = 0.02  # least squared coefficient of variation of forward sizes for a fitted slope (~14 %)


def node_scores(tree: DraftTree, logp: Sequence[float]) -> list[float]:
    """Each node's path log-probability below the tree's root; ``logp`` empty: ``UNSCORED_LEVEL_LOGP`` per level."""
    if len(logp) == len(tree):
        return [float(x) for x in logp]
    return [d * UNSCORED_LEVEL_LOGP for d in tree.depths]


def allot(trees: Sequence[DraftTree], scores: Sequence[Sequence[float]], budget: int) -> list[tuple[int, ...]]:
    """The nodes of each tree (sorted indices) that fit a forward of ``budget`` tokens, roots included.

    Roots always go in (the caller keeps ``len(trees) <= budget``); then nodes best-first by score (higher first;
    ties: shallower, then earlier tree, then earlier node) from the frontier of what is already in, so every kept
    node's parent is kept even when a child scores above its parent.
    """
    room = budget - len(trees)
    kept: list[list[int]] = [[] for _ in trees]
    heap: list[tuple[float, int, int, int]] = []
    for t, tree in enumerate(trees):
        for node in tree.children[0]:
            heapq.heappush(heap, (-scores[t][node], 1, t, node))
    while room > 0 and heap:
        _, depth, t, node = heapq.heappop(heap)
        kept[t].append(node)
        room -= 1
        for child in trees[t].children[node + 1]:
            heapq.heappush(heap, (-scores[t][child], depth + 1, t, child))
    return [tuple(sorted(k)) for k in kept]


def restrict(tree: DraftTree, keep: Sequence[int]) -> DraftTree:
    """The tree of the nodes ``keep`` (sorted, each node's parent kept too), parents renumbered."""
    index = {old: new for new, old in enumerate(keep)}
    return DraftTree(
        tuple(tree.tokens[i] for i in keep), tuple(-1 if tree.parents[i] < 0 else index[tree.parents[i]] for i in keep)
    )


@dataclass
class ForwardCost:
    """Forward time in ms ~= ``fixed_ms + per_token_ms * tokens``, by exponentially weighted least squares over
    the forwards observed (each older forward's weight times ``decay``), so the fit follows a replica whose KV
    fills up or whose host gets busier. While the forwards seen had (nearly) one size the slope is noise: the fit is
    then proportional (no fixed part), which over-estimates larger forwards and so errs toward smaller budgets."""

    decay: float = 0.9
    min_forwards: int = 3  # no prediction before this many observations
    _n: int = 0
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, tokens: int, ms: float) -> None:
        d = self.decay
        self._n += 1
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + ms
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * ms

    def line(self) -> tuple[float, float] | None:
        """(fixed_ms, per_token_ms), or None before ``min_forwards`` observations."""
        if self._n < self.min_forwards:
            return None
        spread = self._w * self._xx - self._x * self._x  # weighted variance of token counts, times w^2
        if spread > MIN_SPREAD * self._x * self._x:  # sizes far enough apart for the slope to mean something
            slope = (self._w * self._xy - self._x * self._y) / spread
            fixed = (self._y - slope * self._x) / self._w
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, self._y / max(self._x, 1e-9)  # proportional: one size seen, or a fit with no sense in it

    def marginal_ms(self) -> float | None:
        """A token's cost in a forward (the fitted slope), or None while the forwards seen had too few sizes to
        tell the slope from the fixed part (the proportional fallback would charge each token the floor's share)."""
        fit = self.line()
        return fit[1] if fit is not None and fit[0] > 0 else None

    def predict(self, tokens: int) -> float | None:
        fit = self.line()
        return None if fit is None else fit[0] + fit[1] * tokens

    def tokens_within(self, ms: float) -> int | None:
        """The most tokens whose predicted forward takes at most ``ms`` (at least 1), and at most twice the recent
        forwards' mean size: the line is not trusted far past what was measured, so a budget grows by steps that
        each get measured. None while unfitted."""
        fit = self.line()
        if fit is None:
            return None
        fixed, per_token = fit
        if per_token <= 0:
            return None
        return max(1, min(int((ms - fixed) / per_token + 1e-6), int(2 * self._x / self._w)))  # 1e-6: fit rounding


def forward_target_ms(target_ms: float, wait_ms: float) -> float:
    """The time one forward may take so that queue wait + forward stays near ``target_ms``, given the recent
    longest queue wait ``wait_ms``; never below half the target (with desynchronised sessions the wait is about one
    forward, so the fixed point is half the target each; a smaller forward would only hold fewer roots and make
    everyone wait longer)."""
    return max(target_ms - wait_ms, target_ms / 2)
