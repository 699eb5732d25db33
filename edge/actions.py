"""What the round loop (edge/rounds.py) asks its transport (edge/client.py) to do: messages to send to the verifier
(``SendOpen``, ``SendDraft``, ``SendClose``), drafter jobs to run one at a time in order (``Job``), and committed
tokens to hand to the user (``Emit``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.core.messages import DraftRequest


@dataclass(frozen=True)
class SendOpen:
    prompt: tuple[int, ...]
    max_new_tokens: int
    decode_steps: int
    prior_output: int = 0  # the prompt's last tokens that are already this generation's output (a resume)
    host_draft: bool = False  # the verifier's host drafts the tokens it decodes alone


@dataclass(frozen=True)
class SendDraft:
    draft: DraftRequest


@dataclass(frozen=True)
class SendClose:
    pass


@dataclass(frozen=True)
class Job:
    """Drafter operations to run in order on the drafter's thread; the result of the last one comes back to
    ``on_job_done`` with ``tag``. Ops: ("start", prompt), ("catch_up",), ("extend", tokens),
    ("commit", built, path, tokens), ("draft", shape), ("speculate", built, path, shape), ("adopt",)."""

    tag: int
    ops: tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class Emit:
    tokens: tuple[int, ...]


Action = SendOpen | SendDraft | SendClose | Job | Emit
