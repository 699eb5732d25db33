"""OpenAI-compatible REST gateway: thin clients chat over HTTP; the gateway drafts for them on its own CPU and
verifies on the cloud pool over gRPC (DuoDecoding's split, on one host).

    POST /v1/chat/completions   (stream or not; SSE as OpenAI sends it)
    GET  /v1/models   /healthz   /readyz   /metrics

Layers, as in vLLM's serving layer: ``Guard`` (pure ASGI) turns away requests without a valid key (401) or with a
body over ``max_body_bytes`` (413) before anything reads the body; the routes (``router``) only convert HTTP to a
call of ``Gateway``, the serving class, which owns the drafter pool, per-key quotas and the verifier's identity;
generation runs on a worker thread behind ``edge.bridge.aiter_thread``, the SDK's own sync-to-async bridge.

Each request borrows one drafter (an ``EdgeClient``) from a fixed pool for its whole generation; when none is free
the answer is 429 with ``Retry-After``, as it is when the key's quota is spent; when the verifier pool is full or
unreachable, 503 with ``Retry-After``. A client that disconnects (streaming or not) stops its generation at the
next token and its verifier session is closed. Errors never echo internals: a 500 carries an id found in the log.
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import grpc
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem.core.auth import ApiKeys
from tandem.edge.bridge import aiter_thread
from tandem.edge.client import EdgeClient, RemoteError

from . import metrics, openai_api
from .quota import KeyLimits, Quotas, QuotaExceeded

log = logging.getLogger("tandem.gateway")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(openai_api.error(self.message, self.type, self.param, self.code), self.status, headers)


# verifier status -> what the REST client is told
_REMOTE = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "server_error", "verifier_busy"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "verifier_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, "server_error", "verifier_unavailable"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_request"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "invalid_request"),
}


def _error(e: BaseException, retry_after_s: int) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RemoteError):
        status, type_, code = _REMOTE.get(e.code, (502, "server_error", "verifier_error"))
        return ApiError(status, f"verifier: {e.details}", type_, code,
                        retry_after_s=retry_after_s if status == 503 else None)
    incident = uuid.uuid4().hex[:12]  # the log has the details; the client gets an id, not our internals
    log.error("request failed (incident %s)", incident, exc_info=e)
    return ApiError(500, f"internal error (incident {incident})", "server_error", "internal_error")


class DrafterPool:
    """Edge clients (one drafter each) lent to one request at a time."""

    def __init__(self, clients: Sequence[EdgeClient]):
        self.clients = list(clients)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for c in self.clients:
            self._free.put(c)

    def acquire(self) -> EdgeClient | None:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def release(self, client: EdgeClient) -> None:
        self._free.put(client)

    def free(self) -> int:
        return self._free.qsize()

    def close(self) -> None:
        for c in self.clients:
            c.close()


@dataclass
class GatewayConfig:
    keys: ApiKeys = field(default_factory=ApiKeys)
    model_name: str = ""  # served model id; default: the verifier's target model
    default_max_tokens: int = 512
    retry_after_s: int = 1
    max_body_bytes: int = 1 << 20  # request bodies over this are refused (413) before they are parsed
    limits: KeyLimits = field(default_factory=KeyLimits)  # per key: concurrency, tokens per minute
    public_metrics: bool = False  # /metrics without a key (a scraper on a private network)
    docs: bool = False  # /docs and /openapi.json
    identity_ttl_s: float = 2.0  # how long /readyz and requests trust the verifier's last Health answer


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
        protected = path.startswith("/v1/") or (path == "/metrics" and not c.public_metrics)
        if protected and not c.keys.check(headers.get(b"authorization", b"").decode("latin-1")):
            metrics.ERRORS.labels("invalid_api_key").inc()
            return await ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                  code="invalid_api_key").response()(scope, receive, send)
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


# -- the serving class -------------------------------------------------------------------------------------------------
@dataclass
class _Prepared:
    client: EdgeClient
    prompt: list[int]
    max_new: int
    req: openai_api.ChatRequest
    lease: object
    model: str


class Gateway:
    def __init__(self, pool: DrafterPool, config: GatewayConfig):
        self.pool, self.config = pool, config
        self.quotas = Quotas(config.limits)
        self._identity: dict | None = None
        self._identity_at = 0.0

    async def identity(self, fresh: bool = False) -> dict:
        """The verifier's target and context, from a Health call at most ``identity_ttl_s`` old (raises ApiError 503
        when the verifier does not answer: /readyz follows the verifier, not a memory of it)."""
        if fresh or self._identity is None or time.monotonic() - self._identity_at > self.config.identity_ttl_s:
            try:
                h = await asyncio.to_thread(self.pool.clients[0].health, 2.0)
            except RemoteError as e:
                self._identity = None
                raise _error(e, self.config.retry_after_s) from None
            if h.draining:
                self._identity = None
                raise ApiError(503, "verifier: shutting down", "server_error", "verifier_unavailable",
                               retry_after_s=self.config.retry_after_s)
            self._identity, self._identity_at = {"model": h.target_model, "n_ctx": h.n_ctx}, time.monotonic()
        return self._identity

    async def model_id(self) -> str:
        return self.config.model_name or (await self.identity())["model"]

    async def prepare(self, req: openai_api.ChatRequest, key: str) -> _Prepared:
        """Everything that can refuse a request, before any generation: model, quota, a free drafter, context."""
        info = await self.identity()
        model = self.config.model_name or info["model"]
        if req.model != model:
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves '{model}'.",
                           code="model_not_found", param="model")
        max_new = req.max_new_tokens(self.config.default_max_tokens)
        # tokenize off the loop, before borrowing anything: a request that cannot fit is a 400 even when busy (the
        # tokenizer only reads the vocabulary, so any drafter's serves while that drafter generates)
        prompt = await asyncio.to_thread(self.pool.clients[0].prompt_tokens, req.chat_messages())
        if req.max_new_tokens(0) == 0:  # not asked: what fits, up to the default
            max_new = min(max_new, max(1, info["n_ctx"] - len(prompt) - 16))
        if len(prompt) + max_new > info["n_ctx"]:
            raise ApiError(400, f"This model's maximum context length is {info['n_ctx']} tokens. However, you "
                                f"requested {len(prompt) + max_new} tokens ({len(prompt)} in the messages, "
                                f"{max_new} in the completion). Please reduce the length of the messages or "
                                f"completion.", code="context_length_exceeded", param="messages")
        try:
            lease = self.quotas.acquire(key, max_new)
        except QuotaExceeded as e:
            raise ApiError(429, str(e), "rate_limit_exceeded", "rate_limit_exceeded",
                           retry_after_s=e.retry_after_s) from None
        client = self.pool.acquire()
        if client is None:
            lease.release(0)
            raise ApiError(429, "All drafters are busy; retry shortly.", "rate_limit_exceeded",
                           "rate_limit_exceeded", retry_after_s=self.config.retry_after_s)
        return _Prepared(client, prompt, max_new, req, lease, model)

    async def _generate(self, p: _Prepared) -> AsyncIterator[str | tuple]:
        """Text deltas as tokens commit, then ("done", generation); the drafter and quota are given back however it
        ends (finished, failed, or abandoned by a client that went away)."""
        def give_back(tokens: int) -> None:
            metrics.SESSIONS.dec()
            p.lease.release(tokens)
            self.pool.release(p.client)

        t0, ttft = time.perf_counter(), None
        metrics.SESSIONS.inc()
        try:
            gen = p.client.generate(p.prompt, max_new_tokens=p.max_new, sampling=p.req.sampling(),
                                    stop=p.req.stop or [])
            # given back on the generation's thread, once it has really ended (see edge.bridge)
            bridge = aiter_thread(gen, on_exit=lambda: give_back(len(gen.tokens)))
        except BaseException:
            give_back(0)
            raise
        async with aclosing(bridge) as chunks:  # leaving early stops the generation at its next token
            async for chunk in chunks:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                yield chunk
        metrics.record_generation(gen.stats, ttft)
        yield ("done", gen)

    async def complete(self, p: _Prepared, disconnected) -> dict:
        """The whole answer; stops (and frees the session) if ``disconnected()`` turns true meanwhile."""
        texts: list[str] = []
        done: list = []

        async def consume():
            async for item in self._generate(p):
                (done if isinstance(item, tuple) else texts).append(item)

        task = asyncio.create_task(consume())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await disconnected():
                task.cancel()
                log.info("client went away: generation stopped")
                await asyncio.gather(task, return_exceptions=True)
                raise ApiError(499, "client closed the request", code="client_closed")
        task.result()  # raises the generation's error
        gen = done[0][1]
        return openai_api.completion(openai_api.completion_id(), p.model, gen.text, gen.finish_reason or "stop",
                                     gen.stats)

    async def stream(self, p: _Prepared) -> AsyncIterator[str]:
        """Server-sent events as OpenAI sends them. The generation's first event is awaited before this returns,
        so a failure to start (a full or unreachable verifier) is still an HTTP status; later errors go into the
        stream."""
        items = self._generate(p)
        try:
            first = await items.__anext__()
        except BaseException:
            await items.aclose()
            raise
        return self._sse(p, first, items)

    async def _sse(self, p: _Prepared, first, items) -> AsyncIterator[str]:
        cid, created = openai_api.completion_id(), int(time.time())
        include_usage = bool(p.req.stream_options and p.req.stream_options.include_usage)

        def data(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def all_items():
            yield first
            async for item in items:
                yield item

        yield data(openai_api.chunk(cid, p.model, created, {"role": "assistant", "content": ""}))
        try:
            async for item in all_items():
                if isinstance(item, tuple):
                    gen = item[1]
                    yield data(openai_api.chunk(cid, p.model, created, {}, gen.finish_reason or "stop"))
                    if include_usage:
                        yield data(openai_api.chunk(cid, p.model, created, stats=gen.stats))
                else:
                    yield data(openai_api.chunk(cid, p.model, created, {"content": item}))
        except Exception as e:
            err = _error(e, self.config.retry_after_s)
            metrics.ERRORS.labels(err.code or str(err.status)).inc()
            yield data(openai_api.error(err.message, err.type, err.param, err.code))
        yield "data: [DONE]\n\n"


# -- routes: HTTP <-> Gateway, nothing else ----------------------------------------------------------------------------
router = APIRouter()


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def api_key(request: Request) -> str:
    """The caller's key (the guard has checked it already; with auth off, everyone is "anonymous")."""
    keys: ApiKeys = request.app.state.gateway.config.keys
    presented = request.headers.get("authorization") or ""
    if not keys.check(presented):
        raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")
    return presented[7:].strip() if presented[:7].lower() == "bearer " else (presented or "anonymous")


@router.get("/healthz")
async def healthz():
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(gw: Gateway = Depends(gateway)):
    try:
        info = await gw.identity(fresh=True)
    except ApiError as e:
        return JSONResponse({"status": "verifier unreachable", "detail": e.message}, 503)
    return {"status": "ready", "model": await gw.model_id(), "n_ctx": info["n_ctx"],
            "drafters": len(gw.pool.clients), "drafters_free": gw.pool.free()}


@router.get("/metrics")
async def prometheus():
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(gw: Gateway = Depends(gateway), key: str = Depends(api_key)):
    return {"object": "list", "data": [{"id": await gw.model_id(), "object": "model", "created": 0,
                                        "owned_by": "tandem"}]}


@router.post("/v1/chat/completions")
async def chat_completions(req: openai_api.ChatRequest, request: Request, gw: Gateway = Depends(gateway),
                           key: str = Depends(api_key)):
    try:
        prepared = await gw.prepare(req, key)
        if not req.stream:
            body = await gw.complete(prepared, request.is_disconnected)
            metrics.REQUESTS.labels("200").inc()
            return body
        events = await gw.stream(prepared)
    except Exception as e:  # answered here: past the route, Starlette would log it as a crash and drop the connection
        raise _error(e, gw.config.retry_after_s) from None
    metrics.REQUESTS.labels("200").inc()
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(pool: DrafterPool, config: GatewayConfig = GatewayConfig()) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        pool.close()  # the gateway owns its verifier connections: they end with it

    docs = {} if config.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Tandem", description="Lossless edge-cloud speculative decoding, OpenAI-compatible.",
                  lifespan=lifespan, **docs)
    app.state.gateway = Gateway(pool, config)
    app.include_router(router)
    app.add_middleware(Guard, config=config)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        metrics.ERRORS.labels(e.code or str(e.status)).inc()
        if request.url.path.endswith("/chat/completions"):
            metrics.REQUESTS.labels(str(e.status)).inc()
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        return await _api_error(request, ApiError(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}",
                                                  param=".".join(loc) or None, code="invalid_value"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return await _api_error(request, _error(e, config.retry_after_s))

    return app
