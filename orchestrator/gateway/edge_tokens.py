"""Edge tokens: short-lived credentials an app's backend mints from its API key (``POST /v1/edge-tokens``) and hands
to a device, so no long-lived key ships inside an app or a web page.

A token is ``te1.<claims>.<mac>``: base64url JSON claims and an HMAC-SHA256 over them with a key derived from the
gateway's secret (``--salt-secret``: gateways sharing it accept each other's tokens; a gateway without one mints
tokens that die with it). Stateless: the gateway stores nothing per token but the sessions it has open. The claims
name the minting key by an HMAC under the gateway's secret (never the key, nor a hash anyone could test guesses
of the key against), an expiry, the token's own limits (sessions open at once, new tokens per session) and whose
cache it shares. A token opens sessions only (the WebSocket transport): it cannot call the REST API or mint tokens.
Its sessions are charged to its key's quotas, but run in a cache partition of the token's own: an app's end users
are tenants of each other. The minting call may name a ``subject`` (the app's id of one user) and ask
``share_cache``: the tokens minted for that subject then share one partition (one user's devices), and only then
does a device see ``cached_tokens`` and ``prefill_us``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

from tandem.core.errors import TandemError

PREFIX = "te1"
MAX_TTL_S = 24 * 3600
MAX_SESSIONS = 64
MAX_SUBJECT_CHARS = 256


class TokenError(TandemError, ValueError):
    """A token that is malformed, forged or expired; the message says which, never why a forgery failed."""


@dataclass(frozen=True)
class Claims:
    key_digest: str  # whose token: ``key_digest(secret, key)`` of the API key that minted it
    expires_at: int  # unix seconds
    max_sessions: int  # sessions open at once with this token
    max_new_tokens: int  # most tokens one session may generate
    token_id: str  # random: the token's own session count, and by default its cache partition, are kept under it
    shared: str = ""  # the subject's digest when the minting call granted its devices one cache; "": the token's own

    @property
    def cache_scope(self) -> str:
        """What names this token's cache partition (with its key): the shared subject, else the token itself."""
        return f"subject:{self.shared}" if self.shared else f"token:{self.token_id}"


def key_digest(secret: bytes, key: str) -> str:
    """The minting key's name in a token: an HMAC under the gateway's secret, so a token reveals nothing a guess
    of the key could be checked against offline."""
    return hmac.new(secret, b"edge-token-key\0" + key.encode(), hashlib.sha256).hexdigest()[:32]


def subject_digest(secret: bytes, key: str, subject: str) -> str:
    """A subject (an app's id of one user) as the token carries it: bound to the minting key, unreadable."""
    return hmac.new(secret, b"edge-token-subject\0" + key.encode() + b"\0" + subject.encode(),
                    hashlib.sha256).hexdigest()[:32]


def _mac_key(secret: bytes) -> bytes:
    return hmac.new(secret, b"edge-token", hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint(secret: bytes, key: str, now: float, ttl_s: int, max_sessions: int, max_new_tokens: int,
         subject: str | None = None, share_cache: bool = False) -> tuple[str, Claims]:
    """A token for ``key`` valid ``ttl_s`` seconds from ``now``; with ``share_cache``, its sessions share one cache
    partition with every token of ``key`` minted for the same ``subject``. Raises ``TokenError`` for limits out of
    range."""
    if not 1 <= ttl_s <= MAX_TTL_S:
        raise TokenError(f"ttl_s must be between 1 and {MAX_TTL_S}, got {ttl_s}")
    if not 1 <= max_sessions <= MAX_SESSIONS:
        raise TokenError(f"max_sessions must be between 1 and {MAX_SESSIONS}, got {max_sessions}")
    if max_new_tokens < 1:
        raise TokenError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if subject is not None and not 1 <= len(subject) <= MAX_SUBJECT_CHARS:
        raise TokenError(f"subject must have 1 to {MAX_SUBJECT_CHARS} characters, got {len(subject)}")
    if share_cache and subject is None:
        raise TokenError("share_cache needs a subject: the user whose devices share one cache")
    shared = subject_digest(secret, key, subject) if share_cache and subject is not None else ""
    claims = Claims(key_digest(secret, key), int(now) + ttl_s, max_sessions, max_new_tokens, secrets.token_hex(8),
                    shared)
    body = _b64(json.dumps({"k": claims.key_digest, "exp": claims.expires_at, "s": max_sessions,
                            "t": max_new_tokens, "id": claims.token_id, "sh": shared},
                           separators=(",", ":")).encode())
    mac = _b64(hmac.new(_mac_key(secret), f"{PREFIX}.{body}".encode(), hashlib.sha256).digest())
    return f"{PREFIX}.{body}.{mac}", claims


def verify(secret: bytes, token: str, now: float) -> Claims:
    """The claims of a token this gateway's secret signed and that has not expired at ``now``."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != PREFIX:
        raise TokenError("not an edge token")
    expected = hmac.new(_mac_key(secret), f"{PREFIX}.{parts[1]}".encode(), hashlib.sha256).digest()
    try:
        valid = hmac.compare_digest(_unb64(parts[2]), expected)
        data = json.loads(_unb64(parts[1])) if valid else None
        claims = Claims(str(data["k"]), int(data["exp"]), int(data["s"]), int(data["t"]), str(data["id"]),
                        str(data["sh"])) if data else None
    except (ValueError, KeyError, TypeError):
        claims = None
    if claims is None:
        raise TokenError("edge token not valid here (forged, damaged, or signed by another gateway secret)")
    if now >= claims.expires_at:
        raise TokenError(f"edge token expired {int(now) - claims.expires_at} s ago; mint a new one")
    return claims
