"""The verifier host's drafters (``cloud.host_drafting.HostDrafter``) made of the edge's own drafters: the same
GGUF/ONNX drafter a device runs, here on the host's CPU cores beside the verifier, one chain at a time each.

Each drafter keeps the cells of the last history it drafted on, so a session's next chain evaluates only the tokens
committed since its last one: a chain goes to the free drafter whose last history was of the same cache partition and
shares the longest prefix with it. A drafter last used by another partition forgets every cell first, so which
drafter a session gets, and how fast it drafts, says nothing of another tenant's text.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Sequence

from tandem.core.model_id import file_sha256
from tandem.core.tree import TreeShape, common_prefix
from tandem.edge.drafter import Drafter
from tandem.edge.drafting import first_choice_path


class HostDrafters:
    """``HostDrafter`` over ``drafters`` (one per worker slot)."""

    def __init__(self, drafters: Sequence[Drafter], model_path: str | Path):
        if not drafters:
            raise ValueError("host drafting needs at least one drafter")
        path = Path(model_path)
        self.name = f"{path.name}@{file_sha256(path)[:12]}" if path.is_file() else str(model_path)
        self.slots = len(drafters)
        self.drafters = list(drafters)
        self._lock = threading.Lock()
        self._free = list(drafters)  # the one free the longest first
        self._last: dict[int, tuple[str, tuple[int, ...]]] = {}  # id(drafter) -> (partition, history) it drafted on

    def draft(self, partition: str, tokens: Sequence[int], depth: int) -> list[int]:
        tokens = tuple(tokens)
        with self._lock:
            drafter, same = self._take(partition, tokens)
        try:
            if not same:
                drafter.start([])  # another partition's cells: none of them may serve this one
            drafter.start(tokens)  # keeps the cells of its last history that ``tokens`` starts with
            if len(tokens) + depth >= drafter.n_ctx:
                return []
            drafter.catch_up()
            if depth < 1:  # a catch-up alone (a prompt, evaluated while the target prefills it)
                return []
            built = drafter.draft(TreeShape(1, depth, depth))
            return [built.tree.tokens[i] for i in first_choice_path(built.tree)][:depth]
        finally:
            with self._lock:
                self._last[id(drafter)] = (partition, tokens)
                self._free.append(drafter)

    def _take(self, partition: str, tokens: tuple[int, ...]) -> tuple[Drafter, bool]:
        """The free drafter that holds the most of ``tokens`` from ``partition``, else the one free the longest;
        and whether its cells are ``partition``'s. (``slots`` workers call at most ``slots`` at once: one is free.)"""
        best, shared = 0, -1
        for i, d in enumerate(self._free):
            last = self._last.get(id(d))
            if last is not None and last[0] == partition and (n := common_prefix(last[1], tokens)) > shared:
                best, shared = i, n
        drafter = self._free.pop(best)
        last = self._last.get(id(drafter))
        return drafter, last is not None and last[0] == partition
