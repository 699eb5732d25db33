"""VocabTrim: a drafter LM head over only the tokens the target actually emits.

With Qwen2.5's 151,936-id vocabulary the LM head is over a quarter of a 0.5B drafter's work per token, and most ids
are never proposed. Following the VocabTrim paper, the head vocabulary is chosen from *target-generated* text on a
calibration prompt set (not from the prompts): count the target's greedy outputs, keep the K most frequent ids (or
the fewest reaching a coverage), always keeping end-of-generation ids; unseen slots of K are filled in BPE merge
order (low ids first); the counts come from the target (``cloud.reference.emitted_counts``). The drafter then
scores only those K rows;
its top-k over K logits maps back to real ids through the sorted id array, so a token outside the set is never
proposed, and losslessness is untouched (the verifier still decides every token with the full target).

K is chosen by *held-out* coverage (``k_for_coverage``: the smallest K whose head holds a target share of the
target's tokens on prompts the ranking never saw), and a deployment keeps its head current with the traffic it
serves (``LiveVocab``: the tokens the verifier commits re-rank the head, the online-speculative-decoding idea
applied to the vocabulary; what the verifier accepts never depends on it).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np


def choose(counts: Mapping[int, float], k: int | None = None, coverage: float | None = None,
           always: Sequence[int] = (), fill_below: int = 0) -> np.ndarray:
    """Sorted int32 ids: the ``k`` most frequent (ties by smaller id), or the fewest whose counts reach
    ``coverage`` of all emitted tokens; ``always`` ids are added on top.

    A calibration set of a few thousand tokens names far fewer than 32k distinct ids. With ``fill_below`` (the
    vocabulary size) the rest of ``k`` is filled with the smallest unseen ids: byte-level BPE numbers its tokens in
    merge order, and earlier merges are the more frequent pieces of the tokenizer's training corpus, so low ids are
    the best guess of what the calibration did not see."""
    if (k is None) == (coverage is None):
        raise ValueError("choose the head vocabulary by exactly one of k or coverage")
    ranked = ranking(counts)
    if coverage is not None:
        if not 0 < coverage <= 1:
            raise ValueError(f"coverage must be in (0, 1], got {coverage}")
        # the shortest prefix of the ranking whose counts reach the coverage
        cumulative = np.cumsum([counts[t] for t in ranked])
        keep = ranked[:int(np.searchsorted(cumulative, coverage * cumulative[-1])) + 1] if ranked else []
    elif k is not None:  # (exactly one of the two is given)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        keep = ranked[:k]
        if fill_below and len(keep) < k:
            seen = set(keep)
            keep += [t for t in range(fill_below) if t not in seen][:k - len(keep)]
    return np.array(sorted(set(keep) | set(always)), dtype=np.int32)


def ranking(counts: Mapping[int, float]) -> list[int]:
    """Ids by descending count, ties by smaller id (the order ``choose`` keeps them in)."""
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def k_for_coverage(counts: Mapping[int, float], heldout: Sequence[int], target: float) -> int | None:
    """The smallest K such that the top K of ``counts``'s ranking hold ``target`` of the ``heldout`` tokens (a
    sample of the target's own output the counts did not come from), or None when even every ranked id falls
    short (held-out tokens the calibration never saw)."""
    if not 0 < target <= 1:
        raise ValueError(f"coverage target must be in (0, 1], got {target}")
    if not len(heldout):
        return 1
    rank = {t: i for i, t in enumerate(ranking(counts))}
    ranks = np.sort(np.fromiter((rank.get(t, len(rank)) for t in heldout), dtype=np.int64, count=len(heldout)))
    need = int(np.ceil(target * len(ranks)))  # tokens that must be inside: ranks[need - 1] < K
    k = int(ranks[need - 1]) + 1
    return k if k <= len(rank) else None


class LiveVocab:
    """The head vocabulary learnt from served traffic: calibration counts plus the tokens the verifier committed.

    The drafter feeds it every committed token (``observe``). It keeps the share of them the current head missed over
    the last ``window`` tokens; when that share exceeds ``1 - target`` (the head no longer covers the traffic as
    well as calibration promised), ``due`` is true and ``vocab`` gives a new head of the same size, ranked by
    calibration counts plus live counts x ``live_weight`` (a committed token is the target's own output on real
    traffic: worth more than a calibration token). Pure bookkeeping: the drafter decides when to rebuild."""

    def __init__(self, counts: Counter, ids: np.ndarray, target: float = 0.98, window: int = 4096,
                 live_weight: float = 4.0, always: Sequence[int] = (), n_vocab: int = 0):
        self.base = Counter(counts)
        self.n_vocab = n_vocab  # fills a head the counts cannot (see ``choose``)
        self.live: Counter = Counter()
        self.target, self.window, self.live_weight = target, window, live_weight
        self.always = tuple(always)
        self.set_ids(ids)

    def set_ids(self, ids: np.ndarray) -> None:
        self.ids = np.asarray(ids, dtype=np.int32)
        self._inside = set(self.ids.tolist())
        self._recent: list[bool] = []  # per committed token since the head changed: was it outside the head?

    def observe(self, tokens: Sequence[int]) -> None:
        self.live.update(tokens)
        self._recent.extend(t not in self._inside for t in tokens)
        if len(self._recent) > self.window:
            del self._recent[:len(self._recent) - self.window]

    @property
    def miss_rate(self) -> float:
        return sum(self._recent) / len(self._recent) if self._recent else 0.0

    @property
    def due(self) -> bool:
        """A full window of traffic seen since the head last changed, and the head misses more of it than the target
        allows (a full window, so traffic no head of this size covers rebuilds once per window at most)."""
        return len(self._recent) >= self.window and self.miss_rate > 1 - self.target

    def vocab(self) -> np.ndarray:
        merged: dict[int, float] = dict(self.base)  # (weighted: not a Counter's whole counts)
        for t, c in self.live.items():
            merged[t] = merged.get(t, 0) + c * self.live_weight
        k = max(1, len(self.ids) - len(set(self.always) & self._inside))  # the same size as the head it replaces
        return choose(merged, k=k, always=self.always, fill_below=self.n_vocab)


def coverage(ids: np.ndarray, tokens: Sequence[int]) -> float:
    """Fraction of ``tokens`` inside the head vocabulary ``ids``."""
    if not len(tokens):
        return 1.0
    inside = np.isin(np.asarray(tokens), ids)
    return float(inside.mean())


def save(ids: np.ndarray, path: str | Path, counts: Mapping[int, float] | None = None) -> None:
    """The head's ids at ``path`` (.npy); with ``counts`` (the calibration counts it was ranked by) also a sidecar
    ``<stem>.counts.npy`` that ``LiveVocab`` re-ranks from."""
    path = Path(path)
    np.save(path, np.asarray(ids, dtype=np.int32))
    if counts is not None:
        np.save(_counts_path(path), np.array([list(counts.keys()), list(counts.values())], dtype=np.float64))


def _counts_path(path: Path) -> Path:
    return path.with_name(f"{path.name.removesuffix('.npy')}.counts.npy")


def load_counts(path: str | Path) -> Counter | None:
    """The calibration counts saved next to a head vocabulary, or None when there are none."""
    side = _counts_path(Path(path))
    if not side.is_file():
        return None
    ids, counts = np.load(side)
    return Counter(dict(zip(ids.astype(np.int64).tolist(), counts.tolist())))


def load(path: str | Path, vocab_size: int) -> np.ndarray:
    ids = np.load(Path(path))
    if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= vocab_size or np.any(np.diff(ids) <= 0):
        raise ValueError(f"{path}: a head vocabulary must be sorted unique ids in [0, {vocab_size})")
    return ids.astype(np.int32)
