"""A verifier replica on the virtual clock: its engine loop's batching rule, mirrored from ``cloud/scheduler.py``,
and its sessions' rules (rebasing, acceptance, finish), mirrored from ``cloud/session.py`` and the servicer.

Batching (``Replica``, as ``Scheduler._step``): the loop takes the first piece of work waiting, then collects more
for up to ``window_ms``, until the next would overflow ``max_batch_tokens`` (or comes from a session already in the
batch: it goes first next time), or until every open session has work in the batch; then one forward of all of
it, timed by the cost curve at its total tokens. Opens (prefills) wait for the batch and run after it, as the
scheduler's calls do (``batched_prefill``: they join the batch as tokens instead, as engines with chunked prefill
do; not the product's scheduler). With a verify budget (``budget_tokens``) a draft costs one token to collect and
``cloud.budget.allot`` keeps the most probable nodes of all the batch's trees: the product's own code.
``tests/test_capacity.py`` holds this mirror to the real scheduler.

Sessions (``VerifierSession``): after the prefill the verifier decodes alone (one token per forward) until a draft
arrives; a draft that arrives while a token is in the loop waits for it, is rebased onto the tokens decoded since
its base (``core.tree.walk``/``subtree``) or found stale, and is verified in one forward; acceptance walks the tree
along the target's own tokens (position i of the output is token i; the trace says which drafts match).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tandem.cloud.budget import allot, node_scores, restrict
from tandem.core.messages import EMPTY, DraftRequest, Finish, Limits, Opened, Verdict
from tandem.core.tree import DraftTree, subtree, walk

from .events import Sim
from .physics import Forward


@dataclass
class Work:
    session: object
    tokens: int  # tokens it puts in a forward
    done: Callable[[float, int], None]  # (forward ms, queue us) at the end of its forward
    kind: str = "target"  # "target" | "drafter" | "prefill" (a forward of its own, after the batch)
    tree: DraftTree | None = None  # a draft's (rebased) tree, prunable under a budget
    logp: tuple[float, ...] = ()
    submitted: float = 0.0
    keep: tuple[int, ...] | None = None  # the tree's nodes a budget kept (None: all)
    context: int = 0  # the session's tokens already in the KV cache (read once by the forward)
    prefill: bool = False  # a prompt batched with decoding work (``batched_prefill``)


@dataclass
class Replica:
    sim: Sim
    forward: Forward  # the target's forward time
    drafter: Forward | None = None  # the drafter's (server-side speculation)
    window_ms: float = 2.0
    max_batch_tokens: int = 512
    budget_tokens: int = 0
    batched_prefill: bool = False  # prompts join the batch as tokens (chunked prefill), not a forward each
    open_sessions: int = 0
    busy_ms: float = 0.0  # GPU time spent
    forwards: int = 0
    beyond: int = 0  # forwards past the cost curve's last point
    batches: int = 0  # batched target forwards (not prefills, not server-side drafting)
    forward_ms: float = 0.0  # their time
    forward_tokens: int = 0
    verifies: int = 0  # target work items verified (a session's share of a forward)
    committed: int = 0  # tokens their sessions committed
    queue_ms: float = 0.0  # their waits from submission to their forward
    _waiting: deque = field(default_factory=deque)
    _batch: list = field(default_factory=list)
    _calls: list = field(default_factory=list)
    _used: int = 0  # the batch's tokens (budget cost)
    _members: set = field(default_factory=set)  # ids of the sessions in the batch
    _collecting: bool = False
    _busy: bool = False
    _round: int = 0  # which collection a deadline belongs to

    def submit(self, w: Work) -> None:
        w.submitted = self.sim.now
        if self.batched_prefill and w.kind == "prefill":
            w.kind, w.prefill = "target", True
        if self._busy:
            self._waiting.append(w)
        elif not self._collecting:
            self._start(w)
        elif not self._add(w):  # it ended the collection (the batch runs now): it goes first next time
            self._waiting.append(w)

    def _cost(self, w: Work) -> int:
        return 1 if self.budget_tokens and w.tree is not None else w.tokens

    def _start(self, first: Work) -> None:
        if first.kind == "prefill":
            self._forward([], [first])
            return
        self._collecting, self._batch, self._calls = True, [first], []
        self._used, self._members = self._cost(first), {id(first.session)}
        self._round += 1
        token = self._round
        self.sim.after(self.window_ms / 1000, lambda: self._deadline(token))
        self._check_full()

    def _add(self, w: Work) -> bool:
        """Take ``w`` into the batch being collected; False: it waits (the batch then runs now, as the scheduler's
        collection ends at a draft that does not fit)."""
        if w.kind == "prefill":
            self._calls.append(w)
            return True
        if self._used + self._cost(w) > self.max_batch_tokens or id(w.session) in self._members \
                or w.kind != self._batch[0].kind:
            self._run()
            return False
        self._batch.append(w)
        self._used += self._cost(w)
        self._members.add(id(w.session))
        self._check_full()
        return True

    def _check_full(self) -> None:
        if self._used >= self.max_batch_tokens or len(self._batch) >= self.open_sessions:
            self._run()

    def _deadline(self, token: int) -> None:
        if self._collecting and token == self._round:
            self._run()

    def _run(self) -> None:
        if not self._collecting:
            return
        self._collecting = False
        self._forward(self._batch, self._calls)

    def _forward(self, batch: list[Work], calls: list[Work]) -> None:
        if self.budget_tokens and batch and batch[0].kind == "target":
            self._prune(batch)
        fwd = self.drafter if batch and batch[0].kind == "drafter" else self.forward
        assert fwd is not None, "a drafter forward on a replica without a drafter curve"
        tokens = sum(w.tokens for w in batch)
        ms = fwd.ms(tokens, sum(w.context for w in batch)) if batch else 0.0
        ms_calls = [self.forward.ms(w.tokens) for w in calls]
        self.beyond += fwd.beyond(tokens) + sum(self.forward.beyond(w.tokens) for w in calls)
        if batch and batch[0].kind == "target":
            work = [w for w in batch if not w.prefill]
            self.forward_ms += ms
            self.batches += 1
            self.forward_tokens += sum(w.tokens for w in work)
            self.verifies += len(work)
            self.queue_ms += sum(self.sim.now - w.submitted for w in work) * 1000
        self._busy = True
        start = self.sim.now
        self.busy_ms += ms + sum(ms_calls)
        self.forwards += bool(batch) + len(calls)

        def end() -> None:
            for w in batch:
                w.done(ms, int((start - w.submitted) * 1e6))
            t = 0.0
            for w, c in zip(calls, ms_calls):
                t += c
                w.done(c, int((start + ms / 1000 + t / 1000 - c / 1000 - w.submitted) * 1e6))
            self._busy = False
            if self._waiting:
                self._start(self._waiting.popleft())
                while self._waiting and self._collecting:
                    if not self._add(self._waiting[0]):
                        break
                    self._waiting.popleft()

        self.sim.after((ms + sum(ms_calls)) / 1000, end)

    def _prune(self, batch: list[Work]) -> None:
        cap = max(self.budget_tokens, len(batch))
        if sum(w.tokens for w in batch) <= cap:
            return
        trees = [w.tree or EMPTY for w in batch]
        keeps = allot(trees, [node_scores(t, w.logp) for t, w in zip(trees, batch)], cap)
        for w, keep in zip(batch, keeps):
            if w.tree is not None and len(keep) < len(w.tree):
                w.keep, w.tree = keep, restrict(w.tree, keep)
                w.tokens = 1 + len(w.tree)


class VerifierSession:
    """One session on a replica; ``reply`` carries each Opened / Verdict back (the caller's link)."""

    def __init__(self, replica: Replica, prompt_len: int, limits: Limits, reply: Callable[[object], None],
                 decode_steps: int, sid: str):
        self.replica, self.prompt_len, self.limits, self.reply = replica, prompt_len, limits, reply
        self.committed_len, self.finish, self.sid = prompt_len, Finish.NONE, sid
        self.run, self.draft, self.busy, self.closed = decode_steps, None, True, False
        replica.open_sessions += 1
        replica.submit(Work(self, prompt_len, self._opened, "prefill"))

    def token(self, pos: int) -> int:
        return pos - self.prompt_len  # output position i is token i

    def generated(self) -> int:
        return self.committed_len - self.prompt_len

    def _opened(self, ms: float, queue_us: int) -> None:
        self.reply(Opened(self.sid, self.limits, int(ms * 1000)))
        self.busy = False
        self._step()

    def on_draft(self, d: DraftRequest) -> None:
        if self.finish is not Finish.NONE or self.closed:
            return
        self.draft = d
        if not self.busy:
            self._step()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.replica.open_sessions -= 1

    def _step(self) -> None:
        if self.closed or self.finish is not Finish.NONE or self.busy:
            return
        if self.draft is not None:
            d, self.draft = self.draft, None
            self._verify(d)
        elif self.run > 0:
            self.run -= 1
            self._verify(DraftRequest(self.committed_len))

    def _verify(self, d: DraftRequest) -> None:
        have, base = self.committed_len, d.committed_len
        node = None
        if base <= have and len(d.assumed) <= base - self.prompt_len and have - base <= d.tree.depth and \
                all(self.token(base - len(d.assumed) + j) == t for j, t in enumerate(d.assumed)):
            node = walk(d.tree, [self.token(p) for p in range(base, have)])
        stale = node is None and d.seq > 0 and len(d.tree) > 0
        if node is None:
            tree, nodes = EMPTY, ()
        else:
            tree, nodes = subtree(d.tree, node) if node >= 0 else (d.tree, tuple(range(len(d.tree))))
        logp = tuple(d.node_logp[n] for n in nodes) if len(d.node_logp) == len(d.tree) else ()
        self.busy = True
        work = Work(self, 1 + len(tree), lambda ms, q: self._verified(d, tree, nodes, max(0, have - base), stale,
                                                                      work, ms, q), tree=tree, logp=logp,
                    context=have)
        self.replica.submit(work)

    def _verified(self, d: DraftRequest, tree: DraftTree, nodes, rebased: int, stale: bool, work: Work, ms: float,
                  queue_us: int) -> None:
        pruned = 0
        if work.keep is not None:  # the budget kept part of the tree: its nodes, renumbered in order
            pruned, tree, nodes = len(tree) - len(work.keep), work.tree, tuple(nodes[i] for i in work.keep)
        base, node, accepted = self.committed_len, -1, []
        while True:
            x = self.token(base + len(accepted))
            child = next((c for c in tree.children[node + 1] if tree.tokens[c] == x), None)
            if child is None:
                break
            accepted.append(child)
            node = child
        new = len(accepted) + 1
        room = self.limits.max_new_tokens - self.generated()
        bonus = self.token(base + len(accepted))
        if new >= room:
            self.finish = Finish.LENGTH
            if room <= len(accepted):
                accepted, bonus = accepted[:room], -1
            new = room
        self.committed_len += new
        self.replica.committed += new
        self.reply(Verdict(tuple(nodes[i] for i in accepted), bonus, self.committed_len, self.finish, queue_us,
                           int(ms * 1000), d.seq, rebased, stale, len(tree) + 1, (), pruned))
        self.busy = False
        if d.seq:
            self.run = d.decode_steps
        self._step()
