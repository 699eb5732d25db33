"""Draft trees from chain traces: what the drafter's other candidates hold where its first choice is wrong.

The traces record, for every output position p, the run ``L[p]`` of the drafter's greedy chain drafted there, so
where ``L[p] >= 1`` the drafter's first choice at p is the target's token. Where it is not, the target's token is the
drafter's r-th choice with probability ``q[r - 2]`` (r = 2, 3, ...), independently per position, and none of its
choices with the rest: each position's *rank* (``Ranks``). A tree's node is the target's token iff every rank on
its path from the root matches the positions' ranks; the verifier's walk then accepts exactly the path of correct
nodes (``core.tree.walk`` on position-numbered tokens, as chains are). A chain (width 1) holds min(L[i], d) tokens,
as the traces say.

``q`` is fitted, not measured per position: the one tree measurement with the real pair (``bench.browser``, trees of
``2,6,4`` against chains of 4 on 2 ShareGPT prompts: tau 2.98 against 2.46, bench/results/2026-12-06/browser-trees/
NOTES.md) is reproduced, on a text whose flat first-choice acceptance gives chains of 4 that tau (0.635), with
q[0] = 0.8 (tau 2.96): where the drafter's first choice misses, its second is most often the target's token (such
positions are near-ties). Ranks 3 and 4 are assumed to take half of what is left each. A small sample: trees here
are an estimate, labelled so.
Trees are built best-first on path probability, as ``edge.drafting.build_tree`` does, with a
rank-1 child's probability the text's first-choice agreement a and a rank-r child's (1 - a) q[r - 2].
"""
from __future__ import annotations

import heapq
import math
import random
from functools import lru_cache

from tandem.core.tree import DraftTree, TreeShape
from tandem.edge.drafting import BuiltTree

MISS = 10**9  # tokens >= this are drafts the target never emits
Q_RANKS = (0.8, 0.1, 0.05)  # P(target token is the drafter's 2nd, 3rd, 4th choice | its first is not)


class Ranks:
    """Per output position: 1 where the trace says the first choice holds, else a drawn rank (0: none holds)."""

    def __init__(self, runs, rng: random.Random, q=Q_RANKS):
        self.runs, self.rng, self.q = runs, rng, q
        self._drawn: dict[int, int] = {}

    def __call__(self, p: int) -> int:
        if not 0 <= p < len(self.runs):
            return 0
        if self.runs[p] >= 1:
            return 1
        if p not in self._drawn:
            u, r = self.rng.random(), 0
            for i, qi in enumerate(self.q):
                if u < qi:
                    r = i + 2
                    break
                u -= qi
            self._drawn[p] = r
        return self._drawn[p]


@lru_cache(maxsize=4096)
def shape_paths(shape: TreeShape, agree: float, q=Q_RANKS) -> list[tuple[tuple[int, ...], float]]:
    """The ``shape.n`` likeliest rank paths of depth <= ``shape.d`` with ranks <= ``shape.k`` (a parent always
    before its children), and each one's path log-probability."""
    p = [agree] + [(1 - agree) * x for x in q]
    lp = [math.log(max(x, 1e-9)) for x in p[:shape.k]]
    heap = [(-lp[r], (r + 1,)) for r in range(len(lp))]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < shape.n:
        neg, path = heapq.heappop(heap)
        out.append((path, -neg))
        if len(path) < shape.d:
            for r in range(len(lp)):
                heapq.heappush(heap, (neg - lp[r], path + (r + 1,)))
    return out


def holds(path: tuple[int, ...], start: int, ranks: Ranks) -> bool:
    """Whether the node at rank ``path`` below output position ``start`` is the target's token: a run of m first
    choices from position p holds iff the trace's chain there held m (L[p] >= m); another rank r at p iff p's rank
    is r; after it the drafter's chain continues on the target's own text."""
    p, j = start, 0
    while j < len(path):
        if path[j] == 1:
            m = next((k for k in range(j, len(path)) if path[k] != 1), len(path)) - j
            if (ranks.runs[p] if 0 <= p < len(ranks.runs) else 0) < m:
                return False
            p, j = p + m, j + m
        else:
            if ranks(p) != path[j]:
                return False
            p, j = p + 1, j + 1
    return True


def build(shape: TreeShape, start: int, ranks: Ranks, agree: float) -> BuiltTree:
    """The tree of ``shape`` drafted at output position ``start``: tokens are output positions where the node is the
    target's token, else distinct misses."""
    paths = shape_paths(shape, agree, ranks.q)
    index = {path: i for i, (path, _) in enumerate(paths)}
    tokens, parents = [], []
    for i, (path, _) in enumerate(paths):
        tokens.append(start + len(path) - 1 if holds(path, start, ranks) else MISS + start * 64 + i)
        parents.append(index[path[:-1]] if len(path) > 1 else -1)
    return BuiltTree(DraftTree(tuple(tokens), tuple(parents)), tuple(range(len(paths))),
                     tuple(lp for _, lp in paths))
