"""The engine loop: one thread owns the engine and verifies the pending trees of many sessions in one forward.

Continuous batching: the loop blocks until some work arrives, then keeps collecting drafts for at most
``window_ms`` (or until the next draft would overflow ``max_batch_tokens``, or every open session has a draft in
the batch) and runs them all in one ``forward_batch``. With a verify budget (``verify_budget_tokens``) a draft that
does not fit is not held back: every pending draft's root goes in (holding a draft back costs it a whole forward
of latency, its root costs one token), and ``cloud.budget`` keeps the most probable nodes of all their trees
within what the budget leaves, so every pending session is verified in this forward.
The budget may be a latency target instead (``verify_budget_ms``): each forward then holds as many tokens as the
replica's fitted forward cost (``cloud.budget.ForwardCost``, refitted after every forward) says fit the target less
the recent queue wait (``cloud.budget.forward_target_ms``).

Prompts (chunked prefill, as vLLM and SGLang batch them): on an engine that can (``mixed_prefill``), an open only
copies the partition's cached prefix in; the rest of its prompt is computed inside the verify forwards. Each forward
takes its verify work first, then fills the token room left (``max_batch_tokens``, or the verify budget) with
chunks of the waiting prompts in arrival order, a prompt larger than the room split across forwards; with no verify
work waiting, a forward holds prompt chunks alone. A session opens once the forward that computed its last chunk
is done. Decoding sessions are never held back by a long prompt, and prompts share forwards instead of taking one
each. (``mixed_prefill=False``, or an engine without it: each prompt is computed whole between batches.)

Everything else that touches the engine (the start of an open, close) runs on the same thread between batches, so
engines never need locks; each step owns the engine (cloud/engines/ownership.py), so any other thread that uses it at
the same time (a reference decode, a second scheduler on the same engine) waits, or fails loudly, never interleaves. A
draft that fails its checks fails alone, before the forward.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable, TypedDict, cast

from .budget import ForwardCost, allot, forward_target_ms, node_scores, restrict
from .engines.engine import ChunkedPrefillEngine, PrefillChunk, TreeJob, VerifierEngine
from .engines.ownership import owned
from .session import DraftRequest, InvalidRequest, Job, Opening, Verdict, VerifierSession

log = logging.getLogger("tandem.cloud.scheduler")


class Price(TypedDict):
    """What a forward's verdicts tell their edges of its price (``Scheduler.price``), as ``Verdict`` fields."""

    price_us_per_token: int
    batch_sessions: int
    token_budget: int


# weight of the past in the queue-wait average: with a forward target of T - wait the (wait, forward) pair
# settles at (T/2, T/2) when sessions are desynchronised; the smoothing damps the back-and-forth on the way there
WAIT_DECAY = 0.8
WARMUP_TOKENS = (16, 32, 64)  # a latency budget's forwards before its cost is fitted (the roots always go in)


@dataclass
class _Verify:
    session: VerifierSession
    job: Job
    submitted_ns: int = field(default_factory=time.perf_counter_ns)
    future: Future = field(default_factory=Future)


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)


@dataclass
class _Open:
    start: Callable[[], "VerifierSession | Opening"]  # cloud.session.start_session, bound to its request
    future: Future = field(default_factory=Future)
    opening: Opening | None = None  # once started, while its prompt is computed


@dataclass
class BatchStats:
    forwards: int = 0  # verify forwards run
    trees: int = 0  # drafts verified (sum of batch sizes)
    tokens: int = 0  # root + node tokens fed to verify forwards
    pruned_nodes: int = 0  # tree nodes the verify budget left out
    prefill_tokens: int = 0  # prompt tokens computed inside forwards (chunked prefill)
    prefill_forwards: int = 0  # forwards that held prompt chunks (with verify work or alone)

    @property
    def mean_batch(self) -> float:
        return self.trees / self.forwards if self.forwards else 0.0


class Scheduler:
    def __init__(self, engine: VerifierEngine, max_batch_tokens: int = 512, window_ms: float = 2.0,
                 batching: bool = True, verify_budget_tokens: int = 0, verify_budget_ms: float = 0.0,
                 mixed_prefill: bool = True):
        """``verify_budget_tokens``: most tokens in one verify forward, reached by pruning the least probable tree
        nodes of all sessions (0: off; whole drafts then wait for the next forward when ``max_batch_tokens`` is
        full). ``verify_budget_ms``: the same, with the token count each forward's predicted time allows (0: off;
        with both, the smaller). ``mixed_prefill``: prompts in the verify forwards, where the engine can (see the
        module docstring); False: each prompt whole, between batches."""
        self.engine = engine
        self.mixed_prefill = mixed_prefill and bool(getattr(engine, "mixed_prefill", False))
        self._prefills: deque[_Open] = deque()  # opens whose prompts are being computed, in arrival order
        # a forward never holds more tokens than the engine takes in one batch (llama.cpp: n_batch)
        self.max_batch_tokens = min(max_batch_tokens, engine.max_batch_tokens)
        if verify_budget_tokens < 0:
            raise ValueError(f"verify_budget_tokens must be >= 0, got {verify_budget_tokens}")
        self.budget = min(verify_budget_tokens, self.max_batch_tokens)
        if not verify_budget_ms >= 0:  # NaN too
            raise ValueError(f"verify_budget_ms must be >= 0, got {verify_budget_ms}")
        self.budget_ms = verify_budget_ms
        self.cost = ForwardCost()  # this replica's forward time against tokens, from the forwards it ran
        self.wait_ms = 0.0  # longest queue wait of a draft in recent forwards (moving average over forwards)
        self._last_forward_ms = 0.0
        self.window_s = window_ms / 1000
        self.batching = batching  # False: one session per forward (the unbatched baseline)
        # how many sessions are open, set by the backend: a batch holding a draft of every open session is complete,
        # so it runs without waiting out the window (a lone session never waits). None: always wait the window.
        self.open_sessions: Callable[[], int] | None = None
        self.stats = BatchStats()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._carry: list = []
        self._stop = threading.Event()
        self._active = False  # a step (a batch or a call) is running on the engine thread
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # -- API (any thread) ------------------------------------------------------------------------------------------
    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread between batches (close, or anything else that touches the engine)."""
        job = _Call(fn)
        self._queue.put(job)
        return job.future

    def open(self, start: Callable[[], "VerifierSession | Opening"]) -> Future:
        """Open a session: ``start`` (``cloud.session.start_session``) runs on the engine thread; what it leaves of
        the prompt is computed in the next forwards (chunked prefill) unless ``mixed_prefill`` is off. The future
        resolves to the ``VerifierSession`` once its prompt is in, or raises the open's error. (With
        ``mixed_prefill`` off, ``start`` must compute the whole prompt: ``start_session(chunked=False)``.)"""
        job = _Open(start)
        self._queue.put(job)
        return job.future

    def verify(self, session: VerifierSession, req: DraftRequest) -> Future:
        """Queue one draft; the future resolves to a ``Verdict`` or raises the draft's ``VerifierError``. The draft
        is checked and rebased here, off the engine thread (a session has one request in flight at a time)."""
        job = _Verify(session, session.prepare(req))
        self._queue.put(job)
        return job.future

    def busy(self) -> bool:
        """Work is running on the engine or waiting for it (what idle-time work, cloud.learning.online's distillation,
        yields to)."""
        return self._active or bool(self._carry) or bool(self._prefills) or not self._queue.empty()

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=10)

    # -- engine thread ---------------------------------------------------------------------------------------------
    def _next(self, timeout: float | None):
        if self._carry:
            return self._carry.pop(0)
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._next(None if not self._prefills else 0.0)
                if job is not None or self._prefills:
                    self._active = True
                    try:
                        with owned(self.engine):
                            self._step(job)
                    finally:
                        self._active = False
            except Exception:  # never let the engine thread die: every caller would hang
                log.exception("engine loop step failed")

    def _step(self, job) -> None:
        if isinstance(job, _Call):
            self._run_call(job)
            return
        if not self.mixed_prefill and isinstance(job, _Open):  # a whole prompt, between batches
            self._begin(job)
            return
        budget = self.budget_now()
        # with a budget a draft costs its root only (the rest is pruned to fit); without, all of it
        cost = (lambda j: 1) if budget else (lambda j: len(j.job.tree) + 1)  # noqa: E731
        limit = self.max_batch_tokens
        batch, tokens, calls = [], 0, []
        if isinstance(job, _Verify):
            batch, tokens = [job], cost(job)
        elif isinstance(job, _Open):
            self._begin(job)
        # drafts are collected for the batch window; a prompt never waits for drafts (only for what is queued now)
        deadline = time.perf_counter() + (self.window_s if batch else 0.0)
        while self.batching and tokens < limit and (not batch or self.open_sessions is None
                                                    or len(batch) < self.open_sessions() - len(self._prefills)):
            nxt = self._next(max(0.0, deadline - time.perf_counter()))
            if nxt is None:
                break
            if isinstance(nxt, _Call) or (isinstance(nxt, _Open) and not self.mixed_prefill):
                calls.append(nxt)
            elif isinstance(nxt, _Open):
                self._begin(nxt)
            elif tokens + cost(nxt) > limit or any(nxt.session is j.session for j in batch):
                self._carry.append(nxt)
                break
            else:
                if not batch:  # the first draft: now it waits the window for more
                    deadline = time.perf_counter() + self.window_s
                batch.append(nxt)
                tokens += cost(nxt)
        self._run_batch(batch, budget)
        for c in calls:
            self._begin(c) if isinstance(c, _Open) else self._run_call(c)

    def _begin(self, job: _Open) -> None:
        """Start an open: the session at once, or its prompt queued for the forwards (chunked prefill)."""
        if not job.future.set_running_or_notify_cancel():  # the caller gave up before it ran
            return
        try:
            started = job.start()
        except BaseException as e:
            job.future.set_exception(e)
            return
        if isinstance(started, Opening) and started.rest:
            job.opening = started
            self._prefills.append(job)
        else:
            job.future.set_result(started.session() if isinstance(started, Opening) else started)

    def _advance(self, chunks: list[tuple[_Open, PrefillChunk]]) -> None:
        """After the forward: each prompt's computed chunk leaves its rest; a prompt now whole opens its session."""
        for job, chunk in chunks:
            assert job.opening is not None
            del job.opening.rest[:len(chunk.tokens)]
            if not job.opening.rest:
                self._prefills.remove(job)
                try:
                    job.future.set_result(job.opening.session())
                except BaseException as e:
                    self._fail_open(job, e)

    def _fail_open(self, job: _Open, e: BaseException) -> None:
        """An open that failed after its sequence was made: the sequence is freed, the caller gets the error."""
        if job.opening is not None:
            try:
                self.engine.release(job.opening.seq)
            except Exception:
                log.exception("releasing a failed open's sequence")
        if not job.future.done():
            job.future.set_exception(e)

    def _chunks(self, room: int) -> list[tuple[_Open, PrefillChunk]]:
        """Prompt chunks for a forward with ``room`` tokens left: the waiting prompts in arrival order, the last one
        taken cut to what fits (its rest waits at the head of the line)."""
        out = []
        for job in self._prefills:
            if room <= 0:
                break
            assert job.opening is not None
            take = job.opening.rest[:room]
            out.append((job, PrefillChunk(job.opening.seq, tuple(take))))
            room -= len(take)
        return out

    def budget_now(self) -> int:
        """Tokens the next forward may hold (0: no budget): the token budget, the latency target's (before the
        cost is fitted: ``WARMUP_TOKENS``), or the smaller of the two; never fewer than its drafts' roots."""
        if not self.budget_ms:
            return self.budget
        fit = self.cost.tokens_within(forward_target_ms(self.budget_ms, self.wait_ms))
        if fit is None:  # warming up: small forwards of different sizes, so the fit has a slope to see soon
            fit = WARMUP_TOKENS[min(self.stats.forwards, len(WARMUP_TOKENS) - 1)]
        fit = min(fit, self.max_batch_tokens)
        return min(self.budget, fit) if self.budget else fit

    def _prune(self, ready: list[_Verify], budget: int) -> None:
        """Fit the batch's trees into the budget, keeping each job's node mapping to its draft's tree."""
        trees = [j.job.tree for j in ready]
        keeps = allot(trees, [node_scores(t, j.job.node_logp()) for t, j in zip(trees, ready)], budget)
        for j, keep in zip(ready, keeps):
            if len(keep) < len(j.job.tree):
                job = j.job
                j.job = replace(job, tree=restrict(job.tree, keep), nodes=tuple(job.nodes[i] for i in keep),
                                pruned=len(job.tree) - len(keep))
                self.stats.pruned_nodes += j.job.pruned

    @staticmethod
    def _run_call(job: _Call) -> None:
        if not job.future.set_running_or_notify_cancel():  # the caller gave up before it ran: skip it
            return
        try:
            job.future.set_result(job.fn())
        except BaseException as e:  # delivered to the caller
            job.future.set_exception(e)

    def _run_batch(self, batch: list[_Verify], budget: int = 0) -> None:
        """One forward: the batch's drafts (pruned to a budget), then prompt chunks in the room left."""
        ready = self._still_ready(batch)
        n_tokens = sum(len(j.job.tree) + 1 for j in ready)
        cap = max(budget, len(ready))  # the roots go in whatever the budget says
        if budget and n_tokens > cap:
            self._prune(ready, cap)
            n_tokens = sum(len(j.job.tree) + 1 for j in ready)
        # prompt chunks fill the room a budget leaves beside drafts; alone, a forward's whole batch
        room = (budget if ready and budget else self.max_batch_tokens) - n_tokens
        chunks = self._chunks(room) if self.mixed_prefill else []
        if not ready and not chunks:
            return
        jobs = [TreeJob(j.session.seq, j.session.committed[-1], j.job.tree) for j in ready]
        t0 = time.perf_counter_ns()
        try:
            if chunks:
                mixed = cast(ChunkedPrefillEngine, self.engine)  # (chunks come only from such an engine)
                logits = mixed.forward_mixed(jobs, [c for _, c in chunks])
            else:
                logits = self.engine.forward_batch(jobs)
        except Exception as e:
            log.exception("verify forward failed")
            for j in ready:
                j.future.set_exception(e)
            for job, _ in chunks:  # a prompt whose chunk failed fails its open, and frees its sequence
                self._prefills.remove(job)
                self._fail_open(job, e)
            return
        self._advance(chunks)
        self._account_forward(ready, chunks, n_tokens + sum(len(c.tokens) for _, c in chunks), t0)
        price = self.price(len(ready))
        for j, rows in zip(ready, logits):
            try:
                verdict: Verdict = j.session.apply(j.job, rows, (t0 - j.submitted_ns) // 1000, t0)
                j.future.set_result(replace(verdict, **price))
            except Exception as e:
                j.future.set_exception(e)

    @staticmethod
    def _still_ready(batch: list[_Verify]) -> list[_Verify]:
        """The batch's drafts whose caller still waits and whose session is still where the draft was made; the
        others' futures are settled here."""
        ready = []
        for j in batch:  # the tree was validated at submit; the session may have changed since (e.g. closed)
            if not j.future.set_running_or_notify_cancel():  # its stream is gone: no forward for it
                continue
            try:
                j.session.check_state()
                if j.session.committed_len != j.job.at_len:
                    raise InvalidRequest("the session committed tokens while this draft was queued; send one "
                                         "request at a time per session")
                ready.append(j)
            except Exception as e:
                j.future.set_exception(e)
        return ready

    def _account_forward(self, ready: list[_Verify], chunks: list[tuple[_Open, PrefillChunk]], n_tokens: int,
                         t0: int) -> None:
        """A forward of ``n_tokens`` that started at ``t0`` (ns) ended now: its cost, the wait, the counters."""
        forward_ms = (time.perf_counter_ns() - t0) / 1e6
        self.cost.observe(n_tokens, forward_ms)
        # the wait a forward's size can change: for the forward before it (and the batch window), not behind a
        # long prefill or a quiet spell
        if ready:
            wait_ms = min(max(t0 - j.submitted_ns for j in ready) / 1e6,
                          self._last_forward_ms + 1000 * self.window_s)
            self.wait_ms = WAIT_DECAY * self.wait_ms + (1 - WAIT_DECAY) * wait_ms
        self._last_forward_ms = forward_ms
        self.stats.forwards += 1
        self.stats.trees += len(ready)
        self.stats.tokens += n_tokens
        if chunks:
            self.stats.prefill_forwards += 1
            self.stats.prefill_tokens += sum(len(c.tokens) for _, c in chunks)

    def price(self, sessions: int) -> Price:
        """What the verdicts of a forward of ``sessions`` sessions tell their edges (docs/drafting.md, "The price
        of a draft token"): a token's marginal cost in the next forward (the fitted slope; 0 before a fit), the
        load that pays it, and, under a latency target, each open session's share of the tokens the target fits."""
        marginal, budget = self.cost.marginal_ms(), 0
        if self.budget_ms and self.cost.line() is not None:
            fits = self.cost.tokens_within(forward_target_ms(self.budget_ms, self.wait_ms)) or 0
            budget = max(1, fits // max(1, self.open_sessions() if self.open_sessions else sessions))
        return {"price_us_per_token": round(marginal * 1000) if marginal else 0, "batch_sessions": sessions,
                "token_budget": budget}
