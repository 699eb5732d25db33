"""The VocabTrim calibration corpus: which token ids a drafter head keeps, counted on a large declared corpus.

A head vocabulary chosen from a few thousand target tokens (40 prompts' greedy outputs) cost 10-20 % of tau at
16-32k ids: the ranking beyond the few thousand ids it had seen was a guess. The corpus here is millions of
tokens, declared and reproducible offline:

- chat: the assistant turns of ~12k ShareGPT conversations (``datasets.sharegpt_replies``; 17.8 MB of real
  chat-model output, disjoint from every prompt set the benches and tests use);
- code: the Python standard library's own sources (~12 MB; the interpreter's, so no download);
- the target's own greedy outputs on calibration prompts, scaled to ``target_share`` of the merged mass: the one
  part written by the model whose tokens the head must cover.

Corpus counts are cached per tokenizer (``$TANDEM_CACHE/vocabtrim/``). The size of the head is then chosen by
coverage of the target's outputs on held-out prompts (``edge.vocabtrim.k_for_coverage``).
"""
from __future__ import annotations

import json
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from tandem.core.cache import cache_dir

from tandem.edge import vocabtrim

from .datasets import sharegpt_replies

CORPUS_VERSION = 1  # bump when the corpus changes: cached counts are then recounted
STDLIB_EXCLUDE = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}


def stdlib_sources(max_bytes: int = 12_000_000) -> list[str]:
    """The interpreter's standard-library Python sources (tests excluded), in path order, up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if STDLIB_EXCLUDE & set(path.relative_to(root).parts):
            continue
        text = path.read_text("utf-8", errors="ignore")
        if total + len(text) > max_bytes:
            break
        out.append(text)
        total += len(text)
    return out


def count_tokens(tokenize: Callable[[str], Sequence[int]], texts: Sequence[str], chunk_chars: int = 200_000,
                 progress: Callable[[int, int], None] | None = None) -> Counter:
    """Token counts of ``texts``, tokenized in chunks of about ``chunk_chars`` (joined by blank lines)."""
    counts: Counter = Counter()
    batch: list[str] = []
    size = done = 0
    for i, text in enumerate(texts):
        batch.append(text)
        size += len(text)
        if size >= chunk_chars or i == len(texts) - 1:
            ids = np.asarray(tokenize("\n\n".join(batch)), dtype=np.int64)
            uniq, n = np.unique(ids, return_counts=True)
            counts.update(dict(zip(uniq.tolist(), n.tolist())))
            done += size
            batch, size = [], 0
            if progress:
                progress(i + 1, len(texts))
    return counts


def _progress_of(progress: Callable[[str], None], name: str) -> Callable[[int, int], None]:
    """``count_tokens``' progress (i of n texts) as lines naming the source."""
    return lambda i, n: progress(f"{name} {i}/{n}")


def corpus_counts(tokenizer, progress: Callable[[str], None] | None = None) -> tuple[Counter, dict]:
    """(counts, description) of the declared corpus under ``tokenizer`` (llama_runtime.LlamaModel: ``tokenize``,
    ``vocab_fingerprint``), counted once and cached."""
    key = f"{tokenizer.vocab_fingerprint[:16]}-py{sys.version_info[0]}{sys.version_info[1]}-v{CORPUS_VERSION}"
    path = cache_dir() / "vocabtrim" / f"corpus-{key}.npz"
    if path.is_file():
        data = np.load(path)
        return Counter(dict(zip(data["ids"].tolist(), data["counts"].tolist()))), json.loads(str(data["meta"]))
    t0 = time.perf_counter()
    counts: Counter = Counter()
    meta: dict[str, Any] = {"sources": {}}
    for name, texts in (("sharegpt_replies", sharegpt_replies()), ("python_stdlib", stdlib_sources())):
        counted = None if progress is None else _progress_of(progress, name)
        part = count_tokens(lambda s: tokenizer.tokenize(s, special=False), texts, progress=counted)
        meta["sources"][name] = {"texts": len(texts), "chars": sum(map(len, texts)), "tokens": sum(part.values())}
        counts.update(part)
    meta["tokens"] = sum(counts.values())
    meta["distinct"] = len(counts)
    meta["count_s"] = round(time.perf_counter() - t0, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    tmp = path.with_suffix(".partial.npz")
    np.savez(tmp, ids=ids, counts=np.fromiter(counts.values(), dtype=np.int64, count=len(counts)),
             meta=json.dumps(meta))
    tmp.replace(path)
    return counts, meta


def merge(corpus: Counter, target_outputs: Counter, target_share: float = 0.25) -> dict[int, float]:
    """Corpus counts plus the target's own output counts scaled to ``target_share`` of the merged mass (floats)."""
    if not 0 <= target_share < 1:
        raise ValueError(f"target_share must be in [0, 1), got {target_share}")
    merged = {t: float(c) for t, c in corpus.items()}
    n_corpus, n_target = sum(corpus.values()), sum(target_outputs.values())
    if n_target and target_share:
        scale = target_share / (1 - target_share) * n_corpus / n_target if n_corpus else 1.0
        for t, c in target_outputs.items():
            merged[t] = merged.get(t, 0.0) + c * scale
    return merged


def k_by_coverage(corpus: Counter, outputs: Sequence[Sequence[int]], target: float,
                  target_share: float = 0.25) -> int | None:
    """The head size for ``target`` coverage of the target's own tokens, by two-fold cross-validation over its
    outputs on calibration prompts (``outputs``, one list per prompt): each half is covered by the ranking the
    other half makes with the corpus (``merge``), the way the final head ranks all of them; the larger K of the
    two, or None when a fold cannot reach ``target`` at all."""
    folds = [[t for o in outputs[i::2] for t in o] for i in (0, 1)]
    ks = []
    for held, other in ((folds[0], folds[1]), (folds[1], folds[0])):
        if not held:
            continue
        k = vocabtrim.k_for_coverage(merge(corpus, Counter(other), target_share), held, target)
        if k is None:
            return None
        ks.append(k)
    return max(ks) if ks else None
