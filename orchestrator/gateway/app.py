"""The gateway's FastAPI application: the REST routes (``serving``), the relayed edge sessions (``edge_sessions``)
and what a browser drafts with (``browser_drafter``), behind the access log, CORS and the guard, with the errors
every route answers in (``errors``)."""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException

from . import browser_drafter, edge_sessions, metrics
from .config import GatewayConfig
from .drafter_pool import DrafterPool
from .errors import ApiError, api_error
from .middleware import AccessLog, Guard
from .gateway import Gateway
from .serving import router


def server_options(config: GatewayConfig) -> dict:
    """What the HTTP server must enforce itself, for ``uvicorn.Config``: a WebSocket frame over the body limit is
    refused (close 1009) before it is buffered, and a socket buffers at most ``ws_max_queue`` messages."""
    return {"ws_max_size": config.max_body_bytes, "ws_max_queue": config.ws_max_queue}


def create_app(pool: DrafterPool, config: GatewayConfig = GatewayConfig()) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        pool.close()  # the gateway owns its verifier connections: they end with it
        await app.state.gateway.close()

    docs: dict[str, Any] = {} if config.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Tandem", description="Lossless edge-cloud speculative decoding, OpenAI-compatible.",
                  lifespan=lifespan, **docs)
    app.state.gateway = Gateway(pool, config)
    app.include_router(router)
    app.include_router(edge_sessions.router)
    app.include_router(browser_drafter.router)
    app.add_middleware(Guard, config=config)
    if config.cors_origins:  # outside the guard: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=["X-Request-Id"])
    app.add_middleware(AccessLog)
    answer_errors(app, config)
    return app


def answer_errors(app: FastAPI, config: GatewayConfig) -> None:
    """Every error a route raises, and Starlette's and FastAPI's own, answered in OpenAI's shape (``ApiError``)."""
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        metrics.ERRORS.labels(e.code or str(e.status)).inc()
        if request.url.path.endswith("completions"):
            metrics.REQUESTS.labels(str(e.status)).inc()
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        """Starlette's own answers (no such route, a method the route does not take, ...) in OpenAI's shape."""
        if e.status_code == 404:
            message, code = f"Unknown route: {request.method} {request.url.path}", "not_found"
        elif e.status_code == 405:
            message, code = f"Method {request.method} not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(e.detail), None
        response = ApiError(e.status_code, message, code=code).response()
        response.headers.update(e.headers or {})  # e.g. a 405's Allow
        if code:
            metrics.ERRORS.labels(code).inc()
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":  # its loc holds a byte offset, not a field
            why = (first.get("ctx") or {}).get("error") or first.get("msg", "invalid")
            at = first.get("loc", ("body", None))[-1]
            return await _api_error(request, ApiError(
                400, f"The request body is not valid JSON: {why}" + (f" (at byte {at})" if isinstance(at, int) else
                                                                      ""), code="invalid_json"))
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        param = (first.get("ctx") or {}).get("field") or loc or None
        msg = first.get("msg", "invalid")
        if first.get("type") == "extra_forbidden":
            msg = "unrecognized request argument (not part of this API, or not supported by Tandem)"
        if first.get("type") == "unsupported_field":
            return await _api_error(request, ApiError(400, msg, param=param, code="unsupported_parameter"))
        return await _api_error(request, ApiError(400, f"{loc or 'body'}: {msg}", param=param,
                                                  code="invalid_value"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return await _api_error(request, api_error(e, config.retry_after_s))
