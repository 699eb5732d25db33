"""OpenAI-compatible REST gateway: thin clients chat over HTTP; the gateway drafts for them on its own CPU and
verifies on the cloud pool over gRPC (DuoDecoding's split, on one host).

    POST /v1/chat/completions   (stream or not; SSE as OpenAI sends it)
    GET  /v1/models   /healthz   /readyz   /metrics

Each request borrows one drafter (an ``EdgeClient``) from a fixed pool for its whole generation; when none is free
the answer is 429 with ``Retry-After``, and when the verifier pool is full or unreachable, 503 with
``Retry-After``. A streaming client that disconnects stops its generation at the next token and its verifier
session is closed. Routes stay thin: wire shapes live in ``openai_api``, generation in ``edge.client``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from edge.client import EdgeClient, RemoteError

from . import metrics, openai_api
from core.auth import ApiKeys

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
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_request"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "invalid_request"),
}


def _remote_error(e: RemoteError, retry_after_s: int) -> ApiError:
    status, type_, code = _REMOTE.get(e.code, (502, "server_error", "verifier_error"))
    return ApiError(status, f"verifier: {e.details}", type_, code, retry_after_s=retry_after_s if status == 503
                    else None)


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


class _Run:
    """One generation on a worker thread, its events handed to the event loop: ("text", str) ...,
    then ("done", Generation) or ("error", exception). ``cancel`` stops it at the next token."""

    def __init__(self, pool: DrafterPool, client: EdgeClient, prompt: list[int], kwargs: dict):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self.t0 = time.perf_counter()
        self.ttft_s: float | None = None
        metrics.SESSIONS.inc()
        threading.Thread(target=self._work, args=(pool, client, prompt, kwargs), daemon=True).start()

    def cancel(self) -> None:
        self._cancelled.set()

    def _emit(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def _work(self, pool: DrafterPool, client: EdgeClient, prompt: list[int], kwargs: dict) -> None:
        try:
            gen = client.generate(prompt, **kwargs)
            for text in gen:
                if self.ttft_s is None:
                    self.ttft_s = time.perf_counter() - self.t0
                if self._cancelled.is_set():
                    gen.cancel()  # closes the verifier session now
                    log.info("client went away: generation stopped after %d tokens", len(gen.tokens))
                    break
                self._emit("text", text)
            metrics.record_generation(gen.stats, self.ttft_s)
            self._emit("done", gen)
        except Exception as e:  # delivered to the request
            self._emit("error", e)
        finally:
            metrics.SESSIONS.dec()
            pool.release(client)


def create_app(pool: DrafterPool, config: GatewayConfig = GatewayConfig()) -> FastAPI:
    app = FastAPI(title="Tandem", description="Lossless edge-cloud speculative decoding, OpenAI-compatible.")
    target: dict = {}  # verifier identity, learnt on first use

    def verifier() -> dict:
        if not target:
            h = pool.clients[0].health(timeout_s=5)
            target.update(model=h.target_model, n_ctx=h.n_ctx)
        return target

    def served_model() -> str:
        return config.model_name or verifier()["model"]

    def authorize(request: Request) -> None:
        if not config.keys.check(request.headers.get("authorization")):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

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

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        try:
            info = await asyncio.to_thread(verifier)
        except RemoteError as e:
            return JSONResponse({"status": "verifier unreachable", "detail": e.details}, 503)
        return {"status": "ready", "model": served_model(), "n_ctx": info["n_ctx"], "drafters": len(pool.clients),
                "drafters_free": pool.free()}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        name = await asyncio.to_thread(served_model)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "tandem"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: openai_api.ChatRequest, request: Request):
        authorize(request)
        try:
            info = await asyncio.to_thread(verifier)
        except RemoteError as e:
            raise _remote_error(e, config.retry_after_s) from None
        if req.model != served_model():
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves '{served_model()}'.",
                           code="model_not_found", param="model")
        client = pool.acquire()
        if client is None:
            raise ApiError(429, "All drafters are busy; retry shortly.", "rate_limit_exceeded",
                           "rate_limit_exceeded", retry_after_s=config.retry_after_s)
        try:
            prompt = client.prompt_tokens(req.chat_messages())
            max_new = req.max_new_tokens(min(config.default_max_tokens, max(1, info["n_ctx"] - len(prompt) - 16)))
            if len(prompt) + max_new > info["n_ctx"]:
                raise ApiError(400, f"This model's maximum context length is {info['n_ctx']} tokens. However, you "
                                    f"requested {len(prompt) + max_new} tokens ({len(prompt)} in the messages, "
                                    f"{max_new} in the completion). Please reduce the length of the messages or "
                                    f"completion.", code="context_length_exceeded", param="messages")
        except BaseException:
            pool.release(client)
            raise
        run = _Run(pool, client, prompt, dict(max_new_tokens=max_new, sampling=req.sampling(), stop=req.stop or []))
        first = await run.events.get()
        if first[0] == "error":
            raise _error(first[1], config)
        model, cid, created = served_model(), openai_api.completion_id(), int(time.time())
        if not req.stream:
            texts = []
            event = first
            while event[0] == "text":
                texts.append(event[1])
                event = await run.events.get()
            if event[0] == "error":
                raise _error(event[1], config)
            gen = event[1]
            metrics.REQUESTS.labels("200").inc()
            return openai_api.completion(cid, model, gen.text, gen.finish_reason or "stop", gen.stats)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def sse():
            def data(obj) -> str:
                return f"data: {json.dumps(obj)}\n\n"

            try:
                yield data(openai_api.chunk(cid, model, created, {"role": "assistant", "content": ""}))
                event = first
                while event[0] == "text":
                    yield data(openai_api.chunk(cid, model, created, {"content": event[1]}))
                    event = await run.events.get()
                if event[0] == "error":  # headers are sent: the error goes in the stream, as OpenAI does
                    err = _error(event[1], config)
                    yield data(openai_api.error(err.message, err.type, err.param, err.code))
                else:
                    gen = event[1]
                    yield data(openai_api.chunk(cid, model, created, {}, gen.finish_reason or "stop"))
                    if include_usage:
                        yield data(openai_api.chunk(cid, model, created, stats=gen.stats))
                yield "data: [DONE]\n\n"
            finally:
                run.cancel()  # no-op when finished; a disconnected client stops its generation here

        metrics.REQUESTS.labels("200").inc()
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def _error(e: Exception, config: GatewayConfig) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RemoteError):
        return _remote_error(e, config.retry_after_s)
    log.exception("generation failed", exc_info=e)
    return ApiError(500, f"internal error: {e}", "server_error", "internal_error")
