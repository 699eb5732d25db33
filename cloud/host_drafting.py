"""Drafting on the verifier's host (DuoDecoding: the host's CPU cores draft while its GPU verifies).

A session asks for it (``Open.host_draft``, ``Draft.host_draft``) when its device cannot draft (a thin client, a
browser without a drafter), drafts slower than the host would, or is far away: every device-drafted round pays the
device's drafting and a round trip, a host-drafted step pays neither. During the session's run of tokens decoded
alone (``decode_steps``) the servicer asks the host for a chain below the committed tokens and verifies it like a
client's tree; the verdict commits the target's own tokens, so the output is the target's whatever the host drafts.

The drafting engine sits behind ``HostDrafter`` (the orchestrator builds one from the edge's drafters). Contract on
partitions: a drafter keeps the cells of the last history it drafted on, so a session's next step evaluates only the
tokens committed since; it never reuses cells computed for another cache partition (their timing would tell one
tenant of another's prompt), forgetting them first.

How deep: ``next_depth`` (a pure rule, table-tested) grows a session's chains while the target takes them whole and
shrinks them when most is rejected, between 1 and the session's granted depth. A session starts at the depth its
partition's last session ended at (its tenant's own kind of text; nothing learnt from another partition).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Hashable, Protocol, Sequence

from tandem.core.messages import EMPTY, HASH_START, Opened, Verdict, extend_hash
from tandem.core.tree import DraftTree

log = logging.getLogger("tandem.cloud.host_drafting")

START_DEPTH = 4  # a partition's first host chain (before any of its acceptance is seen)
MIN_SERVED = 0.05  # (a host that serves almost no step publishes a pace 20x its drafting's, not infinity)
PARTITIONS_KEPT = 4096  # partitions whose last depth the host remembers (least recently used forgotten first)


class HostDrafter(Protocol):
    name: str  # the drafter model's identity (Opened.host_drafter)
    slots: int  # drafts it can run at once

    def draft(self, partition: str, tokens: Sequence[int], depth: int) -> list[int]:
        """At most ``depth`` tokens the drafter expects after ``tokens`` (its first choices), drafted on cells of
        ``partition``'s histories only (depth 0: ``tokens`` evaluated, nothing drafted). Blocking: runs on one of
        ``slots`` worker threads."""
        ...


def next_depth(depth: int, drafted: int, accepted: int, cap: int) -> int:
    """The next chain's depth after one of ``drafted`` tokens of which the target took ``accepted``: one deeper when
    it took them all, one shallower when it took less than half, else the same; within [1, cap]. (A chain the host
    cut short, e.g. at the drafter's context, says nothing about depth.)"""
    if drafted < depth:
        nxt = depth
    elif accepted >= drafted:
        nxt = depth + 1
    elif 2 * accepted < drafted:
        nxt = depth - 1
    else:
        nxt = depth
    return max(1, min(cap, nxt))


@dataclass
class HostSeats:
    """Which sessions the host drafts for: one seat a drafter, taken at a session's first host step (or its open,
    where it asks then) and held until it drafts again itself or ends. A seated session finds its drafter free at
    every step, so its chains come at the drafter's pace; a session that finds every seat taken is told so (its
    open names no host drafter; a host step of its is decoded alone, its verdict publishing the pace of a host that
    serves none of its steps), and its policy drafts itself or decodes plainly. (Drafters shared by chance would
    cost every session a random share of its steps, decoded alone: its answer's pace a lottery, which the tail of
    per-token latency pays.) The verifier's host and the simulator's keep it alike."""

    capacity: int
    held: set[Hashable] = field(default_factory=set)

    @property
    def free(self) -> bool:
        return len(self.held) < self.capacity

    def take(self, sid: Hashable) -> bool:
        """``sid`` holds a seat (taking one if free)."""
        if sid not in self.held and self.free:
            self.held.add(sid)
        return sid in self.held

    def release(self, sid: Hashable) -> None:
        self.held.discard(sid)


@dataclass
class HostPace:
    """The pace a host publishes (what clients price host drafting by): a drafted level's time over the share of
    steps that found a drafter free (a step that finds none is decoded alone: as if the host drafted that much
    slower), both as moving averages. The verifier's host and the simulator's keep it alike."""

    ewma: float = 0.2
    level: float = 0.0  # a drafted level's time, us (0: nothing drafted yet)
    served: float = 1.0  # the share of the steps asked that found a drafter free

    def asked(self, free: bool) -> None:
        self.served = (1 - self.ewma) * self.served + self.ewma * free

    def drafted(self, us: float, levels: int) -> None:
        if levels:
            per_level = us / levels
            self.level = per_level if not self.level else (1 - self.ewma) * self.level + self.ewma * per_level

    @property
    def level_us(self) -> int:
        return int(self.level / max(self.served, MIN_SERVED))

    @property
    def unseated_us(self) -> int:
        """The pace a session without a seat sees: a host that serves none of its steps (1 ms a level when
        nothing was drafted yet: never 0, which means "not measured")."""
        return int(max(self.level, 1000.0) / MIN_SERVED)


class HostDrafting:
    """The servicer's front to a ``HostDrafter``: its drafts on worker threads, off the event loop, and the recent
    pace (what clients price host drafting by). A step that finds every drafter busy is decoded alone."""

    def __init__(self, drafter: HostDrafter, ewma: float = 0.2):
        self.drafter = drafter
        self.name = drafter.name
        self.pace = HostPace(ewma)
        self.busy = 0  # chains being drafted
        self.seats = HostSeats(max(1, drafter.slots))
        self._depths: OrderedDict[str, int] = OrderedDict()  # partition -> the depth its last chain left
        self._pool = ThreadPoolExecutor(max(1, drafter.slots), thread_name_prefix="host-drafter")

    @property
    def level_us(self) -> int:
        return self.pace.level_us

    async def chain(self, partition: str, tokens: Sequence[int], depth: int) -> DraftTree:
        """A chain of at most ``depth`` tokens below ``tokens``; empty when the drafter has nothing to offer, or
        when every drafter is busy (the step is decoded alone: the verifier never waits for the host)."""
        free = self.busy < self.drafter.slots
        self.pace.asked(free)
        if not free:
            return EMPTY
        self.busy += 1
        t0 = time.perf_counter()
        try:
            loop = asyncio.get_running_loop()
            drafted = await loop.run_in_executor(self._pool, self.drafter.draft, partition, tuple(tokens), depth)
        finally:
            self.busy -= 1
        self.pace.drafted((time.perf_counter() - t0) * 1e6, len(drafted))
        return DraftTree.chain(list(drafted[:depth]))

    def depth_of(self, partition: str) -> int:
        return self._depths.get(partition, START_DEPTH)

    def remember(self, partition: str, depth: int) -> None:
        self._depths[partition] = depth
        self._depths.move_to_end(partition)
        while len(self._depths) > PARTITIONS_KEPT:
            self._depths.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class HostSession:
    """One session's side of host drafting in the servicer: the committed tokens a chain hangs below (followed
    through every verdict, the client's drafts' too, and checked against each verdict's hash) and its chains'
    depth. Where the tokens cannot be followed (a hash differs) the session decodes alone instead."""

    def __init__(self, host: HostDrafting, partition: str, prompt: Sequence[int], max_depth: int = 1 << 10):
        self.host, self.partition, self.cap = host, partition, max(1, max_depth)
        self.tokens = list(prompt)
        self._hash = extend_hash(HASH_START, prompt)
        self.depth = min(host.depth_of(partition), self.cap)
        self.ok = True
        self.seated = False  # it holds one of the host's seats (HostSeats)
        self._warm: asyncio.Future[DraftTree] | None = None  # the host catching up on the prompt

    @classmethod
    def before_open(
        cls, host: HostDrafting | None, partition: str, prompt: Sequence[int], wants: bool = False
    ) -> "HostSession | None":
        """An opening session's host drafting (None: this verifier has no host drafter). ``wants``: it asks the
        host to draft its first run, so it takes a seat now, and the host catches up on the prompt while the
        target prefills it (a drafter evaluates a prompt at its own pace: after the prefill, that would be the
        first host step's wait; beside it, the host's first chain comes with the first token). Call from the
        event loop."""
        if host is None:
            return None
        session = cls(host, partition, prompt)
        if wants and session.sit():
            session._warm = asyncio.ensure_future(host.chain(partition, session.tokens, 0))
            session._warm.add_done_callback(_quiet)
        return session

    def opened(self, opened: Opened) -> Opened:
        """Its Opened: the granted depth bounds its chains; it names the host's drafter and its pace where the
        session holds a seat or one is free."""
        self.cap = max(1, opened.limits.max_tree_depth)
        self.depth = min(self.depth, self.cap)
        if not (self.seated or self.host.seats.free):
            return opened
        return replace(opened, host_drafter=self.host.name, host_level_us=self.host.level_us)

    def sit(self) -> bool:
        """Hold a seat, taking one if free; False: every seat is taken."""
        self.seated = self.host.seats.take(self)
        return self.seated

    def stand(self) -> None:
        """Give the seat up (the session drafts itself again, or ended)."""
        self.host.seats.release(self)
        self.seated = False

    def follow(self, tree: DraftTree, v: Verdict) -> None:
        """The tokens ``v`` committed: the nodes of ``tree`` (what it answered: a client's tree, a host chain, or
        the empty tree of a token decoded alone) it accepted, then its bonus."""
        new = v.tokens(tree)
        self.tokens += new
        self._hash = extend_hash(self._hash, new)
        if len(self.tokens) != v.committed_len or (v.committed_hash and v.committed_hash != self._hash):
            log.warning("host drafting: lost track of the committed tokens at %d; decoding alone", v.committed_len)
            self.ok = False

    async def chain(self) -> DraftTree:
        """The next chain; empty (the step is decoded alone) where every seat is taken, or while the host is
        still catching up on the prompt."""
        if not self.sit():
            return EMPTY
        if self._warm is not None:
            if not self._warm.done():
                return EMPTY
            self._warm = None
        return await self.host.chain(self.partition, self.tokens, self.depth)

    def settle(self, chain: DraftTree, v: Verdict) -> Verdict:
        """The verdict on a host chain as its client sees it: the accepted tokens themselves (the client never saw
        the chain), as a step decoded alone, with the pace the host gives this session (a seatless one's: none of
        its steps served). The next chain's depth follows from it."""
        took = tuple(chain.tokens[i] for i in v.accepted)
        self.depth = next_depth(self.depth, len(chain), len(took), self.cap)
        self.host.remember(self.partition, self.depth)
        pace = self.host.level_us if self.seated else self.host.pace.unseated_us
        return replace(v, accepted=(), host_tokens=took, host_drafted=len(chain), host_level_us=pace)


def _quiet(warm: asyncio.Future[DraftTree]) -> None:
    """A catch-up that failed costs its session only the first chain's speed (that chain evaluates the prompt)."""
    if not warm.cancelled() and warm.exception() is not None:
        log.warning("host drafting: catching up on a prompt failed: %s", warm.exception())
