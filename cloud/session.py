"""A verifier session: request validation, limits, acceptance and finish rules around one engine sequence.

Domain only: no protobuf here. Errors are the ``VerifierError`` subclasses below, which the gRPC servicer maps to
status codes; every check runs before any compute or cache change, so a rejected request changes nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from enum import Enum
from typing import Sequence

import numpy as np

from .acceptance import Acceptance, Sampling, accept
from .engine import VerifierEngine
from .tree import DraftTree, TreeError, validate


class VerifierError(Exception):
    """Base of request errors; the message is meant for the person who wrote the client."""


class InvalidRequest(VerifierError):
    pass


class UnknownSession(VerifierError):
    pass


class StaleDraft(VerifierError):
    pass


class Refused(VerifierError):
    """The request is valid but this replica does not fit it (model/vocabulary mismatch)."""


class Exhausted(VerifierError):
    """Capacity: too many sessions on this replica."""


class Finish(Enum):
    NONE = 0
    STOP = 1  # end-of-generation token
    LENGTH = 2  # max_new_tokens


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int = 0
    max_tree_nodes: int = 64
    max_tree_depth: int = 16


@dataclass(frozen=True)
class Verdict:
    accepted: tuple[int, ...]
    bonus: int  # -1 when an accepted node already finished the session
    committed_len: int
    finish: Finish
    queue_us: int = 0
    verify_us: int = 0


@dataclass
class VerifierSession:
    """One generation on one engine sequence. Create with ``open_session``."""

    engine: VerifierEngine
    seq: object
    sampling: Sampling
    limits: Limits
    prompt_len: int
    committed: list[int]
    rng: np.random.Generator
    finish: Finish = Finish.NONE
    prefill_us: int = 0
    closed: bool = False

    @property
    def committed_len(self) -> int:
        return len(self.committed)

    @property
    def generated(self) -> int:
        return len(self.committed) - self.prompt_len

    def check_draft(self, committed_len: int, tree: DraftTree) -> None:
        """Everything that can be wrong with a draft, checked before any compute."""
        self.check_state(committed_len)
        try:
            validate(tree, self.engine.vocab_size, self.limits.max_tree_nodes, self.limits.max_tree_depth)
        except TreeError as e:
            raise InvalidRequest(f"invalid draft tree: {e}") from None

    def check_state(self, committed_len: int) -> None:
        """The session half of ``check_draft``: open, unfinished, and at the committed length the draft assumes."""
        if self.closed:
            raise UnknownSession("session is closed; open a new session")
        if self.finish is not Finish.NONE:
            raise InvalidRequest(f"session already finished ({self.finish.name.lower()}); close it")
        if committed_len != self.committed_len:
            raise StaleDraft(f"draft assumes committed length {committed_len}, the verifier has "
                             f"{self.committed_len}; rebuild the draft on the latest verdict")

    def verify(self, committed_len: int, tree: DraftTree, queue_us: int = 0) -> Verdict:
        """Check, forward alone, apply. The scheduler does the same with many sessions in one forward."""
        self.check_draft(committed_len, tree)
        t0 = time.perf_counter_ns()
        logits = self.engine.forward_tree(self.seq, self.committed[-1], tree)
        return self.apply(tree, logits, queue_us, t0)

    def apply(self, tree: DraftTree, logits: np.ndarray, queue_us: int, t0_ns: int) -> Verdict:
        """Acceptance over this session's logits rows, cache pruned to the accepted path, finish rules."""
        acc: Acceptance = accept(tree, logits, self.sampling, self.rng)
        self.engine.keep_path(self.seq, tree, acc.accepted)
        new = acc.committed_tokens(tree)
        # finish rules: stop at the first end-of-generation token, and at max_new_tokens
        accepted, bonus = list(acc.accepted), acc.bonus
        room = self.limits.max_new_tokens - self.generated
        for i, tok in enumerate(new):
            if self.engine.is_eog(tok) or i + 1 >= room:
                self.finish = Finish.STOP if self.engine.is_eog(tok) else Finish.LENGTH
                new = new[: i + 1]
                if i < len(accepted):
                    accepted, bonus = accepted[: i + 1], -1
                break
        self.committed.extend(new)
        verify_us = (time.perf_counter_ns() - t0_ns) // 1000
        return Verdict(tuple(accepted), bonus, self.committed_len, self.finish, queue_us, verify_us)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.release(self.seq)


def grant_limits(engine: VerifierEngine, requested: Limits, server_max: Limits, prompt_len: int) -> Limits:
    """Cap the client's request by the server's maxima and the context: prompt + generated + one tree <= n_ctx."""
    nodes = min(requested.max_tree_nodes or server_max.max_tree_nodes, server_max.max_tree_nodes,
                engine.max_tree_nodes)
    depth = min(requested.max_tree_depth or server_max.max_tree_depth, server_max.max_tree_depth, nodes)
    room = engine.n_ctx - prompt_len - depth - 1
    new = min(requested.max_new_tokens or room, room)
    if server_max.max_new_tokens:
        new = min(new, server_max.max_new_tokens)
    return Limits(new, nodes, depth)


def open_session(engine: VerifierEngine, prompt: Sequence[int], sampling: Sampling, requested: Limits,
                 server_max: Limits, vocab_size: int = 0, vocab_fingerprint: str = "",
                 target_model: str = "") -> VerifierSession:
    """Validate an open request, then prefill. Raises ``VerifierError`` before touching the engine."""
    if target_model and target_model != engine.model_id:
        raise Refused(f"this replica serves {engine.model_id!r}, the client asked for {target_model!r}")
    if vocab_size and vocab_size != engine.vocab_size:
        raise Refused(f"vocabulary size {vocab_size} does not match the target's {engine.vocab_size}; the drafter "
                      f"must share the target's tokenizer")
    if vocab_fingerprint and vocab_fingerprint != engine.vocab_fingerprint:
        raise Refused("vocabulary fingerprint differs from the target's: same size but different token texts; "
                      "the drafter must share the target's tokenizer")
    if not prompt:
        raise InvalidRequest("prompt_tokens is empty; send at least one token")
    bad = next((t for t in prompt if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {engine.vocab_size})")
    if sampling.temperature < 0 or not 0 <= sampling.top_p <= 1 or sampling.top_k < 0:
        raise InvalidRequest(f"sampling needs temperature >= 0, 0 <= top_p <= 1, top_k >= 0; got {sampling}")
    if sampling.top_p == 0:
        sampling = replace(sampling, top_p=1.0)  # proto default: unset means disabled
    limits = grant_limits(engine, requested, server_max, len(prompt))
    if limits.max_new_tokens < 1:
        raise InvalidRequest(f"prompt of {len(prompt)} tokens does not fit the context of {engine.n_ctx} tokens "
                             f"(with room for one token and a tree of depth {limits.max_tree_depth}); shorten it")
    t0 = time.perf_counter_ns()
    seq = engine.new_sequence()
    try:
        engine.prefill(seq, prompt[:-1])
    except Exception:
        engine.release(seq)
        raise
    return VerifierSession(engine=engine, seq=seq, sampling=sampling, limits=limits, prompt_len=len(prompt),
                           committed=list(prompt), rng=np.random.default_rng(sampling.seed),
                           prefill_us=(time.perf_counter_ns() - t0) // 1000)
