"""The gateway's two ASGI middlewares, outside the application: the access log (outermost: every request gets an
id and one line) and the guard (a key and a body size checked before anything reads the body)."""
from __future__ import annotations

import logging
import time
import uuid

from . import metrics
from .config import GatewayConfig
from .errors import ApiError, unauthorized

# -- the access log: one line per request, with the id the response carries -------------------------------------------
access_log = logging.getLogger("tandem.gateway.access")


class AccessLog:
    """ASGI middleware, outermost: every HTTP request gets an id (the ``X-Request-Id`` response header) and one
    logfmt line when it ends (info level: quiet by default): method, path, status, duration. The key and the body
    are never logged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid, t0, status = uuid.uuid4().hex[:16], time.perf_counter(), [0]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            await send(message)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            access_log.info("request", extra={"fields": {
                "id": rid, "method": scope.get("method", ""), "path": scope.get("path", ""), "status": status[0],
                "ms": round((time.perf_counter() - t0) * 1000, 1)}})


# -- the guard: auth and size before any parsing ---------------------------------------------------------------------
class Guard:
    """ASGI middleware: requests to ``/v1/...`` (and ``/metrics`` unless public) need a valid key, and no body may
    exceed ``max_body_bytes``, declared or streamed. Both are answered before the application reads the body, so
    an unauthenticated client cannot make the gateway parse anything, and nobody can make it buffer much."""

    def __init__(self, app, config: GatewayConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        c, path = self.config, scope["path"]
        headers = dict(scope.get("headers") or ())
        presented = headers.get(b"authorization", b"").decode("latin-1")
        if path == "/metrics" and not c.public_metrics and not (
                c.metrics_keys.check(presented) if c.metrics_keys.enabled else not c.keys.enabled):
            metrics.ERRORS.labels("invalid_api_key").inc()
            return await unauthorized("/metrics needs a metrics key (TANDEM_METRICS_KEYS; API keys do not open "
                                      "it): send 'Authorization: Bearer <key>'.").response()(scope, receive, send)
        # /v1/edge/* authenticate themselves: an edge token opens them too (edge_sessions)
        protected = (path.startswith("/v1/") and not path.startswith("/v1/edge/")) or path in ("/tokenize",
                                                                                                 "/detokenize")
        if protected and not c.keys.check(presented):
            metrics.ERRORS.labels("invalid_api_key").inc()
            return await unauthorized().response()(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > c.max_body_bytes):
            return await self._too_large(scope, receive, send)
        # read the body here, at most the cap (a chunked body declares no length), then hand it on whole
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > c.max_body_bytes:
                return await self._too_large(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        metrics.ERRORS.labels("request_too_large").inc()
        await ApiError(413, f"Request body over {self.config.max_body_bytes} bytes.", code="request_too_large"
                       ).response()(scope, receive, send)
