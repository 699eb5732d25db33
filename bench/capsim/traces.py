"""Acceptance traces: for every position of a target's output, how many tokens of the drafter's greedy chain
drafted there are the target's (``L[i]``, as ``bench.ceiling`` records them with the real pair): a chain of depth d
drafted at i has min(L[i], d) tokens accepted. Any chain length can be replayed from them; trees cannot (the
drafter's other candidates are not recorded), so the simulated policy drafts chains.

Files: a ``bench.ceiling`` JSON (``runs``, ``datasets``, ``prompt_tokens``), optionally with ``answer_tokens``:
the lengths of real answers (ShareGPT's, in the target's tokens) that requests draw their length from.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class Text:
    dataset: str
    prompt_tokens: int
    runs: tuple[int, ...]  # L[i] for each output position


class Traces:
    def __init__(self, texts: Sequence[Text], source: str, answer_tokens: Sequence[int] = ()):
        if not texts:
            raise ValueError(f"{source}: no texts")
        self.texts, self.source, self.answer_tokens = list(texts), source, list(answer_tokens)

    @classmethod
    def load(cls, path: str | Path, prompt_tokens: int = 200, limit: int = 0) -> "Traces":
        """``prompt_tokens``: the prompt length of texts whose file does not say; ``limit``: the first texts of
        each dataset only (0: all)."""
        d = json.loads(Path(path).read_text())
        lengths = d.get("prompt_tokens") or [prompt_tokens] * len(d["runs"])
        texts, seen = [], {}
        for ds, n, r in zip(d["datasets"], lengths, d["runs"]):
            seen[ds] = seen.get(ds, 0) + 1
            if not limit or seen[ds] <= limit:
                texts.append(Text(ds, int(n), tuple(r)))
        return cls(texts, str(path), d.get("answer_tokens", ()))

    def datasets(self) -> list[str]:
        return sorted({t.dataset for t in self.texts})

    def acceptance(self, dataset: str) -> float:
        """Share of positions whose drafter's first choice is the target's token."""
        runs = [r for t in self.texts if t.dataset == dataset for r in t.runs]
        return sum(r > 0 for r in runs) / len(runs)

    def request(self, dataset: str, tokens: int, rng: random.Random) -> Text:
        """A text of ``tokens`` positions from this dataset's texts, whole texts one after another from a random
        one on (a chain is cut where one text ends: the next text is another answer)."""
        pool = [t for t in self.texts if t.dataset == dataset]
        runs: list[int] = []
        first = rng.randrange(len(pool))
        i = first
        while len(runs) < tokens:
            t = pool[i % len(pool)]
            runs += [min(r, len(t.runs) - j) for j, r in enumerate(t.runs)]
            i += 1
        return Text(dataset, pool[first].prompt_tokens, tuple(runs[:tokens]))
