"""What the edge's round loop asks of a draft planner, and the fixed planner.

The round loop (edge/rounds.py) asks the planner for the next tree's shape whenever the drafter is free, tells it
what each verdict showed, and asks whether the verifier should decode alone between drafts; the client tells it
where each request begins and whose it is. The adaptive planner is ``edge.policy.DraftPolicy``;
``FixedPlanner`` drafts one shape every time (or never).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.core.tree import TreeShape

LONG_RUN = 1 << 20  # "decode alone until the next draft arrives" (the session's length limit ends it first)


@dataclass(frozen=True)
class Round:
    """What one verdict showed (a tree's, or a token the verifier decoded alone)."""

    width: int  # candidates per level (k) of the drafter's tree; 0 for no tree
    depth: int  # depth of the tree part that was verified (after rebasing)
    nodes: int  # nodes verified (after rebasing)
    accepted: int  # accepted draft tokens (tau - 1)
    chain_accepted: int  # leading accepted nodes that were their parent's first-ranked child
    draft_ms: float  # drafter time for this tree (0 when it was drafted while waiting)
    verify_ms: float  # verifier's queue + verify time
    round_ms: float  # send -> verdict as seen by the edge (for a streamed token: since the previous verdict)
    streamed: bool = False  # a token decoded alone: no round trip of its own, so no RTT sample
    rebased: int = 0  # tree levels already committed by tokens decoded alone when the tree arrived
    stale: bool = False  # the tree was unusable on arrival
    forward_tokens: int = 1  # tokens of the verify forward spent on this verdict
    tokens: int = 1  # tokens this verdict committed
    gap_ms: float = 0.0  # time since the previous verdict (or since Open, for the first)
    first: bool = False  # the first verdict of a session stream (its gap includes the prompt prefill)
    overlapped: bool = False  # the drafter worked while this verdict's forward ran (it may have slowed it)
    forward_ms: float | None = None  # the verifier's forward alone (verify_ms less its queue wait); None: unknown
    pending: int = 0  # committed tokens the drafter had not evaluated at this verdict (what drafting would first cost)
    # the tree's first choices from its root, rebased levels included: how many were judged against the target's
    # tokens (decoded alone or verified), and how many of those leading ones were the target's token (0, 0: no tree)
    tried_levels: int = 0
    held_levels: int = 0

    @property
    def compute_ms(self) -> float:
        """What the verifier spent on this verdict: its forward, without the wait in its queue (a tree that arrives
        during a token decoded alone waits for that forward, time the verifier spent on the other token)."""
        return self.verify_ms if self.forward_ms is None else self.forward_ms


class Planner(Protocol):
    # read only here (a planner may compute them): the round loop reads them before each decision
    @property
    def stream(self) -> bool:
        """The verifier decodes alone between drafts (latency), or waits for each draft (cloud cost)."""

    @property
    def stream_first(self) -> bool:
        """The verifier decodes alone from the prefill until the first draft (first-token latency)."""

    @property
    def drafts(self) -> bool:
        """False: no warm-up of the drafter on the prompt alongside the prefill, nor a first draft before the first
        token (a planner that never asks for a tree, or one whose drafter measurably slows the verifier)."""

    @property
    def overlap_ok(self) -> bool:
        """The drafter may work while the verifier does (proactive drafting; False where it slows it)."""

    def new_request(self, partition: str = "") -> None:
        """A request begins; ``partition``: whose it is (its cache partition, core.tenancy), so that what one
        caller's text showed never shapes another caller's request."""

    def shape(self, pending_tokens: int) -> TreeShape | None:
        """The next tree, or None: draft nothing now (the verifier streams). ``pending_tokens``: committed tokens
        the drafter has not evaluated (what drafting now would first cost it)."""

    def peek(self, pending_tokens: int) -> TreeShape | None:
        """What ``shape`` would answer, without moving any state (for drafting ahead, which may be thrown away)."""

    def observe(self, r: Round) -> None: ...

    def shadow(self, pending_tokens: int) -> TreeShape | None:
        """A chain for an idle drafter to draft on the streamed text and score against it (never sent), or None."""

    def observe_shadow(self, depth: int, accepted: int, draft_ms: float) -> None:
        """A shadow chain of ``depth`` nodes, drafted in ``draft_ms``, matched the next ``accepted`` committed
        tokens."""

    def observe_catch_up(self, tokens: int, ms: float, waited: bool = False) -> None:
        """The drafter evaluated ``tokens`` committed tokens it had not seen in ``ms``; ``waited``: the verifier
        sat idle meanwhile (no run of tokens decoded alone was going on)."""

    # optional: observe_price(marginal_ms, sessions, token_budget): what the verifier's last verdict said a token
    # costs its next forward, how many sessions shared it, and the most tokens the next tree should hold (0: any)
    # optional: ``host`` (bool): the verifier's host drafts the tokens it decodes alone (cloud.host_drafting);
    # observe_host(level_ms, drafted, accepted): the host's pace per level, and what its last chain drafted and the
    # target took (level_ms alone, drafted 0, when a session opens: None where it has no host drafter for it; and when
    # a host step of its was decoded alone because every seat was taken: the pace of a host serving none of its steps)


class FixedPlanner:
    """The same tree every time (``shape``), or never (None: cloud-only decoding, streamed)."""

    def __init__(self, shape: TreeShape | None, stream: bool = True, host: bool = False):
        """``stream`` False: lock-step rounds from the first token on (every token is verified in a tree);
        ``host`` (with no shape): the verifier's host drafts instead (where it has a drafter)."""
        self._shape, self.host = shape, host and shape is None
        self.stream = self.stream_first = stream or shape is None
        self.drafts = shape is not None
        self.overlap_ok = True

    def new_request(self, partition: str = "") -> None:
        pass

    def shape(self, pending_tokens: int) -> TreeShape | None:
        return self._shape

    peek = shape

    def shadow(self, pending_tokens: int) -> TreeShape | None:
        return None

    def observe(self, r: Round) -> None:
        pass

    def observe_shadow(self, depth: int, accepted: int, draft_ms: float) -> None:
        pass

    def observe_catch_up(self, tokens: int, ms: float, waited: bool = False) -> None:
        pass
