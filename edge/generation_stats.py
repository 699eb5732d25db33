"""What one generation measured (``GenerationStats``): tokens, verify forwards, acceptance by depth and where the
time went, counted by the round loop (edge/rounds.py) as verdicts arrive. Every field states its unit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.core.tree import depths_reached_and_accepted


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0  # verify forwards on the target (trees verified + tokens decoded alone)
    drafted_nodes: int = 0  # nodes of trees the verifier checked (after rebasing)
    accepted_tokens: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)  # rounds accepting a node at depth d (index d-1)
    reached_by_depth: list[int] = field(default_factory=list)  # rounds whose tree reached depth d with d-1 accepted
    draft_us: int = 0
    verify_us: int = 0  # the verifier's forward + acceptance time: what this generation cost the cloud
    queue_us: int = 0
    network_us: int = 0  # tree round time minus the verifier's own time: RTT + (de)serialisation
    prefill_us: int = 0
    cached_tokens: int = 0  # prompt tokens the verifier took from its prefix cache instead of prefilling them
    resumes: int = 0  # sessions re-opened on the committed history after the verifier became unavailable
    proactive_hits: int = 0  # trees drafted while the previous verdict was in flight, and sent on its arrival
    speculate_us: int = 0  # drafting done while waiting for verdicts
    shadow_chains: int = 0  # chains drafted on the stream and scored against it, never sent
    shadow_accepted: int = 0  # ... their nodes that matched the streamed tokens
    ngram_nodes: int = 0  # nodes grafted from n-gram matches (edge.ngram)
    ngram_accepted: int = 0  # ... and accepted
    trees: int = 0  # trees sent
    streamed_tokens: int = 0  # tokens committed in the verifier's runs without a device tree (alone, or host-drafted)
    host_tokens: int = 0  # ... of which its host drafted (cloud.host_drafting), before each forward's own token
    rebased_tokens: int = 0  # tree levels matched by tokens the verifier decoded alone before the tree arrived
    stale_trees: int = 0  # trees the verifier could not use
    dead_trees: int = 0  # trees dropped before sending: tokens committed meanwhile left them
    forward_tokens: int = 0  # tokens of verify forwards spent on this generation
    pruned_nodes: int = 0  # sent nodes the verifier's token budget left unverified (under load)
    price_us_per_token: int = 0  # the last verdict's price of a token in the verifier's next forward (0: unknown)
    batch_sessions: int = 0  # the sessions that shared its forward
    ttft_s: float = 0.0  # open -> first committed token
    wall_s: float = 0.0
    # the draft policy's last decision in this generation (mode, each mode's predicted tokens/s, the round trip it
    # measured), for a planner that explains itself (``last_decision``); empty otherwise
    policy: dict[str, Any] = field(default_factory=dict)

    def record_round(self, tree_depth: int, n_nodes: int, n_accepted: int) -> None:
        self.rounds += 1
        self.drafted_nodes += n_nodes
        self.accepted_tokens += n_accepted
        while len(self.accepted_by_depth) < tree_depth:
            self.accepted_by_depth.append(0)
            self.reached_by_depth.append(0)
        reached, accepted = depths_reached_and_accepted(tree_depth, n_accepted)
        for d in reached:
            self.reached_by_depth[d - 1] += 1
        for d in accepted:
            self.accepted_by_depth[d - 1] += 1

    @property
    def tau(self) -> float:
        """Committed tokens per verify forward."""
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def alpha_by_depth(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_by_depth, self.reached_by_depth)]

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def verifier_ms_per_token(self) -> float:
        """Verifier busy time per committed token: the cloud's cost of this generation."""
        return self.verify_us / 1000 / self.generated_tokens if self.generated_tokens else 0.0

    def summary(self) -> str:
        return (
            f"{self.generated_tokens} tokens, tau {self.tau:.2f}, {self.tokens_per_s:.1f} tokens/s "
            f"({self.rounds} verify forwards, {self.accepted_tokens}/{self.drafted_nodes} drafted accepted)"
        )

    def add(self, other: "GenerationStats") -> None:
        """Accumulate another generation's counts (benches sum runs); a dict (the policy's decision) is the later
        generation's."""
        for name, value in vars(other).items():
            if isinstance(value, dict):
                setattr(self, name, dict(value))
            elif isinstance(value, list):
                mine = getattr(self, name)
                mine.extend([0] * (len(value) - len(mine)))
                for i, x in enumerate(value):
                    mine[i] += x
            else:
                setattr(self, name, getattr(self, name) + value)
