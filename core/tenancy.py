"""Cache partitions: which callers may reuse each other's cached KV, n-grams and kept drafter cells.

Every cache a caller's prompt can reach is partitioned: an entry is only ever found by a session of the same
partition (vLLM's ``cache_salt`` does the same for its prefix cache). Without it, a cache hit tells one caller how
much of its prompt matches another caller's conversation (``cached_tokens``, ``prefill_us``), and a probe "known
prefix + guessed token" recovers a private prompt token by token.

Who lands in which partition:

- a gRPC caller that sends ``Open.cache_salt``: that salt's partition *within its verifier key*; a salt never
  names a partition across keys, so a guessable salt joins nobody else's;
- any other gRPC caller: its verifier key's (auth off: one shared partition, the trust domain is the loopback);
- a REST caller: the gateway sends a salt derived from its server secret and the caller's REST key (and the
  request's ``cache_salt``, which splits that key's partition further), so two REST keys behind one gateway key
  never share, and nobody who lacks the secret can name a REST caller's partition;
- a device holding an edge token: a partition of that token's own (``device_salt``), or, when the minting call
  granted it, one shared by the tokens minted for the same subject (one user's devices); never its key's.

A partition id is a digest, never the key or salt itself, so caches and logs hold no credential.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Mapping

from .errors import TandemError

MAX_SALT_CHARS = 256  # a salt is a secret, not a payload

SHARED = ""  # the partition of callers with neither a key nor a salt (auth off)


class SaltError(TandemError, ValueError):
    pass


def check_salt(salt: str) -> None:
    if len(salt) > MAX_SALT_CHARS:
        raise SaltError(f"cache_salt has {len(salt)} characters, over the limit of {MAX_SALT_CHARS}")


def _fields(*parts: str) -> bytes:
    """An unambiguous encoding of several strings (each length-prefixed): no two lists encode alike."""
    return b"".join(len(b := p.encode()).to_bytes(4, "big") + b for p in parts)


def partition(cache_salt: str, key: str) -> str:
    """The partition of a verifier session: its salt's within its key when it sent one, else its key's, else the
    shared one."""
    if cache_salt:
        return hashlib.sha256(b"salt\0" + _fields(key, cache_salt)).hexdigest()
    if key:
        return hashlib.sha256(b"key\0" + key.encode()).hexdigest()
    return SHARED


def tenant(key: str) -> str:
    """Who pays for what a session keeps (quotas, teacher positions, adapters): the verifier key's own partition
    id, a digest; ``SHARED`` with auth off."""
    return partition("", key)


def gateway_salt(secret: bytes, key: str, cache_salt: str | None = None) -> str:
    """The salt a gateway sends for a REST request: HMAC of its secret over the caller's key, and the request's
    ``cache_salt`` when it gave one (a partition within that key's)."""
    message = b"salt\0" + _fields(key, cache_salt) if cache_salt else b"key\0" + key.encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def device_salt(secret: bytes, key_digest: str, scope: str) -> str:
    """The salt of an edge token's sessions: HMAC of the gateway's secret over the minting key's digest and the
    token's scope (its own id, or the digest of the subject whose devices share). Never equal to a REST salt
    (another message prefix), so a device never reads its key's REST partition, nor its key another device's."""
    return hmac.new(secret, b"device\0" + _fields(key_digest, scope), hashlib.sha256).hexdigest()


def salt_secret(env: Mapping[str, str] | None = None) -> bytes:
    """The gateway's salt secret: ``$TANDEM_SALT_SECRET``, else the file ``$TANDEM_SALT_SECRET_FILE``, else a
    random one for this process (every gateway of a deployment should share one, so that a conversation's next turn
    finds its cache whichever gateway serves it)."""
    values = os.environ if env is None else env
    if values.get("TANDEM_SALT_SECRET"):
        return values["TANDEM_SALT_SECRET"].strip().encode()
    if path := values.get("TANDEM_SALT_SECRET_FILE"):
        try:
            text = Path(path).read_text().strip()
        except OSError as e:
            raise SaltError(f"cannot read TANDEM_SALT_SECRET_FILE={path}: {e.strerror}") from None
        if not text:
            raise SaltError(f"TANDEM_SALT_SECRET_FILE={path} is empty")
        return text.encode()
    return secrets.token_bytes(32)
