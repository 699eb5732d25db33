"""A verifier replica on the virtual clock: its engine loop's batching rule, mirrored from ``cloud/scheduler.py``,
and its sessions' rules (rebasing, acceptance, finish), mirrored from ``cloud/session.py`` and the servicer.

Batching (``Replica``, as ``Scheduler._step``): the loop takes the first draft waiting, then collects more for up to
``window_ms``, until the next would overflow ``max_batch_tokens`` (or comes from a session already in the batch: it
goes first next time), or until every open session whose prompt is in has work in the batch; then one forward of
all of it, timed by the cost curve at its total tokens. With a verify budget (``budget_tokens``) a draft costs one
token to collect and ``cloud.budget.allot`` keeps the most probable nodes of all the batch's trees: the product's
own code. ``tests/test_capacity.py`` holds this mirror to the real scheduler.

Prompts (``batched_prefill``, the default, as the scheduler's ``mixed_prefill``): each forward's verify work goes in
first, then chunks of the waiting prompts in arrival order fill the token room left (``max_batch_tokens``, or the
verify budget, less the verify tokens), a prompt larger than the room split across forwards; with no verify work
waiting a forward holds prompt chunks alone (at once: a prompt never waits for drafts). A session opens after the
forward that computed its last chunk. A prompt's last token is not prefilled: it is the first verify forward's
root, as ``cloud.session.start_session`` leaves it. ``batched_prefill=False`` (``--serial-prefill``): the old rule,
each prompt whole in a forward of its own after the batch.

Sessions (``VerifierSession``): after the prefill the verifier decodes alone (one token per forward) until a draft
arrives; a draft that arrives while a token is in the loop waits for it, is rebased onto the tokens decoded since
its base (``core.tree.walk``/``subtree``) or found stale, and is verified in one forward; acceptance walks the tree
along the target's own tokens (position i of the output is token i; the trace says which drafts match).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tandem.cloud.budget import ForwardCost, allot, node_scores, restrict
from tandem.cloud.host_drafting import next_depth
from tandem.core.messages import EMPTY, DraftRequest, Finish, Limits, Opened, Verdict
from tandem.core.tree import DraftTree, subtree, walk

from .events import Sim
from .physics import Forward


@dataclass
class Work:
    session: object
    tokens: int  # tokens it puts in a forward (a prompt: the tokens left to compute)
    done: Callable[[float, int], None]  # (forward ms, queue us) at the end of its (last) forward
    kind: str = "target"  # "target" | "prefill"
    tree: DraftTree | None = None  # a draft's (rebased) tree, prunable under a budget
    logp: tuple[float, ...] = ()
    submitted: float = 0.0
    keep: tuple[int, ...] | None = None  # the tree's nodes a budget kept (None: all)
    context: int = 0  # the session's tokens already in the KV cache (read once by the forward)


@dataclass
class Prompt:
    """A prompt being computed in chunks: ``work.tokens`` in all, ``left`` still to go."""
    work: Work
    left: int

    @property
    def offset(self) -> int:
        return self.work.context + self.work.tokens - self.left  # tokens in its KV before its next chunk


@dataclass
class Replica:
    sim: Sim
    forward: Forward  # the target's forward time
    drafter: Forward | None = None  # unused here (server-side speculation runs on ``lockstep.LockstepReplica``)
    window_ms: float = 2.0
    max_batch_tokens: int = 512
    budget_tokens: int = 0
    batched_prefill: bool = True  # prompts share the verify forwards in chunks (the scheduler's mixed_prefill)
    # the host's serial time per verdict after a forward (acceptance, the servicer's reply): the i-th verdict of a
    # forward leaves i of them after it ends, and the next forward starts after the last (0: not modelled)
    host_ms_per_verdict: float = 0.0
    host: object = None  # the host's drafters (capsim.host.SimHost) for sessions that ask (None: none)
    open_sessions: int = 0
    busy_ms: float = 0.0  # GPU time spent
    forwards: int = 0
    beyond: int = 0  # forwards past the cost curve's last point
    batches: int = 0  # forwards holding verify work
    forward_ms: float = 0.0  # their time
    forward_tokens: int = 0  # their verify tokens
    verifies: int = 0  # target work items verified (a session's share of a forward)
    committed: int = 0  # tokens their sessions committed
    queue_ms: float = 0.0  # their waits from submission to their forward
    prefill_ms: float = 0.0  # GPU time spent on prompts (a shared forward's by its share of tokens)
    prefill_tokens: int = 0
    _waiting: deque = field(default_factory=deque)
    _prompts: deque = field(default_factory=deque)  # prompts being computed, in arrival order (batched)
    _batch: list = field(default_factory=list)
    _calls: list = field(default_factory=list)  # whole prompts run after the batch (serial)
    _used: int = 0  # the batch's tokens (budget cost)
    _members: set = field(default_factory=set)  # ids of the sessions in the batch
    _collecting: bool = False
    _busy: bool = False
    _round: int = 0  # which collection a deadline belongs to
    cost: ForwardCost = field(default_factory=ForwardCost)  # the scheduler's fit of forward time against tokens
    price: tuple[int, int] = (0, 0)  # the last forward's verdicts' price_us_per_token and batch_sessions

    def submit(self, w: Work) -> None:
        w.submitted = self.sim.now
        if w.kind == "prefill" and w.tokens <= 0:  # nothing left to compute (a one-token prompt): open at once
            self.sim.after(0.0, lambda: w.done(0.0, 0))
            return
        if w.kind == "prefill" and self.batched_prefill:
            self._prompts.append(Prompt(w, w.tokens))
            if not self._busy and not self._collecting:
                self._forward([], [])  # prompt chunks alone, at once
            return
        if self._busy:
            self._waiting.append(w)
        elif not self._collecting:
            self._start(w)
        elif not self._add(w):  # it ended the collection (the batch runs now): it goes first next time
            self._waiting.append(w)

    def _cost(self, w: Work) -> int:
        return 1 if self.budget_tokens and w.tree is not None else w.tokens

    def _start(self, first: Work) -> None:
        if first.kind == "prefill":  # serial: a whole prompt in its own forward
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
        if self._used + self._cost(w) > self.max_batch_tokens or id(w.session) in self._members:
            self._run()
            return False
        self._batch.append(w)
        self._used += self._cost(w)
        self._members.add(id(w.session))
        self._check_full()
        return True

    def _check_full(self) -> None:
        # sessions whose prompts are still being computed have no draft to send (the scheduler subtracts them)
        if self._used >= self.max_batch_tokens or len(self._batch) >= self.open_sessions - len(self._prompts):
            self._run()

    def _deadline(self, token: int) -> None:
        if self._collecting and token == self._round:
            self._run()

    def _run(self) -> None:
        if not self._collecting:
            return
        self._collecting = False
        self._forward(self._batch, self._calls)

    def _chunks(self, room: int) -> list[tuple[Prompt, int]]:
        """Prompt chunks for ``room`` tokens: the waiting prompts in arrival order, the last one taken cut to fit."""
        out = []
        for p in self._prompts:
            if room <= 0:
                break
            n = min(p.left, room)
            out.append((p, n))
            room -= n
        return out

    def _forward(self, batch: list[Work], calls: list[Work]) -> None:
        if self.budget_tokens and batch:
            self._prune(batch)
        tokens = sum(w.tokens for w in batch)
        room = (self.budget_tokens if batch and self.budget_tokens else self.max_batch_tokens) - tokens
        chunks = self._chunks(room) if self.batched_prefill else []
        chunk_tokens = sum(n for _, n in chunks)
        context = sum(w.context for w in batch) + sum(p.offset for p, _ in chunks)
        pairs = sum(w.tokens * w.context for w in batch) + sum(n * (p.offset + n // 2) for p, n in chunks)
        ms = self.forward.ms(tokens + chunk_tokens, context, pairs) if batch or chunks else 0.0
        ms_calls = [prompt_ms(self.forward, w.tokens, w.context) for w in calls]
        self.beyond += (bool(batch or chunks) and self.forward.beyond(tokens + chunk_tokens)) + \
            sum(self.forward.beyond(w.tokens) for w in calls)
        if batch:
            self.forward_ms += ms
            self.batches += 1
            self.forward_tokens += tokens
            self.verifies += len(batch)
            self.queue_ms += sum(self.sim.now - w.submitted for w in batch) * 1000
        if chunks:
            self.prefill_ms += ms * chunk_tokens / (tokens + chunk_tokens)
            self.prefill_tokens += chunk_tokens
        self.prefill_ms += sum(ms_calls)
        self.prefill_tokens += sum(w.tokens for w in calls)
        self._busy = True
        start = self.sim.now
        self.busy_ms += ms + sum(ms_calls)
        self.forwards += bool(batch or chunks) + len(calls)

        def end() -> None:
            if batch or chunks:  # as Scheduler.price: the slope fitted over the forwards so far, this one included
                self.cost.observe(tokens + chunk_tokens, ms)
                marginal = self.cost.marginal_ms()
                self.price = (round(marginal * 1000) if marginal else 0, len(batch))
            opened = []
            for p, n in chunks:
                p.left -= n
                if not p.left:
                    self._prompts.remove(p)
                    opened.append(p.work)
            host = self.host_ms_per_verdict
            for i, w in enumerate(batch, 1):  # the scheduler applies each verdict in turn before its next forward
                if host:
                    self.sim.after(i * host / 1000, lambda w=w, q=int((start - w.submitted) * 1e6), i=i:
                                   w.done(ms + i * host, q))
                else:
                    w.done(ms, int((start - w.submitted) * 1e6))
            for w in opened:
                w.done(ms, int((start - w.submitted) * 1e6))
            t = 0.0
            for w, c in zip(calls, ms_calls):
                t += c
                w.done(c, int((start + ms / 1000 + t / 1000 - c / 1000 - w.submitted) * 1e6))
            if host and batch:
                self.sim.after(len(batch) * host / 1000, self._free)
            else:
                self._free()

        self.sim.after((ms + sum(ms_calls)) / 1000, end)

    def _free(self) -> None:
        """The forward and its verdicts are done: the next batch may run."""
        self._busy = False
        if self._waiting:
            self._start(self._waiting.popleft())
            while self._waiting and self._collecting:
                if not self._add(self._waiting[0]):
                    break
                self._waiting.popleft()
        elif self._prompts:
            self._forward([], [])

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


def prompt_ms(forward: Forward, tokens: int, context: int) -> float:
    """A whole prompt of ``tokens`` after ``context`` cached ones, in one forward; on a curve that refuses to
    extrapolate, in forwards of its largest measured size one after another."""
    step = tokens if forward.allows(tokens) else forward.curve.tokens[-1]
    ms, done = 0.0, 0
    while done < tokens:
        n = min(step, tokens - done)
        ms += forward.ms(n, context + done, n * (context + done + n // 2))
        done += n
    return ms


class VerifierSession:
    """One session on a replica; ``reply`` carries each Opened / Verdict back (the caller's link). ``cached``: the
    prompt's first tokens already in the replica's prefix cache (the conversation so far), not computed again."""

    def __init__(self, replica: Replica, prompt_len: int, limits: Limits, reply: Callable[[object], None],
                 decode_steps: int, sid: str, cached: int = 0, hosted: bool = False, ranks=None, partition: str = ""):
        """``hosted``: the run is the host's to draft (Open.host_draft), on ``ranks`` (the text's trace)."""
        self.replica, self.prompt_len, self.limits, self.reply = replica, prompt_len, limits, reply
        self.committed_len, self.finish, self.sid = prompt_len, Finish.NONE, sid
        self.run, self.draft, self.busy, self.closed = decode_steps, None, True, False
        self.host, self.hosted, self.ranks, self.partition = replica.host, hosted, ranks, partition
        cached = min(cached, prompt_len - 1)
        self.host_seen = cached  # tokens a host drafter holds for it (its conversation's)
        self.depth = self.host.depth_of(partition) if self.host is not None else 0
        self.warming = False  # the host catching up on the prompt (beside its prefill)
        if self.host is not None and hosted and ranks is not None and self.host.seats.take(sid):
            self.warming = True
            self.host.warm(prompt_len, cached, partition, self._warmed)
        replica.open_sessions += 1
        replica.submit(Work(self, prompt_len - 1 - cached, self._opened, "prefill", context=cached))

    def token(self, pos: int) -> int:
        return pos - self.prompt_len  # output position i is token i

    def generated(self) -> int:
        return self.committed_len - self.prompt_len

    def _warmed(self) -> None:
        self.warming = False
        self.host_seen = max(self.host_seen, self.prompt_len)

    def _opened(self, ms: float, queue_us: int) -> None:
        if self.closed:
            return
        host = self.host
        self.reply(Opened(self.sid, self.limits, int(ms * 1000),
                          host_drafter="sim-host" if host is not None and host.offered(self.sid) else "",
                          host_level_us=host.level_us if host else 0))
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
            if self.host is not None:
                self.host.seats.release(self.sid)

    def _step(self) -> None:
        if self.closed or self.finish is not Finish.NONE or self.busy:
            return
        if self.draft is not None:
            d, self.draft = self.draft, None
            self._verify(d)
        elif self.run > 0 and self.hosted and self.host is not None and self.ranks is not None:
            if not self.host.seats.take(self.sid):
                self.run -= 1  # every seat taken: decoded alone, the verdict saying the host serves none of its steps
                self._verify(DraftRequest(self.committed_len), unseated=True)
            elif self.warming:
                self._verify(DraftRequest(self.committed_len), host=True)  # decoded alone: the host is catching up
            else:
                self.busy = True  # the host drafts a chain, then it is verified like a client's tree
                depth = min(self.depth, self.limits.max_tree_depth)
                self.host.chain(self.ranks, self.generated(), self.committed_len, self.host_seen, depth,
                                self._hosted, self.partition)
        elif self.run > 0:
            self.run -= 1
            self._verify(DraftRequest(self.committed_len))

    def _hosted(self, chain: DraftTree) -> None:
        self.host_seen = self.committed_len
        self.busy = False
        if self.closed or self.finish is not Finish.NONE:
            return
        self.busy = True
        self._verify(DraftRequest(self.committed_len, chain), host=True)

    def _verify(self, d: DraftRequest, host: bool = False, unseated: bool = False) -> None:
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
                                                                      work, ms, q, host, unseated),
                    tree=tree, logp=logp, context=have)
        self.replica.submit(work)

    def _verified(self, d: DraftRequest, tree: DraftTree, nodes, rebased: int, stale: bool, work: Work, ms: float,
                  queue_us: int, host: bool = False, unseated: bool = False) -> None:
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
        took = tuple(nodes[i] for i in accepted)
        hosted: dict = {}
        if host:  # the verdict names the host's accepted tokens (the client never saw the chain)
            hosted = dict(host_tokens=tuple(d.tree.tokens[n] for n in took), host_drafted=len(d.tree),
                          host_level_us=self.host.level_us)
            self.depth = next_depth(self.depth, len(d.tree), len(took), self.limits.max_tree_depth)
            self.host.depths[self.partition] = self.depth
            took, self.run = (), max(0, self.run - new)
        elif unseated:
            hosted = dict(host_level_us=self.host.pace.unseated_us)
        self.reply(Verdict(took, bonus, self.committed_len, self.finish, queue_us,
                           int(ms * 1000), d.seq, rebased, stale, len(tree) + 1, (), pruned,
                           price_us_per_token=self.replica.price[0], batch_sessions=self.replica.price[1], **hosted))
        self.busy = False
        if d.seq:
            self.run, self.hosted = d.decode_steps, d.host_draft
            if not d.host_draft and self.host is not None:
                self.host.seats.release(self.sid)  # the client drafts again itself
        self._step()
