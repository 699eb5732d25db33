"""The checks the lossless tests make, in one place, so that tests/test_mutants.py runs the very same checks on
planted bugs and sees them fail.

- ``audited``: every verify forward's acceptance is walked again, independently, along the target's own token of
  each row the verifier computed (argmax, or the inverse CDF at the position's draw): a committed token that is not
  the target's own is caught exactly, whatever the numerics (the algorithmic half of losslessness).
- the verdicts against target-only decoding on the same engine (``cloud.reference``): exact on a deterministic
  engine, within measured batch-shape noise otherwise (the numerical half).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence
from unittest import mock

import numpy as np

from tandem.cloud import reference
from tandem.cloud import session as session_module
from tandem.core.sampling import Sampling, target_token
from tandem.core.tree import DraftTree


def own_walk(tree: DraftTree, rows, sampling: Sampling, uniform: Callable[[int], float]) -> tuple[tuple[int, ...], int]:
    """(accepted nodes, bonus) of the rule in docs/design.md, written again: at each node the target's own token of
    its row; a child carrying it is accepted and the walk goes on, else that token is the bonus."""
    node, accepted = -1, []
    while True:
        row = np.asarray(rows[node + 1])
        x = int(np.argmax(row)) if sampling.greedy else target_token(row, sampling, uniform(len(accepted)))
        child = next((c for c in tree.children[node + 1] if tree.tokens[c] == x), None)
        if child is None:
            return tuple(accepted), x
        accepted.append(child)
        node = child


class AcceptanceAudit:
    """What the audit saw: forwards walked, and every one whose acceptance differed from ``own_walk``."""

    def __init__(self) -> None:
        self.forwards = 0
        self.wrong: list[str] = []

    def wrap(self, accept):
        def audited(tree, rows, sampling, uniform=lambda depth: 0.0):
            acc = accept(tree, rows, sampling, uniform)
            want = own_walk(tree, rows, sampling, uniform)
            self.forwards += 1
            if (acc.accepted, acc.bonus) != want:
                self.wrong.append(f"forward {self.forwards}: accepted {acc.accepted} + bonus {acc.bonus}, the "
                                  f"target's own walk gives {want[0]} + bonus {want[1]}")
            return acc
        return audited

    def check(self) -> None:
        assert self.forwards > 0, "the audit saw no verify forward"
        assert not self.wrong, f"{len(self.wrong)} of {self.forwards} forwards committed tokens that are not the " \
                               f"target's own: {self.wrong[:3]}"


@contextmanager
def audited() -> Iterator[AcceptanceAudit]:
    """Audit every acceptance the verifier in this process makes while the block runs."""
    audit = AcceptanceAudit()
    with mock.patch.object(session_module, "accept", audit.wrap(session_module.accept)):
        yield audit


def greedy_verdicts(outputs: Sequence[Sequence[int]], refs: Sequence[reference.Reference],
                    noise: float | None) -> list[reference.Comparison]:
    """Each greedy output against its target-only reference: ``noise`` None means a deterministic engine, where
    anything but the reference's exact tokens is a failure."""
    if noise is None:
        return [reference.Comparison("exact") if list(o) == list(r.tokens) else
                reference.Comparison("other", next((i for i, (a, b) in enumerate(zip(o, r.tokens)) if a != b),
                                                   min(len(o), len(r.tokens))), "deterministic: no near-tie")
                for o, r in zip(outputs, refs)]
    return [reference.classify(o, r, noise) for o, r in zip(outputs, refs)]


def check_verdicts(verdicts: Sequence[reference.Comparison]) -> None:
    bad = [(i, str(v)) for i, v in enumerate(verdicts) if not v.ok]
    assert not bad, f"outputs that are not the target's: {bad}"
