"""VocabTrim: a drafter LM head over only the tokens the target actually emits.

With Qwen2.5's 151,936-id vocabulary the LM head is over a quarter of a 0.5B drafter's work per token, and most ids
are never proposed. Following the VocabTrim paper, the head vocabulary is chosen from *target-generated* text on a
calibration prompt set (not from the prompts): count the target's greedy outputs, keep the K most frequent ids (or
the fewest reaching a coverage), always keeping end-of-generation ids; unseen slots of K are filled in BPE merge
order (low ids first); the counts come from the target (``cloud.reference.emitted_counts``). The drafter then
scores only those K rows;
its top-k over K logits maps back to real ids through the sorted id array, so a token outside the set is never
proposed, and losslessness is untouched (the verifier still decides every token with the full target).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np


def choose(counts: Counter, k: int | None = None, coverage: float | None = None,
           always: Sequence[int] = (), fill_below: int = 0) -> np.ndarray:
    """Sorted int32 ids: the ``k`` most frequent (ties by smaller id), or the fewest whose counts reach
    ``coverage`` of all emitted tokens; ``always`` ids are added on top.

    A calibration set of a few thousand tokens names far fewer than 32k distinct ids. With ``fill_below`` (the
    vocabulary size) the rest of ``k`` is filled with the smallest unseen ids: byte-level BPE numbers its tokens in
    merge order, and earlier merges are the more frequent pieces of the tokenizer's training corpus, so low ids are
    the best guess of what the calibration did not see."""
    if (k is None) == (coverage is None):
        raise ValueError("choose the head vocabulary by exactly one of k or coverage")
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    if coverage is not None:
        if not 0 < coverage <= 1:
            raise ValueError(f"coverage must be in (0, 1], got {coverage}")
        # the shortest prefix of the ranking whose counts reach the coverage
        cumulative = np.cumsum([counts[t] for t in ranked])
        keep = ranked[:int(np.searchsorted(cumulative, coverage * cumulative[-1])) + 1] if ranked else []
    else:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        keep = ranked[:k]
        if fill_below and len(keep) < k:
            seen = set(keep)
            keep += [t for t in range(fill_below) if t not in seen][:k - len(keep)]
    return np.array(sorted(set(keep) | set(always)), dtype=np.int32)


def coverage(ids: np.ndarray, tokens: Sequence[int]) -> float:
    """Fraction of ``tokens`` inside the head vocabulary ``ids``."""
    if not len(tokens):
        return 1.0
    inside = np.isin(np.asarray(tokens), ids)
    return float(inside.mean())


def save(ids: np.ndarray, path: str | Path) -> None:
    np.save(Path(path), np.asarray(ids, dtype=np.int32))


def load(path: str | Path, vocab_size: int) -> np.ndarray:
    ids = np.load(Path(path))
    if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= vocab_size or np.any(np.diff(ids) <= 0):
        raise ValueError(f"{path}: a head vocabulary must be sorted unique ids in [0, {vocab_size})")
    return ids.astype(np.int32)
