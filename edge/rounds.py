"""The edge's round loop as a pure state machine: no network, no drafter, no clock of its own.

Events go in (``begin``, ``on_opened``, ``on_verdict``, ``on_job_done``, ``on_stop_string``, ``on_connection_lost``,
each with the time it happened); actions come out: messages to send (``SendOpen``, ``SendDraft``, ``SendClose``),
drafter jobs to run one at a time in order (``Job``), and committed tokens to hand to the user (``Emit``), all in
edge/actions.py; what each verdict showed is counted in ``GenerationStats`` (edge/generation_stats.py). The client
(edge/client.py) is the thin transport around it, the way llama.cpp's ``common_speculative_*`` API sits under
``speculative-simple``.

One generation, latency objective (the planner's ``stream``):

    edge                                                    verifier
    Open(prompt, decode_steps=run) ───────────────────────▶ prefill, then decode alone: one Verdict per token
    drafter catches up on the prompt      ◀─────────────── Verdict(seq 0) x n   (text streams at once)
    Draft(seq 1, tree below committed length L) ──────────▶ stops its run, walks the tree along the tokens it
                                                             decoded since L, verifies the subtree below
                                          ◀─────────────── Verdict(seq 1, rebased, accepted, bonus), then
                                                             decodes alone again until the next Draft
    commit the path to the drafter, draft again ...

So the target never waits for the edge: drafting overlaps the verifier's own decoding, a tree only adds tokens
to what the verifier would have produced alone, and the first token leaves as soon as the prefill ends. With the
cloud-cost objective (``stream`` False) the verifier waits for each tree instead, so every forward verifies one.

While a tree is in flight, the drafter may draft the next one assuming its first choices are accepted
(``speculate``, both drafter engines): when the verdict confirms the guess, the next tree goes out at once; not
where the planner has measured that a working drafter slows the verifier (``overlap_ok``).

While the verifier streams with no tree wanted, the idle drafter may draft a *shadow* chain (the planner's
``shadow``) on the committed text: it is never sent, and scored against the tokens that stream in after it
(``observe_shadow``). So the planner learns this request's acceptance at no cloud cost, and knows when drafting
would pay without probing it.

Invariants: ``committed`` is the source of truth (prompt + every committed token, in order); the drafter's history
is ``committed[:drafter_len]`` once its queued jobs have run; at most one tree is in flight and one drafting job
is outstanding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from tandem.core.errors import TandemError
from tandem.core.messages import EMPTY, HASH_START, DraftRequest, Finish, Limits, Opened, Verdict, extend_hash
from tandem.core.tree import DraftTree, TreeShape, subtree, walk

from .actions import Action, Emit, Job, SendClose, SendDraft, SendOpen
from .drafting import BuiltTree, first_choice_path, graft
from .generation_stats import GenerationStats
from .planner import LONG_RUN, Planner, Round

NO_TREE = BuiltTree(EMPTY, (), ())
GRAFT_LOGP = math.log(0.5)  # a repeated span's node (the drafter never scored it): half its parent's probability


def sent_logp(built: BuiltTree, sent: DraftTree, to_book: tuple[int, ...],
              prefix: tuple[int, ...]) -> tuple[float, ...]:
    """The path log-probability of each sent node below the draft's root (what the verifier ranks nodes by when it
    prunes under load): the drafter's own, relative to the node the sent tree hangs below (``prefix``'s last node),
    and ``GRAFT_LOGP`` per level for grafted nodes."""
    if not len(sent) or len(built.logp) != len(built.tree):
        return ()
    offset = built.logp[prefix[-1]] if prefix else 0.0
    out: list[float] = []
    for i, b in enumerate(to_book):
        parent = sent.parents[i]
        own = built.logp[b] - offset if b >= 0 else (out[parent] if parent >= 0 else 0.0) + GRAFT_LOGP
        out.append(min(0.0, own))  # float rounding can leave a certain token a hair above 0
    return tuple(out)


class ProtocolError(TandemError, RuntimeError):
    """The verifier answered something the protocol does not allow (a bug on one side, never a user error)."""


# -- the machine ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Flight:
    """The tree on the wire and how it maps onto the drafter's tree (``built``): they differ after a hit of a
    speculative tree (the wire then carries the subtree below the guessed bonus node) and by grafted nodes."""
    seq: int
    base: int  # committed length the tree hangs below
    built: BuiltTree
    sent: DraftTree
    to_book: tuple[int, ...]  # sent node -> built node, -1 for a grafted (n-gram) node
    book_prefix: tuple[int, ...]  # built nodes committed above the sent root
    sent_at: float
    draft_ms: float
    run: int = 0  # tokens the verifier decodes alone after this draft's verdict


@dataclass(frozen=True)
class _Speculation:
    flight_seq: int
    path: tuple[int, ...]  # built nodes of the flight assumed accepted
    built: BuiltTree  # drafted on history + path; its first root child is the guessed bonus


class RoundLoop:
    def __init__(self, prompt: Sequence[int], max_new_tokens: int, planner: Planner, caps: Limits,
                 ngram=None, speculate: bool = False):
        """``caps``: the largest tree this client drafts (the server's granted limits cap it further);
        ``ngram``: an ``edge.ngram.NgramDrafter`` whose proposals are grafted onto every tree; ``speculate``:
        draft the next tree while a verdict is in flight (needs a drafter with ``speculate``/``adopt``)."""
        self.committed = list(prompt)
        self._hash = extend_hash(HASH_START, prompt)  # of ``committed``, checked against every verdict's
        self.prompt_len = len(prompt)
        self.max_new_tokens = max_new_tokens
        self.planner = planner
        self.limits = caps
        self.caps = caps
        self.ngram = ngram
        self.speculate = speculate
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.finish: str | None = None  # "stop" | "length"
        self._seq = 0
        self._tag = 0
        self._flight: _Flight | None = None
        self._spec: _Speculation | None = None
        self._job: tuple[int, str, int] | None = None  # (tag, kind, committed length it drafts on / flight seq)
        self._ops: list[tuple] = []  # drafter operations not yet run: they go first in the next job
        self._spec_tried = 0  # flight seq whose speculation was started (one per flight)
        self._drafter_len = 0  # committed tokens in the drafter's history once its queued jobs have run ...
        self._unevaluated = 0  # ... of which its first catch-up has yet to evaluate (a prompt started cold)
        self._drafter_full = False
        self._idle = False  # the verifier waits for a draft (no run of tokens decoded alone is going on)
        self._host_run = False  # the run of tokens decoded alone asked the verifier's host to draft them
        self._opened = False
        self._hold_first = False  # no drafting before the stream's first token (see ``begin``)
        self._no_shadow_before = 0  # no shadow chain before this many committed tokens (after an empty one)
        self._t_open = 0.0
        self._t_last = 0.0  # last verdict (or open)
        self._shadow: tuple[int, tuple[int, ...], float] | None = None  # (base, chain, draft ms) awaiting its score
        self._worked = False  # the drafter ran a job since the last verdict

    @property
    def generated(self) -> list[int]:
        return self.committed[self.prompt_len:]

    # -- events ---------------------------------------------------------------------------------------------------
    def begin(self, now: float) -> list[Action]:
        """Open a session on the committed history (at the start, and after a lost connection)."""
        self._opened, self._t_open, self._t_last = False, now, now
        self._idle = not self.planner.stream_first
        # a planner that does not warm the drafter up alongside the prefill (where the drafter slows the verifier)
        # must not start its first draft's catch-up alongside the first token either: it waits for that token
        self._hold_first = not self._idle and not self.planner.drafts
        self._host_run = not self._idle and self._wants_host()
        acts: list[Action] = [SendOpen(tuple(self.committed), self.max_new_tokens - len(self.generated),
                                       0 if self._idle else LONG_RUN, len(self.generated), self._host_run)]
        if self._drafter_len == 0 and self._job is None:  # the drafter catches up while the verifier prefills
            self._drafter_len = len(self.committed)
            catch_up = (("catch_up",),) if self.planner.drafts else ()  # (none for a planner that never drafts)
            self._unevaluated = 0 if catch_up else len(self.committed)  # (then its first draft evaluates it)
            acts.append(self._new_job("start", (("start", tuple(self.committed)),) + catch_up))
        return acts

    def on_opened(self, opened: Opened, now: float) -> list[Action]:
        self._opened = True
        self.stats.prefill_us += opened.prefill_us
        if (observe_host := getattr(self.planner, "observe_host", None)) is not None:  # (None: no host this session)
            observe_host(opened.host_level_us / 1000 if opened.host_drafter else None, 0, 0)
        if not self.stats.resumes:  # the prompt's; a resume re-opens on generated tokens too
            self.stats.cached_tokens = min(opened.cached_tokens, self.prompt_len)
        self.limits = Limits(opened.limits.max_new_tokens, min(self.caps.max_tree_nodes,
                                                               opened.limits.max_tree_nodes),
                             min(self.caps.max_tree_depth, opened.limits.max_tree_depth))
        return self._maybe_draft(now)

    def on_verdict(self, v: Verdict, now: float) -> list[Action]:
        if self.finish is not None:  # sent before the verifier read our Close (e.g. after a stop string)
            return []
        self._hold_first = False
        flight = self._flight
        path: list[int] = []  # the sent tree's nodes the verdict settles
        if v.draft_seq == 0:
            if v.accepted:
                raise ProtocolError("a token decoded alone came with accepted tree nodes")
            tokens = v.tokens(EMPTY)
        elif flight is not None and v.draft_seq == flight.seq:
            self._flight = None
            self._idle = flight.run == 0
            tokens, path = self._tree_tokens(flight, v)
        else:
            raise ProtocolError(f"verdict for draft {v.draft_seq}, but "
                                f"{'draft ' + str(flight.seq) if flight else 'no draft'} is in flight")
        self.committed.extend(tokens)
        self._hash = extend_hash(self._hash, tokens)
        self._check_committed(v)
        tree = flight if v.draft_seq else None  # the flight this verdict settles (None: a token decoded alone)
        self._account(v, tree, path, now)
        self._score_shadow()
        if self.ngram is not None:
            self.ngram.extend(tokens)
        acts: list[Action] = [Emit(tuple(tokens))] if tokens else []
        if v.finish is not Finish.NONE:
            self.finish = "length" if v.finish is Finish.LENGTH else "stop"
            return acts + [SendClose()]
        if tree is not None:
            acts += self._after_tree(tree, v, path, now)
        return acts + self._maybe_draft(now)

    def on_job_done(self, tag: int, result, draft_ms: float, catch_up: tuple[int, float], now: float) -> list[Action]:
        """A drafter job finished: ``result`` of its last op; ``draft_ms`` its drafting time; ``catch_up``
        (tokens, ms) the committed tokens it evaluated first and how long that took."""
        if self._job is None or self._job[0] != tag:
            return []  # a job of an abandoned plan (a lost connection): its effect is undone by later jobs
        _, kind, base = self._job
        self._job = None
        if catch_up[0]:
            self.planner.observe_catch_up(*catch_up, waited=self._idle)  # idle: the verifier waited for it
        if self.finish is not None:
            return []
        if kind == "draft":
            return self._drafted(result, base, draft_ms, now) + self._maybe_draft(now)
        if kind == "shadow":
            return self._shadow_drafted(result, base, draft_ms) + self._maybe_draft(now)
        if kind == "speculate":
            self.stats.speculate_us += int(draft_ms * 1000)
            f = self._flight
            if result is not None and f is not None and f.seq == base and result.tree.children[0]:
                self._spec = _Speculation(f.seq, self._spec_path(f), result)
            return self._maybe_draft(now)
        return self._maybe_draft(now)  # start / commit-only jobs

    def on_stop_string(self) -> list[Action]:
        self.finish = "stop"
        return [SendClose()]

    def on_connection_lost(self) -> list[Action]:
        """The verifier went away: drop the tree in flight (the drafter keeps what was committed). Then ``begin``
        re-opens on the committed history."""
        f, self._flight, self._spec = self._flight, None, None
        if f is not None:
            self._queue_commit(f.built, f.book_prefix, f.base - len(f.book_prefix))
        if self._job is not None and self._job[1] in ("draft", "speculate", "shadow"):
            self._job = None  # its tree will not be sent; the next job's first op resets the drafter's trees
            self._ops.append(("extend", ()))
        return []

    # -- helpers --------------------------------------------------------------------------------------------------
    def _new_job(self, kind: str, ops: tuple[tuple, ...], base: int = 0) -> Job:
        """A drafter job: the queued operations first (commits of earlier trees), then ``ops``."""
        self._tag += 1
        self._job = (self._tag, kind, base)
        if kind in ("draft", "shadow", "speculate"):  # each evaluates what the drafter holds before it drafts
            self._unevaluated = 0
        self._worked = True
        ops, self._ops = tuple(self._ops) + ops, []
        return Job(self._tag, ops)

    def _queue_commit(self, built: BuiltTree, path: tuple[int, ...], history_len: int) -> None:
        """Tell the drafter (with its next job) the verdict on its tree ``built``, drafted on ``history_len``
        committed tokens: the built nodes ``path`` were committed, and every token committed since."""
        self._ops.append(("commit", built, path, tuple(self.committed[history_len:])))
        self._drafter_len = len(self.committed)

    def _pending(self) -> tuple[int, ...]:
        return tuple(self.committed[self._drafter_len:])

    def _to_evaluate(self) -> int:
        """Committed tokens the drafter has not evaluated: what drafting now would first cost it (a cold prompt's
        whole length: a policy's entry into a drafting mode is priced on it)."""
        return len(self.committed) - self._drafter_len + self._unevaluated

    def _maybe_draft(self, now: float) -> list[Action]:
        if self.finish is not None or not self._opened or self._job is not None or self._hold_first:
            return []
        if self._flight is not None:
            return self._maybe_speculate(self._flight)
        shape = None if self._drafter_full else self.planner.shape(self._to_evaluate())
        if shape is None:  # no tree now: make sure the verifier is decoding alone (drafted by its host if the
            # planner asks), not waiting for one
            if self._idle or self._host_run != self._wants_host():
                return self._send(NO_TREE, EMPTY, (), (), len(self.committed), now, 0.0, LONG_RUN)
            return self._maybe_shadow()
        shape = TreeShape(shape.k, min(shape.n, self.limits.max_tree_nodes), min(shape.d, self.limits.max_tree_depth))
        return [self._draft_job("draft", shape)]

    def _draft_job(self, kind: str, shape: TreeShape) -> Job:
        """Draft ``shape`` below the committed text; extend also clears any abandoned tree."""
        ops = (("extend", self._pending()), ("draft", shape))
        self._drafter_len = len(self.committed)
        return self._new_job(kind, ops, len(self.committed))

    def _maybe_shadow(self) -> list[Action]:
        """A shadow chain while the verifier streams (after its first token: not slowing a prefill it may share
        cores with), one at a time, when the planner asks for one."""
        if self._drafter_full or self._shadow is not None or not self.generated or \
                len(self.committed) < self._no_shadow_before:
            return []
        shape = self.planner.shadow(self._to_evaluate())
        if shape is None:
            return []
        depth = min(shape.d, self.limits.max_tree_depth)
        return [self._draft_job("shadow", TreeShape(1, depth, depth))]

    def _shadow_drafted(self, built: BuiltTree, base: int, draft_ms: float) -> list[Action]:
        self._queue_commit(built, (), base)  # nothing of it is committed: the drafter drops it, keeps the stream
        if not len(built.tree):
            self._drafter_full = built.full
            self._no_shadow_before = len(self.committed) + 1  # nothing this round: the next after the next token
            return []
        tokens = tuple(built.tree.tokens[i] for i in first_choice_path(built.tree))
        self._shadow = (base, tokens, draft_ms)
        self._score_shadow()
        return []

    def _score_shadow(self) -> None:
        """Score the shadow chain once the stream has decided it: at its first mismatch, or when every node
        matched."""
        if self._shadow is None:
            return
        base, chain, draft_ms = self._shadow
        seen = self.committed[base: base + len(chain)]
        matched = next((i for i, (a, b) in enumerate(zip(chain, seen)) if a != b), len(seen))
        if matched == len(seen) < len(chain):
            return  # every streamed token so far matched: wait for more
        self._shadow = None
        self.stats.shadow_chains += 1
        self.stats.shadow_accepted += matched
        self.planner.observe_shadow(len(chain), matched, draft_ms)

    def _maybe_speculate(self, f: _Flight) -> list[Action]:
        """A speculative tree below the flight ``f``'s likeliest outcome, drafted while its verdict is on the way."""
        if not self.speculate or not self.planner.overlap_ok or self._spec_tried == f.seq or not len(f.sent):
            return []
        shape = self.planner.peek(0)
        if shape is None:
            return []
        self._spec_tried = f.seq
        shape = TreeShape(shape.k, min(shape.n, self.limits.max_tree_nodes) + 1,
                          min(shape.d, self.limits.max_tree_depth) + 1)  # one level more: the guessed bonus
        return [self._new_job("speculate", (("speculate", f.built, self._spec_path(f), shape),), f.seq)]

    @staticmethod
    def _spec_path(f: _Flight) -> tuple[int, ...]:
        """The drafter's single best guess of the flight's outcome, in built nodes."""
        return f.book_prefix + tuple(_book_nodes(f, first_choice_path(f.sent)))

    def _drafted(self, built: BuiltTree, base: int, draft_ms: float, now: float) -> list[Action]:
        if not len(built.tree):
            self._queue_commit(built, (), base)
            if built.full:  # the drafter's context is full: the verifier decodes alone from here
                self._drafter_full = True
                return self._maybe_draft(now)
            # nothing to draft this round only (a translating drafter's text spelled no whole target token): the
            # verifier decodes this round's token alone, and the next round drafts again
            return self._send(NO_TREE, EMPTY, (), (), len(self.committed), now, draft_ms, 0)
        if walk(built.tree, self.committed[base:]) is None:  # tokens committed while drafting left the tree
            self.stats.dead_trees += 1
            self._queue_commit(built, (), base)
            return []
        sent, added = built.tree, 0
        if self.ngram is not None:  # a free branch from repeated spans
            sent, added = graft(built.tree, self.ngram.propose(self.limits.max_tree_depth, end=base),
                                self.limits.max_tree_nodes, self.limits.max_tree_depth)
            self.stats.ngram_nodes += added
        to_book = tuple(range(len(built.tree))) + (-1,) * added
        self.stats.draft_us += int(draft_ms * 1000)
        return self._send(built, sent, to_book, (), base, now, draft_ms)

    def _send(self, built: BuiltTree, sent: DraftTree, to_book: tuple[int, ...], prefix: tuple[int, ...],
              base: int, now: float, draft_ms: float, run: int | None = None) -> list[Action]:
        self._seq += 1
        run = (LONG_RUN if self.planner.stream else 0) if run is None else run
        self._flight = _Flight(self._seq, base, built, sent, to_book, prefix, now, draft_ms, run)
        self._spec = None
        self._idle = False
        self._host_run = bool(run) and not len(sent) and self._wants_host()  # (device trees: runs decoded alone)
        self.stats.trees += len(sent) > 0
        return [SendDraft(DraftRequest(base, sent, self._seq, (), run, sent_logp(built, sent, to_book, prefix),
                                       self._host_run))]

    def _wants_host(self) -> bool:
        return bool(getattr(self.planner, "host", False))

    def _check_committed(self, v: Verdict) -> None:
        """The verifier committed what the edge did: the same length, and (the rolling hash) the same tokens. A
        token that differs is caught here however it came about (a verifier bug, a tampered link)."""
        if v.committed_len != len(self.committed):
            raise ProtocolError(f"verifier reports committed length {v.committed_len}, the edge has "
                                f"{len(self.committed)}")
        if v.committed_hash and v.committed_hash != self._hash:
            raise ProtocolError(f"the verifier's committed tokens differ from the edge's at committed length "
                                f"{v.committed_len} (hash {v.committed_hash:016x}, the edge's {self._hash:016x})")

    def _tree_tokens(self, f: _Flight, v: Verdict) -> tuple[list[int], list[int]]:
        """The tokens a tree verdict commits, and the sent-tree path they settle (rebased levels included)."""
        if v.stale:
            return [v.bonus], []
        new = v.tokens(f.sent)
        since = self.committed[f.base: v.committed_len - len(new)]
        node = walk(f.sent, since) if len(f.sent) or not since else -1  # (an empty tree, e.g. the run handed to
        # the host while the verifier decoded alone, is never stale: the tokens before it stay before it)
        if node is None or len(since) != v.rebased:
            raise ProtocolError(f"verdict on draft {f.seq} says it was rebased by {v.rebased} tokens, the edge "
                                f"sees {len(since)} committed since the draft's base, on "
                                f"{'no' if node is None else 'a'} path of its tree")
        path = f.sent.path_to(node) if node >= 0 else []
        parent = node
        for i in v.accepted:
            if not 0 <= i < len(f.sent) or f.sent.parents[i] != parent:
                raise ProtocolError(f"verdict on draft {f.seq} accepts node {i}, not a child of node {parent}")
            parent = i
        return new, path + list(v.accepted)

    def _after_tree(self, f: _Flight, v: Verdict, path: list[int], now: float) -> list[Action]:
        history_len = f.base - len(f.book_prefix)  # the drafter's history when it drafted f.built
        book = list(f.book_prefix) + _book_nodes(f, path)
        spec, self._spec = self._spec, None
        all_book = all(f.to_book[i] >= 0 for i in path)  # no grafted node: the drafter saw the whole path
        if spec is not None and not v.stale and all_book and spec.flight_seq == f.seq and not self._ops and \
                tuple(book) == spec.path and v.bonus == spec.built.tree.tokens[spec.built.tree.children[0][0]]:
            # the guess held: the speculative tree's subtree under the bonus goes out right away
            self.stats.proactive_hits += 1
            self._drafter_len = v.committed_len - 1  # history + the path (the bonus is not evaluated yet)
            bonus_node = spec.built.tree.children[0][0]
            sent, to_book = subtree(spec.built.tree, bonus_node)
            adopt = self._new_job("adopt", (("adopt",),))
            return [adopt] + self._send(spec.built, sent, to_book, (bonus_node,), v.committed_len, now, 0.0)
        self._queue_commit(f.built, tuple(book), history_len)
        return []

    def _account(self, v: Verdict, f: _Flight | None, path: list[int], now: float) -> None:
        s = self.stats
        if not s.generated_tokens and len(self.committed) > self.prompt_len:
            s.ttft_s = now - self._t_open
        s.generated_tokens = len(self.committed) - self.prompt_len
        s.verify_us += v.verify_us
        s.queue_us += v.queue_us
        s.forward_tokens += v.forward_tokens
        s.price_us_per_token, s.batch_sessions = v.price_us_per_token, v.batch_sessions
        if (observe_price := getattr(self.planner, "observe_price", None)) is not None:  # (a planner may not price)
            observe_price(v.price_us_per_token / 1000, v.batch_sessions, v.token_budget)
        gap_ms, first = (now - self._t_last) * 1000, self._t_last == self._t_open
        committed = len(v.host_tokens) + len(v.accepted) + (v.bonus >= 0)
        self._t_last = now
        # the drafter worked during this verdict's forward if it ran a job since the last verdict
        overlapped, self._worked = self._worked, self._job is not None
        if f is None:
            s.streamed_tokens += committed
            s.host_tokens += len(v.host_tokens)
            s.record_round(0, 0, 0)
            # (a verdict of the host's pace alone: a host step it had no seat for, decoded alone)
            if (v.host_drafted or v.host_level_us) and (observe_host := getattr(self.planner, "observe_host",
                                                                                 None)) is not None:
                observe_host(v.host_level_us / 1000, v.host_drafted, len(v.host_tokens))
            self.planner.observe(Round(0, 0, 0, 0, 0, 0.0, (v.verify_us + v.queue_us) / 1000, gap_ms,
                                       streamed=True, tokens=committed, gap_ms=gap_ms, first=first,
                                       overlapped=overlapped, forward_ms=v.verify_us / 1000,
                                       pending=self._to_evaluate(), forward_tokens=max(1, v.forward_tokens)))
            return
        round_ms = (now - f.sent_at) * 1000
        s.network_us += max(0, int(round_ms * 1000) - v.verify_us - v.queue_us)
        s.rebased_tokens += v.rebased
        s.stale_trees += v.stale
        s.ngram_accepted += sum(1 for i in v.accepted if f.to_book[i] < 0)
        verified_depth = max(0, f.sent.depth - v.rebased) if not v.stale else 0
        if v.pruned_nodes:  # the verifier's budget cut the tree: levels past the accepted ones may not have been tried
            s.pruned_nodes += v.pruned_nodes
            verified_depth = len(v.accepted)
        s.record_round(verified_depth, v.forward_tokens - 1, len(v.accepted))
        chain = 0  # leading accepted nodes that were the drafter's first choice under their parent
        for node in v.accepted:
            if f.sent.children[f.sent.parents[node] + 1][0] != node:
                break
            chain += 1
        width = max((len(c) for c in f.built.tree.children), default=0)  # the drafter's own width
        tried, held = _first_choices(f.sent, self.committed[f.base: v.committed_len])
        self.planner.observe(Round(width, verified_depth, v.forward_tokens - 1, len(v.accepted), chain,
                                   f.draft_ms, (v.verify_us + v.queue_us) / 1000, round_ms, False, v.rebased,
                                   v.stale, v.forward_tokens, committed, gap_ms, first, overlapped,
                                   v.verify_us / 1000, self._to_evaluate(), tried, held))


def _first_choices(tree: DraftTree, committed: Sequence[int]) -> tuple[int, int]:
    """(levels judged, leading levels held) of ``tree``'s first-choice chain against the ``committed`` tokens that
    followed its root: a level is judged when the target's token there is known, and holds when it is the first
    choice's. A stale tree's chain too (the tokens decoded alone meanwhile left it somewhere)."""
    node, held = -1, 0
    for token in committed:
        kids = tree.children[node + 1]
        if not kids or tree.tokens[kids[0]] != token:
            return (held + 1 if kids else held), held
        node, held = kids[0], held + 1
    return held, held


def _book_nodes(f: _Flight, sent_path: Sequence[int]) -> list[int]:
    """A path of sent nodes as the drafter's nodes, up to the first grafted (n-gram) node the drafter never saw."""
    out = []
    for i in sent_path:
        if f.to_book[i] < 0:
            break
        out.append(f.to_book[i])
    return out
