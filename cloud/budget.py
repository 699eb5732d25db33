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

Pure functions over literal trees; ``cloud.scheduler`` applies them.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

from tandem.core.tree import DraftTree

UNSCORED_LEVEL_LOGP = math.log(0.5)  # a tree sent without probabilities: each level halves a node's value


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
