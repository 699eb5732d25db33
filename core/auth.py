"""API keys and TLS material for the REST gateway and the gRPC verifier.

Two sets, so that a REST key never opens the verifier: ``$TANDEM_API_KEYS`` / ``$TANDEM_API_KEYS_FILE`` for REST
clients of the gateway, ``$TANDEM_VERIFIER_KEYS`` / ``$TANDEM_VERIFIER_KEYS_FILE`` for gRPC clients of the verifier
(edges and gateways; a gateway presents ``$TANDEM_VERIFIER_KEY``). Values are comma-separated, files one key per
line with ``#`` comments. REST clients send ``Authorization: Bearer <key>``; gRPC clients the same header as call
metadata.
Keys are compared in constant time (``hmac.compare_digest``) against every configured key, so the comparison does
not leak how much of a guess was right.

Auth may be off only on a loopback address: ``require_auth_off_loopback`` refuses to start a server on any other
address without keys.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import grpc

from .errors import TandemError

HEADER = "authorization"


class AuthConfigError(TandemError, ValueError):
    pass


@dataclass(frozen=True)
class ApiKeys:
    keys: tuple[bytes, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @classmethod
    def of(cls, keys: Iterable[str]) -> "ApiKeys":
        return cls(tuple(k.strip().encode() for k in keys if k.strip()))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, name: str = "TANDEM_API_KEYS") -> "ApiKeys":
        """Keys from ``$name`` (comma-separated) and ``$name_FILE`` (one per line)."""
        values = os.environ if env is None else env
        keys = values.get(name, "").split(",")
        if path := values.get(f"{name}_FILE"):
            try:
                lines = Path(path).read_text().splitlines()
            except OSError as e:
                raise AuthConfigError(f"cannot read {name}_FILE={path}: {e.strerror}") from None
            keys += [ln.split("#", 1)[0] for ln in lines]
        return cls.of(keys)

    def with_key(self, key: str) -> "ApiKeys":
        return ApiKeys(self.keys + (key.encode(),))

    def has(self, key: str) -> bool:
        """Whether ``key`` is one of these keys (False for an empty set: unlike ``check``, which lets anyone in
        when auth is off)."""
        return self.enabled and self.check(key)

    def check(self, presented: str | None) -> bool:
        """True if auth is off, or ``presented`` ("Bearer <key>" or the bare key) matches a configured key."""
        if not self.enabled:
            return True
        if not presented:
            return False
        token_b = bearer(presented).encode()
        ok = False
        for key in self.keys:  # no early exit: time does not depend on which key matched
            ok |= hmac.compare_digest(token_b, key)
        return ok


def bearer(presented: str | None) -> str:
    """The key in an authorization value ("Bearer <key>" or the bare key); empty when there is none."""
    if not presented:
        return ""
    return (presented[7:] if presented[:7].lower() == "bearer " else presented).strip()


def metadata_key(metadata) -> str:
    """The key a gRPC call presented (its ``authorization`` metadata), or empty."""
    return bearer(dict(metadata or ()).get(HEADER))


def client_key(env: Mapping[str, str] | None = None) -> str:
    """The key this process presents to a verifier: ``$TANDEM_VERIFIER_KEY``, else the first key in
    ``$TANDEM_VERIFIER_KEY_FILE``, else ``$TANDEM_API_KEY`` (older name); empty when none is set."""
    values = os.environ if env is None else env
    if values.get("TANDEM_VERIFIER_KEY"):
        return values["TANDEM_VERIFIER_KEY"].strip()
    if path := values.get("TANDEM_VERIFIER_KEY_FILE"):
        try:
            lines = [ln.split("#", 1)[0].strip() for ln in Path(path).read_text().splitlines()]
        except OSError as e:
            raise AuthConfigError(f"cannot read TANDEM_VERIFIER_KEY_FILE={path}: {e.strerror}") from None
        return next((ln for ln in lines if ln), "")
    return values.get("TANDEM_API_KEY", "").strip()


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_auth_off_loopback(
    host: str, keys: ApiKeys, allow_unauthenticated: bool = False, name: str = "TANDEM_API_KEYS"
) -> None:
    if not keys.enabled and not is_loopback(host) and not allow_unauthenticated:
        raise AuthConfigError(
            f"refusing to serve on {host} without API keys: set {name} or {name}_FILE "
            f"(or pass --allow-unauthenticated on a trusted network)"
        )


class GrpcAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects verifier sessions without a valid key with UNAUTHENTICATED, before the servicer reads a message.
    ``Health`` and the standard grpc.health.v1 service stay open (liveness probes of orchestrators must not need
    the key; they reveal the model name and load, or only whether it serves)."""

    OPEN = ("/tandem.v1.Verifier/Health", "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")

    def __init__(self, keys: ApiKeys):
        self.keys = keys

        async def deny(request_iterator, context):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or invalid API key: send metadata 'authorization: Bearer <key>'",
            )

        self._deny = grpc.stream_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in self.OPEN or not self.keys.enabled:
            return await continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get(HEADER)
        if self.keys.check(presented):
            return await continuation(handler_call_details)
        return self._deny


@dataclass(frozen=True)
class Tls:
    """Server certificate and key (PEM paths); clients verify against ``ca`` (default: the certificate itself,
    for self-signed deployments)."""

    cert: Path
    key: Path

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])


def channel(address: str, ca: str | Path | None = None, server_name: str | None = None, aio: bool = False) -> Any:
    """A gRPC channel (``aio``: an asyncio one, made inside the loop that uses it). ``ca``: a PEM file the server's
    certificate chains to; ``SYSTEM_ROOTS`` ("system") for the publicly trusted roots; ``PLAINTEXT`` ("none") for no
    TLS. Without one, a remote address is reached over TLS with the system roots (a verifier off this machine is
    never spoken to in clear by default) and a loopback one in plaintext. ``server_name``: the name the
    certificate carries when it differs from the host."""
    ca = transport(address, ca)
    api: Any = grpc.aio if aio else grpc
    if ca == PLAINTEXT:
        return api.insecure_channel(address)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else None
    roots = None if str(ca) == SYSTEM_ROOTS else Path(ca).read_bytes()  # None: gRPC's default roots
    return api.secure_channel(address, grpc.ssl_channel_credentials(roots), options=options)


SYSTEM_ROOTS = "system"
PLAINTEXT = "none"


def transport(address: str, ca: str | Path | None) -> str:
    """How ``channel`` reaches ``address``: ``PLAINTEXT``, ``SYSTEM_ROOTS`` or the CA file's path."""
    if not ca:
        return PLAINTEXT if is_loopback(target_host(address)) else SYSTEM_ROOTS
    return str(ca)


def target_host(address: str) -> str:
    """The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port"); a Unix socket is "localhost"."""
    if address.startswith("unix"):
        return "localhost"
    rest = (
        address.split("///", 1)[-1]
        if "///" in address
        else address.split(":", 1)[-1]
        if address.startswith(("dns:", "ipv4:", "ipv6:"))
        else address
    )
    if rest.startswith("["):
        return rest[1 : rest.index("]")]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest
