"""The edge side a command assembles: drafters, their pairing with the verifier's target, prompt-lookup grafting, and
the share of this machine's cores each gets. Used by ``tandem chat``, ``tandem demo`` and the gateway's drafters
(``compose``)."""
from __future__ import annotations

import logging
import os

from . import models

log = logging.getLogger("tandem.cli")


def threads(share: float = 1.0) -> int:
    """``share`` of this machine's cores, at least one."""
    return max(1, int((os.cpu_count() or 1) * share))


def load_drafter(args):
    """The drafter of a chat-like command (``--drafter``, ``--drafter-engine``, ``--vocab``, ``--n-ctx``)."""
    from tandem.edge.drafter import load_drafter as load
    return load(args.drafter_engine, model_path=models.resolve(args.drafter, "drafter"),
                n_ctx=args.n_ctx, n_threads=args.drafter_threads or threads(),
                **({"vocab": args.vocab, "learn_vocab": args.learn_vocab} if args.vocab else {}))


def paired(client):
    """``client`` with its drafter matched to the verifier's target (``EdgeClient.pair_with_target``: a drafter
    with another tokenizer drafts through translation); an unreachable verifier leaves it as it is."""
    from tandem.edge.client import RemoteError
    try:
        kind = client.pair_with_target()
    except RemoteError as e:
        log.warning("could not match the drafter to the verifier's target: %s", e)
        return client
    if kind != "native":
        log.info("drafter and target: %s", kind)
    return client


def ngram(enabled: bool):
    """A prompt-lookup drafter to graft onto the trees (``--ngram``), or None."""
    if not enabled:
        return None
    from tandem.edge.ngram import NgramDrafter
    return NgramDrafter()
