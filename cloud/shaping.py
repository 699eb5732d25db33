"""The target's distribution at the rows of one tree forward, shaped only where the acceptance walk reads it.

Penalties and logit bias (core/penalties.py) and a grammar mask (cloud/constraint.py) depend on each row's own
history: the committed tokens plus the tree path above it. The walk (cloud/acceptance.py) reads one row per level
it reaches, the root's first, so at most depth + 1 of a tree's rows are ever used: shaping every row would cost
the whole tree (a 1024-entry logit bias over 64 nodes is ~141 ms of one session's work inside everyone's batch).
``ShapedRows`` stands in for the logits matrix and shapes a row when it is indexed.
"""
from __future__ import annotations

import numpy as np

from tandem.core.penalties import History
from tandem.core.sampling import Sampling
from tandem.core.tree import DraftTree

from .constraint import GrammarMask


class ShapedRows:
    """Row r of a tree forward (0: the root, i + 1: node i) as the target distribution sees it, computed on first
    read. With a grammar, call ``close`` once the walk is done (the matcher returns to the committed tokens)."""

    def __init__(self, logits: np.ndarray, tree: DraftTree, sampling: Sampling, history: History | None,
                 grammar: GrammarMask | None):
        self._logits, self._tree, self._sampling = logits, tree, sampling
        self._history, self._grammar = history, grammar
        self._rows: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._logits)

    @property
    def shaped(self) -> int:
        """Rows computed so far."""
        return len(self._rows)

    def _path(self, row: int) -> list[int]:
        """The tokens from the root's child down to the node of ``row``."""
        path, node = [], row - 1
        while node >= 0:
            path.append(self._tree.tokens[node])
            node = self._tree.parents[node]
        return path[::-1]

    def __getitem__(self, row: int) -> np.ndarray:
        if row not in self._rows:
            path = self._path(row)
            z = self._logits[row]
            if self._history is not None:
                z = self._history.shape(z, self._sampling, path)
            if self._grammar is not None:
                allowed = self._grammar.path_mask(path)
                if allowed is not None:
                    z = np.where(allowed, z, -np.inf)
            self._rows[row] = z
        return self._rows[row]

    def close(self) -> None:
        if self._grammar is not None:
            self._grammar.rewind()
