"""The verifier protocol in domain terms: what a session is opened with, what a draft asks, what a verdict says.

These mirror ``protos/verifier.proto`` (the only definition of the wire format); ``core.wire`` converts between the
two, for the edge client and the cloud servicer alike. Engines and sessions only ever see these types.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .sampling import Sampling
from .tree import DraftTree

EMPTY = DraftTree()


class Finish(Enum):
    NONE = 0
    STOP = 1  # end-of-generation token
    LENGTH = 2  # max_new_tokens


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int = 0
    max_tree_nodes: int = 64
    max_tree_depth: int = 16


@dataclass(frozen=True)
class Constraint:
    """Output the target must follow: JSON matching ``json_schema`` (its JSON text), or any JSON object."""

    json_schema: str = ""
    json_object: bool = False


@dataclass(frozen=True)
class OpenRequest:
    prompt: tuple[int, ...]
    sampling: Sampling = Sampling()
    limits: Limits = Limits()
    vocab_size: int = 0
    vocab_fingerprint: str = ""
    target_model: str = ""
    decode_steps: int = 0  # tokens to decode alone right after the prefill, until the first draft
    top_logprobs: int | None = None  # set: verdicts carry the target's logprobs with this many alternatives
    prior_output: int = 0  # the prompt's last tokens that are this generation's earlier output (a resume)
    constraint: Constraint | None = None  # structured output
    # the prefix-cache partition (core.tenancy): as sent, the caller's salt; in the verifier, once the servicer has
    # resolved it, the session's partition id (salt's, else the verifier key's)
    cache_salt: str = ""
    # the caller's tenant opted in to keeping the target's distribution at its committed positions
    # (cloud.learning.teacher): set by the servicer from the caller's key and ``withhold_from_teacher``, never read from
    # the wire
    teach: bool = False
    # the caller (a gateway, for a tenant that did not opt in) asks that nothing of this session be kept
    withhold_from_teacher: bool = False
    # who pays for what this session keeps (teacher positions, adapters): set by the servicer to a digest of the
    # verifier key that opened it (core.tenancy.tenant), never read from the wire; "" with auth off
    tenant: str = ""
    host_draft: bool = False  # the tokens decoded alone are drafted by the verifier's host drafter (if it has one)


@dataclass(frozen=True)
class Opened:
    session_id: str
    limits: Limits
    prefill_us: int
    target_model: str = ""
    n_ctx: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the verifier's prefix cache
    extra_pieces: tuple[bytes, ...] = ()  # rendering of the target's ids past the drafter's vocabulary (padding)
    # the drafter adapter distilled for this session's partition (cloud.learning.online)
    adapter: AdapterInfo | None = None
    host_drafter: str = ""  # the verifier host's drafter, by model identity ("": none)
    host_level_us: int = 0  # its recent time per level over the share of steps it served (0: not measured yet)


@dataclass(frozen=True)
class AdapterInfo:
    """A drafter adapter a verifier offers: the file's sha256, the partition's count of adapters so far, the
    drafter it was trained on (an edge applies it to that drafter alone) and the file's size."""

    sha256: str
    version: int
    base: str
    size_bytes: int


@dataclass(frozen=True)
class DraftRequest:
    """One Draft. ``seq`` 0 is a token the verifier decodes alone (no draft behind it)."""

    committed_len: int
    tree: DraftTree = EMPTY
    seq: int = 0
    assumed: tuple[int, ...] = ()  # tokens below committed_len the client guessed (not yet confirmed to it)
    decode_steps: int = 0  # tokens to decode alone after this draft's verdict, until the next draft
    node_logp: tuple[float, ...] = ()  # the drafter's path log-probability of each tree node (or none)
    host_draft: bool = False  # the decode_steps after this verdict are drafted by the verifier's host drafter


MAX_TOP_LOGPROBS = 20

HASH_START = 0xCBF29CE484222325  # the hash of no tokens
_HASH_MUL = 0x100000001B3
_MASK64 = (1 << 64) - 1


def extend_hash(h: int, tokens) -> int:
    """The rolling hash of a committed sequence after ``tokens`` more: h <- (h * P + token + 1) mod 2^64. Both sides
    keep it, so the edge sees any difference between what it emits and what the verifier committed (a bug check,
    not a defence: it is not cryptographic)."""
    for t in tokens:
        h = (h * _HASH_MUL + t + 1) & _MASK64
    return h


@dataclass(frozen=True)
class TokenLogprobs:
    """The target's log-probabilities at one committed position (log-softmax of its raw logits)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # most probable first


@dataclass(frozen=True)
class Verdict:
    accepted: tuple[int, ...]  # indices in the draft's tree, root's child first
    bonus: int  # -1 when an accepted node already finished the session
    committed_len: int
    finish: Finish = Finish.NONE
    queue_us: int = 0
    verify_us: int = 0
    draft_seq: int = 0  # the draft this answers; 0: a token decoded alone
    rebased: int = 0  # draft levels matched by tokens decoded alone since the draft's committed length
    stale: bool = False  # the draft was unusable; this verdict's token was decoded alone
    forward_tokens: int = 1  # this session's share of the forward: root + verified nodes
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per committed token, when the session asked
    pruned_nodes: int = 0  # tree nodes left unverified by the forward's token budget (not rejected)
    committed_hash: int = 0  # extend_hash over every committed token after this verdict (0: not sent)
    price_us_per_token: int = 0  # what a token more costs the next forward at this load (0: not known yet)
    batch_sessions: int = 0  # sessions that shared this verdict's forward (0: not sent)
    token_budget: int = 0  # the most tokens the session's next tree should hold (0: no latency target)
    # a host-drafted step (draft_seq 0): the host's drafted tokens accepted, before the bonus; levels it drafted;
    # the host drafter's recent time per level
    host_tokens: tuple[int, ...] = ()
    host_drafted: int = 0
    host_level_us: int = 0

    def tokens(self, tree: DraftTree) -> list[int]:
        """The tokens this verdict commits, given the tree of the draft it answers (EMPTY for seq 0; a host-drafted
        step names its tokens itself)."""
        took = list(self.host_tokens) + [tree.tokens[i] for i in self.accepted]
        return took + ([self.bonus] if self.bonus >= 0 else [])
