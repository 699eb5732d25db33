"""Draft trees: the domain type both sides share, its validation, the structure engines need, and tree shapes.

A tree hangs below the *root*, the last committed token. Node ``i`` has ``tokens[i]`` and ``parents[i]``, where a
parent is an earlier index or -1 (the root). Nodes are in topological order and siblings carry distinct tokens,
listed in the drafter's order of preference. Depth of a child of the root is 1.

The verifier is the authority on validity (``validate``); the edge builds trees that pass it by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from .errors import TandemError


class TreeError(TandemError, ValueError):
    """A draft tree is malformed or exceeds the negotiated limits; the message says which node and why."""


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return tuple(d)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """``children[0]`` are the root's children, ``children[i + 1]`` node i's; each in sibling (preference) order."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.tokens)) if not self.children[i + 1])

    @cached_property
    def leaf_sets(self) -> tuple[tuple[int, ...], ...]:
        """For each node, the indices (into ``leaves``) of the leaf branches passing through it.

        This is the seq-id tagging llama.cpp needs for a tree in one batch: a query attends to the cells that share
        its *first* seq id, and the cells on leaf branch ``b`` are exactly the ancestors of every node tagged ``b``.
        """
        sets: list[list[int]] = [[] for _ in self.tokens]
        for b, leaf in enumerate(self.leaves):
            i = leaf
            while i >= 0:
                sets[i].append(b)
                i = self.parents[i]
        return tuple(tuple(sorted(s)) for s in sets)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` inclusive ([] for the root, node = -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @staticmethod
    def chain(tokens: list[int] | tuple[int, ...]) -> "DraftTree":
        return DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)))


def validate(tree: DraftTree, vocab_size: int, max_nodes: int, max_depth: int) -> None:
    """Raise ``TreeError`` naming the first problem: shape, parent order, token range, sibling duplicates, limits."""
    n = len(tree.tokens)
    if len(tree.parents) != n:
        raise TreeError(f"tree has {n} tokens but {len(tree.parents)} parents; the arrays must have equal length")
    if n > max_nodes:
        raise TreeError(f"tree has {n} nodes, over the negotiated limit of {max_nodes}")
    depth: list[int] = []
    seen_children: set[tuple[int, int]] = set()
    for i, (tok, p) in enumerate(zip(tree.tokens, tree.parents)):
        if not -1 <= p < i:
            raise TreeError(
                f"node {i} has parent {p}; a parent must be -1 (the root) or an earlier node index "
                f"(nodes in topological order)"
            )
        if not 0 <= tok < vocab_size:
            raise TreeError(f"node {i} has token id {tok}, outside the vocabulary [0, {vocab_size})")
        if (p, tok) in seen_children:
            raise TreeError(f"node {i} repeats token {tok} under parent {p}; siblings must carry distinct tokens")
        seen_children.add((p, tok))
        depth.append(1 if p < 0 else depth[p] + 1)
        if depth[-1] > max_depth:
            raise TreeError(f"node {i} is at depth {depth[-1]}, over the negotiated limit of {max_depth}")


def depths_reached_and_accepted(tree_depth: int, accepted: int) -> tuple[range, range]:
    """The depths (1-based) a verified tree *reached* (all shallower levels accepted) and those it *accepted*, given
    its depth and the accepted path's length: alpha_d = accepted(d) / reached(d) over rounds. Counted here once, for
    the edge's statistics and the verifier's metrics alike."""
    return range(1, min(tree_depth, accepted + 1) + 1), range(1, min(tree_depth, accepted) + 1)


def walk(tree: DraftTree, tokens: Sequence[int]) -> int | None:
    """The node reached from the root by following ``tokens`` (-1: the root itself, for no tokens), or None when
    the tokens leave the tree. How a tree drafted on an older committed length is rebased onto tokens committed
    since: the subtree below the node reached is still a valid tree below the newest committed token."""
    node = -1
    for tok in tokens:
        child = next((c for c in tree.children[node + 1] if tree.tokens[c] == tok), None)
        if child is None:
            return None
        node = child
    return node


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (how much of one history's cache serves the
    other)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if len(diff) else n


def subtree(tree: DraftTree, node: int) -> tuple[DraftTree, tuple[int, ...]]:
    """The descendants of ``node`` as a tree of their own (``node`` becomes the root; -1 is the whole tree); also
    new -> old indices."""
    index: dict[int, int] = {}
    keep: list[int] = []
    for i, p in enumerate(tree.parents):
        if p == node or p in index:
            index[i] = len(keep)
            keep.append(i)
    parents = tuple(-1 if tree.parents[i] == node else index[tree.parents[i]] for i in keep)
    return DraftTree(tuple(tree.tokens[i] for i in keep), parents), tuple(keep)


@dataclass(frozen=True)
class TreeShape:
    k: int = 4  # children per expanded node, and frontier nodes expanded per level
    n: int = 16  # nodes kept in the tree
    d: int = 6  # maximum depth

    def __post_init__(self):
        if self.k < 1 or self.n < 1 or self.d < 1:
            raise ValueError(f"tree shape needs k, N, D >= 1, got k={self.k} N={self.n} D={self.d}")

    @staticmethod
    def parse(text: str) -> "TreeShape":
        """``"k,N,D"``, e.g. ``"1,8,8"`` for a chain of 8 or ``"4,16,6"``."""
        try:
            k, n, d = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"tree shape must be 'k,N,D' (three integers), got {text!r}") from None
        return TreeShape(k, n, d)

    def __str__(self) -> str:
        return f"{self.k},{self.n},{self.d}"
