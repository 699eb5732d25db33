"""Server-side speculation as serving engines run it (vLLM, SGLang): lock-step rounds on one GPU.

Every step takes every decoding session of the replica: the drafter drafts ``d`` levels for all of them (``d``
drafter forwards of one token per session, batched, on the drafter's own curve: its compute and its KV reads are
the GPU's time), then one target forward verifies all of them (``B (d + 1)`` tokens) with the waiting prompts'
chunks in the room left (chunked prefill, as the product's scheduler does; ``batched_prefill=False``: each prompt
whole in its own forward after the step). No session falls out of phase behind another's forward.

The depth (``DepthPolicy``) is chosen per step, from 0 (plain decoding: no drafter forward at all) up: the one whose
predicted time per committed token, (d drafter forwards + the verify forward) / tau(d), is least at this step's
batch and contexts, on acceptance by depth learnt from the replica's own verdicts (decayed counts, shrunk towards a
prior), as dynamic-speculation schedulers do (SmartSpec; vLLM's and TensorRT-LLM's draft-length schedules). A
depth whose drafter forward lies past a measured drafter curve's points is refused, not extrapolated
(``drafter_refused`` counts the steps where that decided). Optimistic for the baseline: a step at depth 0 does not
run the drafter over the new tokens (its KV is assumed caught up for free when drafting resumes). A depth whose
drafts would take the room the waiting prompts need (up to half a forward) is not chosen: drafting never starves
first tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from .events import Sim
from .physics import Forward
from .replica import Prompt, Work, prompt_ms


class SDSession(Protocol):
    def context(self) -> int: ...

    def held(self, depth: int) -> int: ...

    def commit(self, tokens: int) -> None: ...


@dataclass
class DepthPolicy:
    max_depth: int = 8
    prior: float = 0.7  # acceptance assumed at every depth before any verdict
    shrink: float = 2.0  # pseudo-tries of the prior behind each depth's estimate
    decay: float = 0.995  # weight of the past per step
    tried: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.tried = [0.0] * self.max_depth
        self.hits = [0.0] * self.max_depth

    def alpha(self) -> list[float]:
        return [(h + self.shrink * self.prior) / (t + self.shrink) for t, h in zip(self.tried, self.hits)]

    def tau(self, depth: int, alpha: list[float] | None = None) -> float:
        """Committed tokens per verify of a chain of ``depth``: 1 + sum_k prod_{j<=k} alpha_j."""
        alpha = alpha or self.alpha()
        total, reach = 1.0, 1.0
        for a in alpha[:depth]:
            reach *= a
            total += reach
        return total

    def decay_step(self) -> None:
        self.tried = [t * self.decay for t in self.tried]
        self.hits = [h * self.decay for h in self.hits]

    def observe(self, depth: int, held: int) -> None:
        """A chain of ``depth`` verified, its first ``held`` tokens the target's: level k was tried iff k - 1
        held."""
        for k in range(min(depth, held + 1)):
            self.tried[k] += 1
            self.hits[k] += k < held

    def choose(self, step_ms) -> tuple[int, bool]:
        """The depth whose ``step_ms(d)`` (None: not allowed) per expected token is least; and whether a deeper
        chain was refused (its drafter forward past a measured curve)."""
        alpha, best, best_cost, refused = self.alpha(), 0, float("inf"), False
        for d in range(self.max_depth + 1):
            ms = step_ms(d)
            if ms is None:
                refused = refused or d > 0
                continue
            cost = ms / self.tau(d, alpha)
            if cost < best_cost - 1e-9:
                best, best_cost = d, cost
        return best, refused


@dataclass
class LockstepReplica:
    sim: Sim
    forward: Forward  # the target's
    drafter: Forward | None  # the drafter's, on the same GPU (None: plain decoding only)
    window_ms: float = 2.0  # unused: every decoding session is in every step
    max_batch_tokens: int = 4096
    budget_tokens: int = 0  # unused
    batched_prefill: bool = True
    policy: DepthPolicy = field(default_factory=DepthPolicy)
    open_sessions: int = 0
    busy_ms: float = 0.0
    forwards: int = 0
    beyond: int = 0
    batches: int = 0
    forward_ms: float = 0.0
    forward_tokens: int = 0
    verifies: int = 0
    committed: int = 0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    prefill_tokens: int = 0
    drafter_ms: float = 0.0  # GPU time spent drafting
    drafter_refused: int = 0  # steps where a deeper chain's drafter forward was past its measured curve
    depth_sessions: list = field(default_factory=lambda: [0] * 17)  # sessions verified at each depth
    _decoding: list = field(default_factory=list)
    _prompts: deque = field(default_factory=deque)
    _full: set = field(default_factory=set)  # sessions whose whole last chain held (the drafter feeds 2 tokens)
    _busy: bool = False

    def submit(self, w: Work) -> None:
        """Prompts only: the session joins the steps once its prompt is in (``w.done``)."""
        assert w.kind == "prefill", "lock-step sessions take part in every step; they submit only their prompt"
        w.submitted = self.sim.now
        if w.tokens <= 0:
            self.sim.after(0.0, lambda: w.done(0.0, 0))
            return
        self._prompts.append(Prompt(w, w.tokens))
        self._kick()

    def join(self, session: SDSession) -> None:
        self._decoding.append(session)
        self._kick()

    def leave(self, session: SDSession) -> None:
        if session in self._decoding:
            self._decoding.remove(session)
        self._full.discard(id(session))

    def _kick(self) -> None:
        if not self._busy and (self._decoding or self._prompts):
            self._step()

    def _chunks(self, room: int) -> list[tuple[Prompt, int]]:
        """The waiting prompts' chunks for ``room`` tokens, in arrival order (none with serial prefill)."""
        out = []
        for p in self._prompts if self.batched_prefill else ():
            if room <= 0:
                break
            out.append((p, min(p.left, room)))
            room -= out[-1][1]
        return out

    def _draft_ms(self, n: int, ctx: int, d: int) -> float | None:
        """d drafter forwards of n sessions (None: past a measured drafter curve)."""
        if d == 0:
            return 0.0
        if self.drafter is None or not self.drafter.allows(n + len(self._full)):
            return None
        first = self.drafter.ms(n + len(self._full), ctx, ctx)
        return first + (d - 1) * self.drafter.ms(n, ctx, ctx)

    def _verify_ms(self, n: int, ctx: int, d: int) -> float | None:
        tokens = n * (d + 1)
        if tokens > self.max_batch_tokens or not self.forward.allows(tokens):
            return None
        return self.forward.ms(tokens, ctx, (d + 1) * ctx)

    def _step(self) -> None:
        sessions = self._decoding[:self.max_batch_tokens]
        self._decoding = self._decoding[len(sessions):] + sessions  # a full step rotates who goes first
        n, ctx = len(sessions), sum(s.context() for s in sessions)
        d, refused = 0, False
        # drafts never take the room the waiting prompts need (up to half a forward): first tokens keep flowing
        reserve = min(sum(p.left for p in self._prompts), self.max_batch_tokens // 2) if self.batched_prefill else 0
        if n:
            def step_ms(depth: int) -> float | None:
                if depth and n * (depth + 1) > self.max_batch_tokens - reserve:
                    return None
                draft, verify = self._draft_ms(n, ctx, depth), self._verify_ms(n, ctx, depth)
                return None if draft is None or verify is None else draft + verify
            d, refused = self.policy.choose(step_ms)
        chunks = self._chunks(self.max_batch_tokens - n * (d + 1))
        chunk_tokens = sum(k for _, k in chunks)
        if d and chunks and not self.drafter.allows(chunk_tokens):  # the drafter cannot price the prompts' KV
            d, refused = 0, True
            chunks = self._chunks(self.max_batch_tokens - n)
            chunk_tokens = sum(k for _, k in chunks)
        self.drafter_refused += refused
        tokens = n * (d + 1)
        calls = [] if self.batched_prefill else list(self._prompts)  # serial: each prompt whole, its own forward
        draft_ms = self._draft_ms(n, ctx, d) or 0.0
        if chunks and self.drafter is not None and d:  # the drafter computes the prompts' KV too
            draft_ms += self.drafter.ms(chunk_tokens, sum(p.offset for p, _ in chunks))
        fwd_ctx = ctx + sum(p.offset for p, _ in chunks)
        pairs = (d + 1) * ctx + sum(k * (p.offset + k // 2) for p, k in chunks)
        verify_ms = self.forward.ms(tokens + chunk_tokens, fwd_ctx, pairs) if tokens + chunk_tokens else 0.0
        self.beyond += self.forward.beyond(tokens + chunk_tokens)
        calls_ms = [prompt_ms(self.forward, p.left, p.work.context) for p in calls]
        ms = draft_ms + verify_ms + sum(calls_ms)
        self.busy_ms += ms
        self.drafter_ms += draft_ms
        self.forwards += bool(tokens + chunk_tokens) + (d if n else 0) + len(calls)
        if chunks:
            self.prefill_ms += verify_ms * chunk_tokens / (tokens + chunk_tokens)
            self.prefill_tokens += chunk_tokens
        self.prefill_ms += sum(calls_ms)
        self.prefill_tokens += sum(p.left for p in calls)
        if n:
            self.batches += 1
            self.forward_ms += verify_ms
            self.forward_tokens += tokens
            self.verifies += n
            self.depth_sessions[min(d, 16)] += n
        self._busy = True

        def end() -> None:
            self.policy.decay_step()
            self._full = set()
            for s in sessions:
                held = s.held(d) if d else 0
                if d:
                    self.policy.observe(d, held)
                    if held == d:
                        self._full.add(id(s))
                s.commit(held + 1)  # may leave (finished)
            opened = []
            for p, k in chunks:
                p.left -= k
                if not p.left:
                    self._prompts.remove(p)
                    opened.append(p.work)
            for p in calls:
                self._prompts.remove(p)
                opened.append(p.work)
            for w in opened:  # (still busy: they join the next step together)
                w.done(verify_ms, int((self.sim.now - w.submitted) * 1e6))
            self._busy = False
            self._kick()

        self.sim.after(ms / 1000, end)
