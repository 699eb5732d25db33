"""Acceptance maths: which draft nodes the target accepts, and the bonus token.

Vocabulary (used the same way everywhere in Tandem):

- ``p``: the target distribution at a tree position, i.e. softmax(logits / temperature) restricted by top-k then
  top-p and renormalised (``core.sampling.warp``). Row 0 of a logits matrix is the root (the last committed token),
  row i+1 is tree node i; the distribution in row r is over the token that *follows* that position.
- target token: the target's own choice at a position: ``argmax p`` when greedy, else the inverse CDF of p at the
  position's draw u_t (``core.sampling``: one uniform per committed position, keyed by the session).
- accepted tokens: the tree nodes on the path the target agrees with, root to deepest.
- bonus token: the target's own token after the accepted path; every verify forward commits at least this one.
- tau: committed tokens per verify forward = len(accepted) + 1.
- alpha_d: the fraction of rounds reaching depth d-1 in which a depth-d node was accepted.

The rule, greedy and sampled alike: walk from the root; at each node take the target token x at that position;
if a child carries x, accept it and walk on; otherwise stop, and x is the bonus.

Why it is exact: the committed token at every position is the target token, i.e. exactly what target-only decoding
with the same draws commits; the tree only decides how many positions one forward settles. For sampling this
needs the draw at position t to be independent of the tree judged there, which holds because u_t is a keyed hash
of t, independent of the draws that produced every earlier token and hence of anything built from them.

It accepts as often as the multi-draft point-mass rule (EAGLE-2 with point-mass proposals): some child of a node
is accepted with probability sum_i p[x_i] under both. But it needs no stream of draws whose consumption depends on
the tree, so resumes, retries and trees drafted ahead can never replay or bias a draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from tandem.core.sampling import Sampling, target_token
from tandem.core.tree import DraftTree


class Rows(Protocol):
    """A forward's logits rows, or anything that yields row r when indexed (cloud.shaping computes rows lazily)."""

    def __getitem__(self, row: int) -> np.ndarray: ...


@dataclass(frozen=True)
class Acceptance:
    accepted: tuple[int, ...]  # node indices, root's child first
    bonus: int  # token id

    def committed_tokens(self, tree: DraftTree) -> list[int]:
        return [tree.tokens[i] for i in self.accepted] + [self.bonus]


def accept(
    tree: DraftTree, logits: np.ndarray | Rows, sampling: Sampling, uniform: Callable[[int], float] = lambda depth: 0.0
) -> Acceptance:
    """Walk the tree along the target's tokens; ``logits[0]`` is the root row, ``logits[i + 1]`` node i's row. Only
    the rows on the walked path are read (one per level reached). ``uniform(d)``: the draw for the token d levels
    below the root (unused when greedy)."""
    node, accepted = -1, list[int]()
    while True:
        x = target_token(logits[node + 1], sampling, 0.0 if sampling.greedy else uniform(len(accepted)))
        nxt = next((c for c in tree.children[node + 1] if tree.tokens[c] == x), None)
        if nxt is None:
            return Acceptance(tuple(accepted), x)
        accepted.append(nxt)
        node = nxt
