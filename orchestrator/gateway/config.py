"""What a gateway serves and how (``GatewayConfig``), and how it reaches its verifier for relayed edge sessions
(``VerifierLink``); ``tandem serve`` builds both from its options."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from tandem.core.auth import ApiKeys
from tandem.core.quota import KeyLimits

WEB_CLIENT = Path(__file__).resolve().parents[2] / "clients" / "web"  # in a source checkout


@dataclass(frozen=True)
class VerifierLink:
    """How the gateway reaches its verifier for the edge sessions it relays (``edge_sessions``; its drafters' edge
    clients hold their own connections)."""
    address: str
    tls_ca: str | None = None
    server_name: str | None = None
    key: str = ""  # the gateway's verifier key


@dataclass
class GatewayConfig:
    keys: ApiKeys = field(default_factory=ApiKeys)
    model_name: str = ""  # served model id; default: a slug of the verifier's target model
    aliases: tuple[str, ...] = ()  # more ids requests may use for the same model
    default_max_tokens: int = 512
    retry_after_s: int = 1
    max_body_bytes: int = 1 << 20  # request bodies over this are refused (413) before they are parsed
    limits: KeyLimits = field(default_factory=KeyLimits)  # per key: concurrency, prompt + completion tokens a minute
    # /metrics shows every tenant's traffic: it opens to these keys only (a scraper's), never to REST keys
    metrics_keys: ApiKeys = field(default_factory=ApiKeys)
    public_metrics: bool = False  # /metrics without a key (a scraper on a private network)
    salt_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))  # cache salts (core.tenancy)
    # REST keys whose tenants opted in to distilling the drafter from their traffic: every other caller's sessions
    # ask the verifier to keep nothing (withhold_from_teacher), whatever this gateway's verifier key opted in to
    teach_keys: ApiKeys = field(default_factory=ApiKeys)
    docs: bool = False  # /docs and /openapi.json
    chat_page: bool = True  # GET /chat, the web chat page (static; its API calls need a key like any other)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API (CORS); none by default
    identity_ttl_s: float = 2.0  # how long /readyz and requests trust the verifier's last Health answer
    verifier: VerifierLink | None = None  # for relayed edge sessions (WebSocket); none: they are refused
    max_websockets_per_key: int = 128  # relayed edge sessions open at once per API key, its tokens' included (0: off)
    open_timeout_s: float = 10.0  # a relayed session's Open must arrive this soon after its socket is accepted
    ws_max_queue: int = 8  # WebSocket messages the server buffers per socket before it stops reading
    browser_drafter: Path | None = None  # a self-contained drafter export served to browsers (browser_drafter)
    queue_depth: int = 64  # requests that may wait for a drafter when all are lent (beyond: 429; 0: no queue)
    queue_timeout_s: float = 300.0  # the longest a request waits for a drafter (then 503)
    web_client: Path | None = WEB_CLIENT  # clients/web with its build: the browser bundle and onnxruntime-web
