"""A verifier session: request validation, limits, rebasing, acceptance and finish rules around one engine sequence.

Domain only: no protobuf here. Errors are the ``VerifierError`` subclasses below, which the gRPC servicer maps to
status codes; every check runs before any compute or cache change, so a rejected request changes nothing.

A draft names the committed length its tree hangs below. The verifier may have committed more since (tokens it
decoded alone while the draft was being made or was on its way): the tree is then *rebased*, i.e. walked along
those tokens, and the subtree below the node reached is verified. A draft made ahead of a verdict also lists the
tokens it assumed (``assumed``); if the verifier committed other tokens, or fewer, or the walk leaves the tree,
the draft is *stale* and the verifier decodes one token alone instead, so every draft still commits a token.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence, cast

import numpy as np

from tandem.core.penalties import History
from tandem.core.messages import (EMPTY, HASH_START, MAX_TOP_LOGPROBS, DraftRequest, Finish, Limits, TokenLogprobs,
                                  Verdict, extend_hash)
from tandem.core.sampling import Draws, Sampling, SamplingError, logprobs
from tandem.core.tree import DraftTree, TreeError, subtree, validate, walk

from .acceptance import Acceptance, accept
from .constraint import GrammarMask
from .engines.engine import ChunkedPrefillEngine, VerifierEngine
from .shaping import ShapedRows
from .learning.teacher import TeacherSession
from tandem.core.errors import TandemError

__all__ = ["DraftRequest", "Exhausted", "Finish", "InvalidRequest", "Job", "Limits", "Refused", "UnknownSession",
           "Verdict", "VerifierError", "VerifierSession", "check_open", "check_vocabulary", "extra_pieces",
           "grant_limits", "open_session"]

# ids a padded target may have past its drafter's: padding to a multiple of 128 or 256, plus a few added tokens
# (Qwen2.5-7B: 128). Each costs its rendered bytes in every Opened.
MAX_EXTRA_IDS = 4096


class VerifierError(TandemError):
    """Base of request errors; the message is meant for the person who wrote the client."""


class InvalidRequest(VerifierError):
    pass


class UnknownSession(VerifierError):
    pass


class Refused(VerifierError):
    """The request is valid but this replica does not fit it (model/vocabulary mismatch)."""


class Exhausted(VerifierError):
    """Capacity: too many sessions on this replica."""


@dataclass(frozen=True)
class Job:
    """What one forward verifies for a session: ``tree`` below the last committed token, whose node j is node
    ``nodes[j]`` of the draft's tree; ``rebased`` draft levels were already committed, ``stale``: none usable."""
    request: DraftRequest
    tree: DraftTree
    nodes: tuple[int, ...]
    rebased: int
    stale: bool
    at_len: int  # the session's committed length this job was prepared on
    pruned: int = 0  # nodes of the rebased tree the forward's token budget left out (cloud/budget.py)

    def node_logp(self) -> tuple[float, ...]:
        """The drafter's path log-probability of each node of ``tree`` below the current root (the draft's are below
        the draft's root, which rebasing may have moved down); () when the draft carried none."""
        logp = self.request.node_logp
        if len(logp) != len(self.request.tree) or not self.nodes:
            return ()
        above = self.request.tree.parents[self.nodes[self.tree.children[0][0]]]
        offset = logp[above] if above >= 0 else 0.0
        return tuple(logp[n] - offset for n in self.nodes)


@dataclass
class VerifierSession:
    """One generation on one engine sequence. Create with ``open_session``."""

    engine: VerifierEngine
    seq: object
    sampling: Sampling
    limits: Limits
    prompt_len: int
    committed: list[int]
    draws: Draws
    finish: Finish = Finish.NONE
    prefill_us: int = 0
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache supplied
    closed: bool = False
    last_draft_seq: int = 0
    top_logprobs: int | None = None  # set: verdicts carry the target's logprobs (with this many alternatives)
    history: History | None = None  # for penalties and logit bias (None: the sampling has none)
    constraint: GrammarMask | None = None  # structured output (cloud.constraint)
    committed_hash: int = HASH_START  # core.messages.extend_hash over ``committed``, sent in every verdict
    teacher: TeacherSession | None = None  # an opted-in tenant's: the target's top-k at each committed position

    @property
    def committed_len(self) -> int:
        return len(self.committed)

    @property
    def generated(self) -> int:
        return len(self.committed) - self.prompt_len

    def check_state(self) -> None:
        if self.closed:
            raise UnknownSession("session is closed; open a new session")
        if self.finish is not Finish.NONE:
            raise InvalidRequest(f"session already finished ({self.finish.name.lower()}); close it")

    def check_draft(self, req: DraftRequest) -> None:
        """Everything that can be wrong with a draft, checked before any compute (and before ``prepare``)."""
        self.check_state()
        lim = self.limits
        if req.seq and req.seq <= self.last_draft_seq:
            raise InvalidRequest(f"draft seq {req.seq} is not above the previous draft's {self.last_draft_seq}; "
                                 f"number drafts 1, 2, 3, ... in sending order")
        if len(req.assumed) > lim.max_tree_depth + 1:
            raise InvalidRequest(f"draft assumes {len(req.assumed)} unconfirmed tokens, more than one tree of depth "
                                 f"{lim.max_tree_depth} and its bonus token can add")
        if req.committed_len - len(req.assumed) < self.prompt_len:
            raise InvalidRequest(f"draft hangs below committed length {req.committed_len} assuming "
                                 f"{len(req.assumed)} tokens, inside the prompt of {self.prompt_len} tokens")
        if req.committed_len > self.committed_len + lim.max_tree_depth + 1:
            raise InvalidRequest(f"draft assumes committed length {req.committed_len}, but the verifier has "
                                 f"{self.committed_len} and one tree can add at most {lim.max_tree_depth + 1}")
        bad = next((t for t in req.assumed if not 0 <= t < self.engine.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"assumed token id {bad} is outside the vocabulary [0, {self.engine.vocab_size})")
        try:
            validate(req.tree, self.engine.vocab_size, lim.max_tree_nodes, lim.max_tree_depth)
        except TreeError as e:
            raise InvalidRequest(f"invalid draft tree: {e}") from None
        if req.node_logp:
            if len(req.node_logp) != len(req.tree):
                raise InvalidRequest(f"draft has {len(req.node_logp)} node log-probabilities for a tree of "
                                     f"{len(req.tree)} nodes; send one per node or none")
            bad_logp = next((x for x in req.node_logp if not (math.isfinite(x) and x <= 0.0)), None)
            if bad_logp is not None:
                raise InvalidRequest(f"node log-probability {bad_logp} is not a finite number <= 0")

    def prepare(self, req: DraftRequest) -> Job:
        """Check the draft, then rebase it onto the committed tokens (or find it stale). Pure: no compute."""
        self.check_draft(req)
        if req.seq:
            self.last_draft_seq = req.seq
        have, base = self.committed_len, req.committed_len
        node = None
        if base <= have and self.committed[base - len(req.assumed):base] == list(req.assumed) \
                and have - base <= req.tree.depth:
            node = walk(req.tree, self.committed[base:have])
        if node is None:  # stale; ``rebased`` still says how far the verifier had gone alone (for the planner)
            return Job(req, EMPTY, (), max(0, have - base), req.seq > 0 and len(req.tree) > 0, have)
        tree, nodes = subtree(req.tree, node) if node >= 0 else (req.tree, tuple(range(len(req.tree))))
        return Job(req, tree, nodes, have - base, False, have)

    def verify(self, req: DraftRequest, queue_us: int = 0) -> Verdict:
        """Check, rebase, forward alone, apply. The scheduler does the same with many sessions in one forward."""
        job = self.prepare(req)
        t0 = time.perf_counter_ns()
        logits = self.engine.forward_tree(self.seq, self.committed[-1], job.tree)
        return self.apply(job, logits, queue_us, t0)

    def apply(self, job: Job, logits: np.ndarray, queue_us: int, t0_ns: int) -> Verdict:
        """Acceptance over this session's logits rows, cache pruned to the accepted path, finish rules."""
        base = self.committed_len
        acc: Acceptance
        if self.history is None and self.constraint is None:
            acc = accept(job.tree, logits, self.sampling, lambda d: self.draws.uniform(base + d))
        else:  # penalties, then the grammar, on each row's own history (committed + tree path), as the walk reads it
            rows = ShapedRows(logits, job.tree, self.sampling, self.history, self.constraint)
            try:
                acc = accept(job.tree, rows, self.sampling, lambda d: self.draws.uniform(base + d))
            finally:
                rows.close()
        self.engine.keep_path(self.seq, job.tree, acc.accepted)
        new = acc.committed_tokens(job.tree)
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
        self.committed_hash = extend_hash(self.committed_hash, new)
        if self.history is not None:
            self.history.extend(new)
        if self.constraint is not None:
            self.constraint.commit(new)
        lps: tuple[TokenLogprobs, ...] = ()
        # committed token i follows row 0 (the root) when i = 0, else the row of the accepted node before it
        row_of = [0] + [n + 1 for n in acc.accepted]  # raw rows: the model's own logprobs, before shaping
        if self.top_logprobs is not None:
            lps = tuple(TokenLogprobs(t, *logprobs(logits[row_of[i]], t, self.top_logprobs))
                        for i, t in enumerate(new))
        if self.teacher is not None:
            self.teacher.record(new, np.asarray(logits)[row_of[: len(new)]])
        verify_us = (time.perf_counter_ns() - t0_ns) // 1000
        return Verdict(tuple(job.nodes[i] for i in accepted), bonus, self.committed_len, self.finish, queue_us,
                       verify_us, job.request.seq, job.rebased, job.stale, len(job.tree) + 1, lps, job.pruned,
                       self.committed_hash)

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


def check_vocabulary(engine: VerifierEngine, vocab_size: int, vocab_fingerprint: str) -> None:
    """Whether a drafter's ids mean the target's texts: the same vocabulary, or a prefix of it (a target that pads
    its family's vocabulary, as Qwen2.5 7B and up do: 152,064 ids against the small models' 151,936). Then the
    target may commit an id the drafter lacks; ``Opened.extra_pieces`` tells the edge how it renders."""
    if not vocab_size or vocab_size == engine.vocab_size:
        if vocab_fingerprint and vocab_fingerprint != engine.vocab_fingerprint:
            raise Refused("vocabulary fingerprint differs from the target's: same size but different token texts; "
                          "the drafter must share the target's tokenizer")
        return
    mismatch = f"vocabulary size {vocab_size} does not match the target's {engine.vocab_size}"
    if vocab_size > engine.vocab_size:
        raise Refused(f"{mismatch}: the drafter's is larger, so its drafts could name ids the target does not have")
    if engine.vocab_size - vocab_size > MAX_EXTRA_IDS:
        raise Refused(f"{mismatch}: {engine.vocab_size - vocab_size} ids past the drafter's are more than the "
                      f"{MAX_EXTRA_IDS} a padded vocabulary of the same family adds; the drafter must share the "
                      f"target's tokenizer")
    if not vocab_fingerprint:
        raise Refused(f"vocabulary size {vocab_size} is smaller than the target's {engine.vocab_size}: send the "
                      f"vocabulary fingerprint so the verifier can check the drafter's ids carry the target's texts")
    if vocab_fingerprint != engine.vocab_fingerprint_of(vocab_size):
        raise Refused(f"vocabulary fingerprint differs from the target's over the drafter's {vocab_size} ids; "
                      f"the drafter must share the target's tokenizer")


def extra_pieces(engine: VerifierEngine, vocab_size: int) -> tuple[bytes, ...]:
    """What the target's ids past a drafter's ``vocab_size`` render as (none for the same vocabulary)."""
    if not vocab_size or vocab_size >= engine.vocab_size:
        return ()
    return tuple(engine.piece(t) for t in range(vocab_size, engine.vocab_size))


def check_open(engine: VerifierEngine, prompt: Sequence[int], sampling: Sampling, vocab_size: int = 0,
               vocab_fingerprint: str = "", target_model: str = "", top_logprobs: int | None = None,
               prior_output: int = 0) -> Sampling:
    """Identity, size and value checks of an open request (cheap: for any thread, before queueing); returns the
    sampling with wire defaults resolved. The prompt's length is checked before its contents."""
    if target_model and target_model != engine.model_id:
        raise Refused(f"this replica serves {engine.model_id!r}, the client asked for {target_model!r}")
    check_vocabulary(engine, vocab_size, vocab_fingerprint)
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    if not prompt:
        raise InvalidRequest("prompt_tokens is empty; send at least one token")
    if len(prompt) >= engine.n_ctx:
        raise InvalidRequest(f"prompt of {len(prompt)} tokens does not fit the context of {engine.n_ctx} tokens; "
                             f"shorten it")
    if not 0 <= prior_output < len(prompt):
        raise InvalidRequest(f"prior_output_tokens ({prior_output}) must be less than the prompt's {len(prompt)} "
                             f"tokens")
    arr = np.asarray(prompt, dtype=np.int64)
    if arr.min() < 0 or arr.max() >= engine.vocab_size:
        bad = int(arr[(arr < 0) | (arr >= engine.vocab_size)][0])
        raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {engine.vocab_size})")
    try:
        return sampling.check(engine.vocab_size)
    except SamplingError as e:
        raise InvalidRequest(f"sampling: {e}") from None


def open_session(engine: VerifierEngine, prompt: Sequence[int], sampling: Sampling, requested: Limits,
                 server_max: Limits, vocab_size: int = 0, vocab_fingerprint: str = "",
                 target_model: str = "", prior_output: int = 0,
                 constraint: GrammarMask | None = None, partition: str = "") -> VerifierSession:
    """Validate an open request, then prefill (reusing only ``partition``'s cached prefixes, core.tenancy). Raises
    ``VerifierError`` before touching the engine."""
    opening = start_session(engine, prompt, sampling, requested, server_max, vocab_size, vocab_fingerprint,
                            target_model, prior_output, constraint, partition, chunked=False)
    assert isinstance(opening, VerifierSession)
    return opening


@dataclass
class Opening:
    """A session whose prompt is still being computed, in chunks inside verify forwards (``Scheduler``): ``rest``
    goes after what the prefix cache gave, in order; ``session()`` once every token of it is in."""

    seq: object
    rest: list[int]
    session: Callable[[], VerifierSession]


def start_session(engine: VerifierEngine, prompt: Sequence[int], sampling: Sampling, requested: Limits,
                  server_max: Limits, vocab_size: int = 0, vocab_fingerprint: str = "", target_model: str = "",
                  prior_output: int = 0, constraint: GrammarMask | None = None, partition: str = "",
                  chunked: bool = True) -> "VerifierSession | Opening":
    """``open_session``, or, for an engine that computes prompts in verify forwards (``mixed_prefill``) and
    ``chunked``, an ``Opening``: the cached prefix copied in and the rest of the prompt left to the scheduler."""
    sampling = check_open(engine, prompt, sampling, vocab_size, vocab_fingerprint, target_model)
    limits = grant_limits(engine, requested, server_max, len(prompt))
    if limits.max_new_tokens < 1:
        raise InvalidRequest(f"prompt of {len(prompt)} tokens does not fit the context of {engine.n_ctx} tokens "
                             f"(with room for one token and a tree of depth {limits.max_tree_depth}); shorten it")
    if constraint is not None and prior_output:  # a resume: the grammar has seen the earlier output
        constraint.commit(prompt[len(prompt) - prior_output:])
    t0 = time.perf_counter_ns()
    seq = engine.new_sequence()
    chunked = chunked and bool(getattr(engine, "mixed_prefill", False))
    try:
        # engines without a prefix cache return None; a resume's earlier output (and the prompt's last token, the
        # first verify forward's root) was computed by verify forwards
        prefill = cast(ChunkedPrefillEngine, engine).begin_prefill if chunked else engine.prefill
        cached = prefill(seq, prompt[:-1], generated=prior_output, partition=partition) or 0
    except Exception:
        engine.release(seq)
        raise

    def session() -> VerifierSession:
        return VerifierSession(engine=engine, seq=seq, sampling=sampling, limits=limits, prompt_len=len(prompt),
                               committed=list(prompt), draws=Draws.for_sampling(sampling),
                               history=History(prompt, prior_output) if sampling.shapes_logits else None,
                               constraint=constraint, committed_hash=extend_hash(HASH_START, prompt),
                               prefill_us=(time.perf_counter_ns() - t0) // 1000, cached_tokens=cached)
    return Opening(seq, list(prompt[cached:-1]), session) if chunked else session()
