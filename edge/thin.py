"""A client for a device that runs no drafter (a phone without the memory for one, a small desktop app): it
tokenizes with the target's own tokenizer, fetched from the verifier once and cached, and hands every run of tokens
to the verifier's host drafter where it has one (``cloud.host_drafting``), plain decoding where not; the draft
policy chooses between the two as it goes.

    client = thin_client("verifier.example:50051", api_key=KEY)
    print(client.chat([{"role": "user", "content": "Write a quicksort"}]).text)
"""

from __future__ import annotations

from typing import Any, Sequence

from tandem.core.messages import EMPTY
from tandem.core.tree import TreeShape

from .client import EdgeClient
from .drafter import Tokenizer
from .drafting import BuiltTree
from .policy import DraftPolicy, PolicyConfig

NOTHING = BuiltTree(EMPTY, (), (), full=True)


class TokenizerOnly:
    """``edge.drafter.Drafter`` that drafts nothing: the target's tokenizer, for a client that only decodes."""

    name = "none"
    n_ctx = 1 << 30

    def __init__(self) -> None:
        self._tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise RuntimeError("the target's tokenizer is not loaded yet (thin_client loads it)")
        return self._tokenizer

    def load(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def pending(self) -> int:
        return 0

    def catch_up(self) -> None:
        pass

    def draft(self, shape: TreeShape) -> BuiltTree:
        return NOTHING

    def commit(self, built: BuiltTree, accepted: Sequence[int], tokens: Sequence[int]) -> None:
        pass


def thin_client(address: str, **kwargs: Any) -> EdgeClient:
    """An ``EdgeClient`` on ``address`` without a drafter (``kwargs``: ``EdgeClient``'s, e.g. ``api_key``,
    ``tls_ca``). Fetches the target's tokenizer now (once per target: it is cached under its fingerprint)."""
    none = TokenizerOnly()
    policy = DraftPolicy(PolicyConfig(shadow_depth=0), modes=("host",))
    client = EdgeClient(none, address, policy=policy, adapters=False, **kwargs)
    try:
        none.load(client.target_tokenizer())
    except BaseException:
        client.close()
        raise
    return client
