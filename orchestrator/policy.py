"""Network-aware draft budget: choose each round's tree to maximise committed tokens per second of wall time.

A pure library the edge client runs every round. It keeps online estimates (exponential moving averages, so the
result is a deterministic function of the observations):

- ``rtt_ms``: round time minus the verifier's own ``queue_us + verify_us`` (network + serialisation);
- drafter cost per level (one drafter decode per level) by tree width, measured; unmeasured widths scale along
  the prior line ``draft_base_ms + draft_node_ms * width``;
- verify cost by token count (root + nodes in one forward), measured per count; other counts from a least-squares
  line through the measurements (the prior line ``verify_base_ms + verify_token_ms * tokens`` before any);
- ``alpha[d]``: probability that a single drafted token at depth d is accepted given its parent was, learnt from
  whether the accepted node at depth d was its parent's first-ranked child (what a chain would have drafted).

For a tree of width k (k candidates per level on the best path) and depth D, the chance that depth d is reached
and accepted is prod_{i<=d} a_i(k) with a_i(k) = 1 - (1 - alpha_i)^k (k independent tries: an approximation, the
siblings are the drafter's next guesses, not independent draws). Expected committed tokens per round:

    E[tau](k, D) = 1 + sum_{d=1..D} prod_{i=1..d} a_i(k)

and the round takes ``draft_ms + verify_ms + rtt_ms``. The policy takes the (k, D) with the best ratio, or no
drafting: a server-side decode run streamed back one verdict per token, which pays the round trip once per run of
``decode_steps`` tokens, i.e. ``verify_ms(1) + rtt_ms / decode_steps`` per token.

A new policy without given estimates first probes (a short chain), since it knows nothing. A decode run lasts
until the next probe (nothing new is learnt while the verifier decodes alone), then a short chain probes whether
drafting pays again. While probes keep saying no, the run length doubles from
``probe_tokens`` up to ``probe_max_tokens``, so a link where drafting never wins pays almost nothing for watching;
a probe is also put off while the drafter's catch-up on unseen tokens (a long new prompt) would cost more than
``probe_budget`` of the decode time since the last probe.
Estimates of depths not tried drift back towards the prior, so the policy recovers when conditions improve instead
of staying with what looked best once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edge.drafting import TreeShape


@dataclass(frozen=True)
class PolicyConfig:
    max_depth: int = 12
    widths: tuple[int, ...] = (1, 2, 4)
    max_nodes: int = 48
    ewma: float = 0.2  # weight of a new observation
    alpha_prior: float = 0.7  # acceptance assumed at depths never observed
    probe_tokens: int = 64  # tokens of a decode run (no drafting) before the next probing chain
    probe_max_tokens: int = 1024  # longest run, reached by doubling while probes fail
    probe_depth: int = 2
    # a probe first makes the drafter catch up on every token it has not seen (a new prompt, the run): skip it while
    # that would cost more than this fraction of the decode time it follows
    probe_budget: float = 0.05
    forget: float = 0.05  # per drafting round, depths it did not reach drift back towards the prior


@dataclass
class Estimates:
    rtt_ms: float = 20.0
    rtt_n: int = 0  # round trips observed
    catch_up_ms_per_token: float = 2.0  # drafter evaluating committed tokens it has not seen (batched, like prefill)
    catch_up_n: int = 0
    # priors of the cost lines, used until measurements exist
    draft_base_ms: float = 10.0
    draft_node_ms: float = 10.0
    verify_base_ms: float = 20.0
    verify_token_ms: float = 5.0
    alpha: list[float] = field(default_factory=list)  # index d-1
    alpha_n: list[int] = field(default_factory=list)  # observations behind each alpha
    # measurements: EWMA of verify time per exact token count, and of draft time per level per tree width
    verify_ms_at: dict[int, float] = field(default_factory=dict)
    draft_level_ms_at: dict[int, float] = field(default_factory=dict)

    def verify_ms(self, tokens: int) -> float:
        """Measured time at this token count, else a least-squares line through the measured points (with the
        prior slope when only one point exists), else the prior line."""
        pts = self.verify_ms_at
        if tokens in pts:
            return pts[tokens]
        if len(pts) >= 2:
            n = len(pts)
            mx, my = sum(pts) / n, sum(pts.values()) / n
            sxx = sum((x - mx) ** 2 for x in pts)
            slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts.items()) / sxx)
            return max(0.0, my + slope * (tokens - mx))
        if len(pts) == 1:
            (x, y), = pts.items()
            return max(0.0, y + self.verify_token_ms * (tokens - x))
        return self.verify_base_ms + self.verify_token_ms * tokens

    def draft_level_ms(self, width: int) -> float:
        """Measured time per drafted level at this width, else scaled from the nearest measured width along the
        prior line, else the prior."""
        prior = self.draft_base_ms + self.draft_node_ms * width
        if width in self.draft_level_ms_at:
            return self.draft_level_ms_at[width]
        if self.draft_level_ms_at:
            w = min(self.draft_level_ms_at, key=lambda x: (abs(x - width), x))
            return self.draft_level_ms_at[w] * prior / (self.draft_base_ms + self.draft_node_ms * w)
        return prior


@dataclass(frozen=True)
class Round:
    """What one round showed: the tree sent and the verdict's timings."""
    width: int  # candidates per level (k) of the tree sent; 0 for an empty tree
    depth: int
    nodes: int
    accepted: int  # accepted draft tokens (tau - 1)
    chain_accepted: int  # leading accepted nodes that were their parent's first-ranked child
    draft_ms: float
    verify_ms: float  # verifier's queue + verify time
    round_ms: float  # send -> verdict, as seen by the edge
    streamed: bool = False  # a later verdict of a decode run: no round trip of its own, so no RTT sample


def expected_tokens(alpha: list[float], width: int, depth: int, prior: float) -> float:
    """Depths never observed take the deepest observed estimate (acceptance varies slowly with depth), or the
    prior before any observation."""
    total, reach = 1.0, 1.0
    for d in range(depth):
        a = alpha[d] if d < len(alpha) else (alpha[-1] if alpha else prior)
        reach *= 1.0 - (1.0 - a) ** width
        total += reach
    return total


def round_ms(est: Estimates, width: int, depth: int, nodes: int) -> float:
    draft = depth * est.draft_level_ms(width) if depth else 0.0
    return draft + est.verify_ms(1 + nodes) + est.rtt_ms


def decode_ms_per_token(est: Estimates, decode_steps: int) -> float:
    """No drafting: a streamed run of ``decode_steps`` one-token forwards behind one round trip."""
    return est.verify_ms(1) + est.rtt_ms / max(1, decode_steps)


class DraftPolicy:
    def __init__(self, config: PolicyConfig = PolicyConfig(), estimates: Estimates | None = None):
        self.config = config
        self.est = estimates or Estimates()
        self._run_length = config.probe_tokens  # tokens of the next decode run (doubles while probes fail)
        self._run_left = 0  # tokens still due from the decode run in progress (it may span generations)
        self._probe_next = estimates is None  # nothing known yet: explore with a probe before deciding anything
        self._probed = False  # a decode run happened since drafting last won
        self._explored = estimates is not None  # the first probe is due whatever it costs
        self._run_ms = 0.0  # wall time of decode runs since the last probe

    @property
    def decode_steps(self) -> int:
        """Tokens of the decode run in progress (what to ask the verifier for when ``choose`` returned None)."""
        return self._run_left

    def choose(self, pending_tokens: int = 0) -> TreeShape | None:
        """The next tree's shape, or None for no drafting: a decode run of ``decode_steps`` tokens.
        ``pending_tokens``: committed tokens the drafter has not evaluated yet (what drafting now would first
        cost it)."""
        c = self.config
        if self._run_left > 0:  # a run cut short (by the end of a generation) goes on before anything else
            return None
        if self._probe_next:
            catch_up_ms = pending_tokens * self.est.catch_up_ms_per_token
            if self._explored and catch_up_ms > c.probe_budget * self._run_ms:
                self._run_left = self._run_length  # not worth it yet: decode on, probe later
                return None
            self._probe_next, self._explored, self._run_ms = False, True, 0.0
            return TreeShape(1, c.probe_depth, c.probe_depth)
        best, best_rate = None, 1.0 / decode_ms_per_token(self.est, self._run_length)
        for width in c.widths:
            for depth in range(1, c.max_depth + 1):
                nodes = min(c.max_nodes, width * depth)
                if nodes < depth:
                    break
                rate = expected_tokens(self.est.alpha, width, depth, c.alpha_prior) / round_ms(
                    self.est, width, depth, nodes)
                if rate > best_rate * (1 + 1e-9):
                    best, best_rate = TreeShape(width, nodes, depth), rate
        if best is None:
            if self._probed:  # the probe after a run confirmed that drafting does not pay: watch less often
                self._run_length = min(c.probe_max_tokens, 2 * self._run_length)
            self._run_left, self._probe_next, self._probed = self._run_length, True, True
            return None
        self._probed, self._run_length = False, c.probe_tokens
        return best

    def peek(self, pending_tokens: int = 0) -> TreeShape | None:
        """What ``choose`` would answer now, without moving the run / probe state (for drafting ahead, which may
        be thrown away)."""
        state = (self._run_length, self._run_left, self._probe_next, self._probed, self._explored, self._run_ms)
        try:
            return self.choose(pending_tokens)
        finally:
            (self._run_length, self._run_left, self._probe_next, self._probed, self._explored,
             self._run_ms) = state

    def observe_catch_up(self, tokens: int, ms: float) -> None:
        """The drafter took ``ms`` to evaluate ``tokens`` committed tokens it had not seen."""
        if tokens >= 8:  # shorter catch-ups are dominated by a fixed per-call cost, not the per-token rate
            e = self.est
            e.catch_up_n += 1  # the first measurement replaces the prior (a guess that can be far off)
            e.catch_up_ms_per_token += max(self.config.ewma, 1.0 / e.catch_up_n) * (ms / tokens -
                                                                                  e.catch_up_ms_per_token)

    def observe(self, r: Round) -> None:
        e, w = self.est, self.config.ewma
        if r.depth == 0:  # one token of a decode run
            self._run_left = max(0, self._run_left - 1)
            self._run_ms += r.round_ms
        if not r.streamed:  # a running mean (the prior counting as one sample) until the EWMA weight takes over
            e.rtt_n += 1
            e.rtt_ms += max(w, 1.0 / (e.rtt_n + 1)) * (max(0.0, r.round_ms - r.verify_ms) - e.rtt_ms)
        tokens = 1 + r.nodes
        old = e.verify_ms_at.get(tokens)
        e.verify_ms_at[tokens] = r.verify_ms if old is None else old + w * (r.verify_ms - old)
        if r.depth and r.draft_ms > 0:  # 0 = the tree was drafted while waiting (proactive): no cost seen
            width, per_level = max(1, r.width), r.draft_ms / r.depth
            old = e.draft_level_ms_at.get(width)
            e.draft_level_ms_at[width] = per_level if old is None else old + w * (per_level - old)
        # single-draft acceptance: the first-ranked child at depth d was tried iff the chain survived to d - 1
        tried = min(r.depth, r.chain_accepted + 1)
        for d in range(1, tried + 1):
            while len(e.alpha) < d:
                e.alpha.append(e.alpha[-1] if e.alpha else self.config.alpha_prior)
            while len(e.alpha_n) < len(e.alpha):
                e.alpha_n.append(0)
            hit = 1.0 if r.chain_accepted >= d else 0.0
            e.alpha_n[d - 1] += 1
            # a running mean (the prior counting as one observation) until the EWMA weight takes over
            e.alpha[d - 1] += max(w, 1.0 / (e.alpha_n[d - 1] + 1)) * (hit - e.alpha[d - 1])
        if r.depth:  # a drafting round that did not reach the deeper levels: their old evidence fades
            for d in range(tried, len(e.alpha)):
                e.alpha[d] += self.config.forget * (self.config.alpha_prior - e.alpha[d])
