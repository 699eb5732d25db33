"""History-dependent shaping of the target's logits: presence, frequency and repetition penalties and logit bias.

The target distribution at a position is ``warp(shape(logits, history), sampling)``, where ``history`` is what
precedes that position: the prompt and the output so far. In a draft tree the history of row r (the root, or node
i) is the committed history *plus the tree path down to that node*, so every row is shaped by its own path, and
speculative output stays exactly the modified target's (the same function of the same history as target-only
decoding, cloud/reference.py). Definitions (vLLM's and OpenAI's, applied in this order):

- repetition penalty rp (tokens in the prompt or the output): z / rp where z > 0, z * rp where z <= 0;
- frequency and presence penalties (output tokens only, count c > 0): z - c * frequency - presence;
- logit bias: z + bias[token].

A resumed session's prompt ends with the generation's earlier output (``prior_output`` tokens of it), which still
counts as output, so a resume never changes what the penalties see.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

from .sampling import Sampling
from .tree import DraftTree


class History:
    """The tokens before the next position: output counts and every token seen (prompt + output)."""

    def __init__(self, prompt: Sequence[int], prior_output: int = 0):
        prior_output = min(max(prior_output, 0), len(prompt))
        self.output: Counter[int] = Counter(prompt[len(prompt) - prior_output :])
        self.seen: set[int] = set(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        self.output.update(tokens)
        self.seen.update(tokens)

    def shape(self, logits_row: np.ndarray, sampling: Sampling, path: Sequence[int] = ()) -> np.ndarray:
        """The shaped row (a float64 copy) for the position after this history plus ``path``."""
        z = np.array(logits_row, dtype=np.float64)
        out = self.output + Counter(path) if path else self.output
        if sampling.repetition_penalty != 1.0:
            ids = np.fromiter(self.seen.union(path), dtype=np.int64)
            v = z[ids]
            z[ids] = np.where(v > 0, v / sampling.repetition_penalty, v * sampling.repetition_penalty)
        if (sampling.presence_penalty or sampling.frequency_penalty) and out:
            ids = np.fromiter(out.keys(), dtype=np.int64, count=len(out))
            counts = np.fromiter(out.values(), dtype=np.float64, count=len(out))
            z[ids] -= counts * sampling.frequency_penalty + sampling.presence_penalty
        if sampling.logit_bias:
            ids = np.array([t for t, _ in sampling.logit_bias], dtype=np.int64)
            z[ids] += np.array([b for _, b in sampling.logit_bias])
        return z

    def shape_tree(self, logits: np.ndarray, tree: DraftTree, sampling: Sampling) -> np.ndarray:
        """Shape every row of a tree forward: row 0 (the root) on this history, row i + 1 on it plus the path to
        node i (root's child first)."""
        paths: list[tuple[int, ...]] = []
        for i, parent in enumerate(tree.parents):
            paths.append((paths[parent] if parent >= 0 else ()) + (tree.tokens[i],))
        return np.stack(
            [self.shape(logits[0], sampling)] + [self.shape(logits[i + 1], sampling, p) for i, p in enumerate(paths)]
        )
