"""The target's token ids past the drafter's vocabulary: a target that pads its family's vocabulary.

Qwen2.5 from 7B up has 152,064 ids, the 0.5B drafter 151,936: the same tokenizer, the extra ids padding. The
verifier accepts such a drafter when the drafter's ids carry the target's texts (its fingerprint over the
drafter's ids, ``cloud.session.check_vocabulary``) and sends, in ``Opened.extra_pieces``, what each extra id
renders as. Drafts only ever name the drafter's ids, but the target may commit an extra one (a padding id is
untrained and practically never wins; an added special token can), and the edge must then show it and go on
drafting after it.

The drafter's history mirrors the committed tokens one for one (``edge.rounds``' invariant: it is
``committed[:drafter_len]``), so an extra id is replaced in what the drafter sees, not dropped: by the drafter's
first token of the same text, or its token for a space when the text is empty (padding renders as nothing). What
stands in changes only what is drafted after it; every committed token is still the verifier's.
"""
from __future__ import annotations

from typing import Sequence

from .drafter import Tokenizer
from .actions import Job


class ExtraIds:
    def __init__(self, tokenizer: Tokenizer, pieces: Sequence[bytes]):
        self.base = tokenizer.n_vocab  # the first extra id
        self.pieces = tuple(pieces)
        space = tokenizer.tokenize(" ", special=False)[:1] or [0]
        self.stand_in = tuple((tokenizer.tokenize(p.decode("utf-8", errors="replace"), special=False)[:1]
                               or space)[0] for p in self.pieces)

    def piece(self, tokenizer: Tokenizer, token: int) -> bytes:
        """What ``token`` renders as: the drafter's own text below ``base``, the target's above."""
        if token < self.base:
            return tokenizer.piece(token)
        if token - self.base >= len(self.pieces):
            raise ValueError(f"token id {token} is past the target's vocabulary of {self.base + len(self.pieces)}")
        return self.pieces[token - self.base]

    def to_drafter(self, tokens: Sequence[int]) -> list[int]:
        return [t if t < self.base else self.stand_in[t - self.base] for t in tokens]

    def job(self, job: Job) -> Job:
        """``job`` with every committed token the drafter is fed in its own ids."""
        ops = []
        for op in job.ops:
            if op[0] in ("start", "extend"):
                op = (op[0], self.to_drafter(op[1]))
            elif op[0] == "commit":
                op = (op[0], op[1], op[2], self.to_drafter(op[3]))
            ops.append(op)
        return Job(job.tag, tuple(ops))
