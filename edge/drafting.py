"""Dynamic draft-tree construction (EAGLE-2 style), independent of any engine.

Each candidate node carries its path log-probability under the drafter, log q(x_1..x_d) = sum of the drafter's
log-softmax along the path. Level by level we expand the ``k`` likeliest frontier nodes (each gets its drafter
top-``k`` children), and finally keep the ``n`` likeliest candidates overall, depth <= ``d``. Since a child's path
probability never exceeds its parent's, the ``n`` best (ties broken towards shallower, earlier nodes) always
include every kept node's ancestors, so the result is a tree. k = 1 gives a chain of length min(n, d).

The engine is reached only through ``expand``: given candidate indices to evaluate, return each one's top-k
children as (token, log-prob) pairs in descending order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tandem.core.tree import DraftTree, TreeShape

TopK = list[tuple[int, float]]
# expand(indices to evaluate, tokens of all candidates so far, parents of all candidates so far) -> top-k per index
Expand = Callable[[list[int], Sequence[int], Sequence[int]], list[TopK]]


@dataclass(frozen=True)
class BuiltTree:
    tree: DraftTree
    candidate: tuple[int, ...]  # tree node -> candidate index (what the engine knows the node by)
    logp: tuple[float, ...]  # path log-probability of each tree node under the drafter
    # the drafter's context is full: it drafts nothing more in this generation (an empty tree without it is only
    # this round's: a translating drafter whose text spelled no whole target token yet)
    full: bool = False


def build_tree(root_children: TopK, expand: Expand, shape: TreeShape) -> BuiltTree:
    tokens: list[int] = []
    parents: list[int] = []  # candidate index of the parent, -1 = root
    logp: list[float] = []
    depth: list[int] = []

    def add(children: TopK, parent: int) -> list[int]:
        base = 0.0 if parent < 0 else logp[parent]
        level = 1 if parent < 0 else depth[parent] + 1
        new = []
        for tok, lp in children[: shape.k]:
            tokens.append(tok)
            parents.append(parent)
            logp.append(base + lp)
            depth.append(level)
            new.append(len(tokens) - 1)
        return new

    def rank(i: int) -> tuple[float, int, int]:
        return (-logp[i], depth[i], i)

    frontier = add(root_children, -1)
    for _ in range(1, shape.d):
        if not frontier:
            break
        best_n = set(sorted(range(len(tokens)), key=rank)[: shape.n])
        # a frontier node outside the current best n can only have children ranked below it: skip it
        to_expand = [i for i in sorted(frontier, key=rank)[: shape.k] if i in best_n]
        if not to_expand:
            break
        kids = expand(to_expand, tokens, parents)
        frontier = [c for i, children in zip(to_expand, kids) for c in add(children, i)]

    keep = sorted(sorted(range(len(tokens)), key=rank)[: shape.n])  # candidate order is topological
    index = {c: j for j, c in enumerate(keep)}
    tree = DraftTree(tuple(tokens[c] for c in keep),
                     tuple(-1 if parents[c] < 0 else index[parents[c]] for c in keep))
    return BuiltTree(tree, tuple(keep), tuple(logp[c] for c in keep))


def first_choice_path(tree: DraftTree) -> list[int]:
    """The drafter's single best guess: from the root, always the first-ranked child, down to a leaf."""
    path, kids = [], tree.children[0]
    while kids:
        path.append(kids[0])
        kids = tree.children[kids[0] + 1]
    return path


def graft(tree: DraftTree, tokens: Sequence[int], max_nodes: int, max_depth: int) -> tuple[DraftTree, int]:
    """Merge a proposed continuation (e.g. an n-gram match) into ``tree`` as a branch: follow the existing path
    that spells its first tokens, then hang the rest below as a chain, within ``max_nodes`` / ``max_depth``.
    Existing nodes keep their indices (new ones are appended, after every existing sibling, so the drafter's
    preference order stands). Returns the tree and how many nodes were added."""
    node, depth, children = -1, 0, tree.children
    rest = list(tokens)
    while rest and depth < max_depth:
        nxt = next((c for c in children[node + 1] if tree.tokens[c] == rest[0]), None)
        if nxt is None:
            break
        node, depth, rest = nxt, depth + 1, rest[1:]
    room = min(max_nodes - len(tree), max_depth - depth, len(rest))
    if room <= 0:
        return tree, 0
    new_tokens, new_parents = list(tree.tokens), list(tree.parents)
    for tok in rest[:room]:
        new_tokens.append(tok)
        new_parents.append(node)
        node = len(new_tokens) - 1
    return DraftTree(tuple(new_tokens), tuple(new_parents)), room
