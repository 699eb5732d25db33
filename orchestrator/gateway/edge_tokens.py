"""Edge tokens: short-lived credentials an app's backend mints from its API key (``POST /v1/edge-tokens``) and hands
to a device, so no long-lived key ships inside an app or a web page.

A token is ``te1.<claims>.<mac>``: base64url JSON claims and an HMAC-SHA256 over them with a key derived from the
gateway's secret (``--salt-secret``: gateways sharing it accept each other's tokens; a gateway without one mints
tokens that die with it). Stateless: the gateway stores nothing per token but the sessions it has open. The claims
name the minting key by a digest (never the key), an expiry, and the token's own limits: sessions open at once and
new tokens per session. A token opens sessions only (the WebSocket transport): it cannot call the REST API or mint
tokens. Its sessions are its key's: the same cache partition and the same per-key quotas.
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


class TokenError(TandemError, ValueError):
    """A token that is malformed, forged or expired; the message says which, never why a forgery failed."""


@dataclass(frozen=True)
class Claims:
    key_digest: str  # whose token: ``key_digest(key)`` of the API key that minted it
    expires_at: int  # unix seconds
    max_sessions: int  # sessions open at once with this token
    max_new_tokens: int  # most tokens one session may generate
    token_id: str  # random: the token's own session count is kept under it


def key_digest(key: str) -> str:
    return hashlib.sha256(b"edge-token-key\0" + key.encode()).hexdigest()[:32]


def _mac_key(secret: bytes) -> bytes:
    return hmac.new(secret, b"edge-token", hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint(secret: bytes, key: str, now: float, ttl_s: int, max_sessions: int, max_new_tokens: int) -> tuple[str, Claims]:
    """A token for ``key`` valid ``ttl_s`` seconds from ``now``. Raises ``TokenError`` for limits out of range."""
    if not 1 <= ttl_s <= MAX_TTL_S:
        raise TokenError(f"ttl_s must be between 1 and {MAX_TTL_S}, got {ttl_s}")
    if not 1 <= max_sessions <= MAX_SESSIONS:
        raise TokenError(f"max_sessions must be between 1 and {MAX_SESSIONS}, got {max_sessions}")
    if max_new_tokens < 1:
        raise TokenError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    claims = Claims(key_digest(key), int(now) + ttl_s, max_sessions, max_new_tokens, secrets.token_hex(8))
    body = _b64(json.dumps({"k": claims.key_digest, "exp": claims.expires_at, "s": max_sessions,
                            "t": max_new_tokens, "id": claims.token_id}, separators=(",", ":")).encode())
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
        claims = Claims(str(data["k"]), int(data["exp"]), int(data["s"]), int(data["t"]), str(data["id"])) \
            if data else None
    except (ValueError, KeyError, TypeError):
        claims = None
    if claims is None:
        raise TokenError("edge token not valid here (forged, damaged, or signed by another gateway secret)")
    if now >= claims.expires_at:
        raise TokenError(f"edge token expired {int(now) - claims.expires_at} s ago; mint a new one")
    return claims
