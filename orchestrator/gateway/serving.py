"""OpenAI-compatible REST gateway: thin clients chat over HTTP; the gateway drafts for them on its own CPU and
verifies on the cloud pool over gRPC (DuoDecoding's split, on one host).

    POST /v1/chat/completions   POST /v1/completions   (stream or not; SSE as OpenAI sends it)
    POST /tokenize   POST /detokenize   (vLLM's shapes)
    GET  /v1/models   /v1/models/{id}   /health   /healthz   /readyz   /metrics

Layers, as in vLLM's serving layer: ``Guard`` (pure ASGI, ``middleware``) turns away requests without a valid key
(401) or with a body over ``max_body_bytes`` (413) before anything reads the body; the routes here (``router``) only
convert HTTP to a call of ``Gateway`` (``gateway``), the serving class, which owns the drafter pool, per-key quotas
and the verifier's identity; generation runs on a worker thread behind ``edge.bridge.aiter_thread``, the SDK's own
sync-to-async bridge. Errors are ``errors.ApiError``s; the configuration is ``config.GatewayConfig``. The
application that puts them together, with the relayed edge sessions, is ``app.create_app``.

Each request borrows one drafter (an ``EdgeClient``) from a fixed pool for its whole generation; when none is free it
waits its turn in a bounded queue (first come, first served, at most ``queue_timeout_s``: then 503 with
``Retry-After``), and only when the queue is full is the answer 429 with ``Retry-After``, as it is when the key's
quota is spent; when the verifier pool is full or unreachable, 503 with ``Retry-After``. Quotas (core.quota) are
taken before the gateway tokenizes anything and count prompt and completion tokens; ``/tokenize`` and ``/detokenize``
are metered too. Each generation carries a cache salt derived from the gateway's secret and the caller's key
(core.tenancy), so no API key's prompts are ever served from, or reveal anything of, another key's cache. A client
that disconnects (streaming or not, or while it waits for a drafter) stops its generation at the next token and its
verifier session is closed. Errors never echo internals: a 500 carries an id found in the log.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem.core import tracing

from . import chat_page as chat_page_html
from . import metrics, openai_api
from .dependencies import api_key, gateway
from .errors import ApiError, api_error
from .gateway import Gateway, GenRequest

router = APIRouter()


# the page's own inline script and style, requests to this origin only, never framed by another site
# (and, to draft in the browser, this origin's client modules and the WebAssembly they compile)
CHAT_PAGE_CSP = ("default-src 'none'; script-src 'self' 'unsafe-inline' 'wasm-unsafe-eval'; style-src 'unsafe-inline'; "
                 "connect-src 'self'; frame-ancestors 'none'")


@router.get("/chat", include_in_schema=False)
async def chat_page(request: Request) -> HTMLResponse:
    if not request.app.state.gateway.config.chat_page:
        raise ApiError(404, "the chat page is off on this gateway (--no-chat-page)", code="not_found")
    # cross-origin isolated (it loads nothing from another origin): the in-browser drafter may then run threads
    return HTMLResponse(chat_page_html.PAGE, headers={"Content-Security-Policy": CHAT_PAGE_CSP,
                                                      "X-Content-Type-Options": "nosniff",
                                                      "Cross-Origin-Opener-Policy": "same-origin",
                                                      "Cross-Origin-Embedder-Policy": "require-corp"})


@router.get("/healthz")
async def healthz():
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/health")
async def health(gw: Gateway = Depends(gateway)):
    """vLLM's health check: 200 while the gateway can serve (its verifier answers), else the verifier's 503;
    whether there is room now is /readyz's question."""
    await gw.identity()
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(gw: Gateway = Depends(gateway)):
    """200 while a request would be taken now: the verifier answers and has room, and a drafter is free or the
    queue for one has room. A load balancer then sends the next request elsewhere instead of to a full gateway."""
    try:  # the verifier's answer of the last identity_ttl_s, or the one call in flight: cheap however often
        info = await gw.identity()
    except ApiError as e:
        return JSONResponse({"status": "verifier unreachable", "detail": e.message}, 503)
    body = {"status": "ready", "model": await gw.model_id(), "n_ctx": info["n_ctx"],
            "drafters": len(gw.pool.clients), "drafters_free": gw.pool.free(), "queued": gw.pool.waiting(),
            "queue_depth": gw.config.queue_depth,
            "verifier_sessions": info["sessions"], "verifier_max_sessions": info["max_sessions"]}
    if not body["drafters_free"] and body["queued"] >= gw.config.queue_depth:
        return JSONResponse(body | {"status": "busy", "detail": "every drafter is lent and the queue for one is "
                                                                "full"}, 503)
    if info["sessions"] >= info["max_sessions"]:
        return JSONResponse(body | {"status": "busy", "detail": "the verifier has no free session"}, 503)
    return body


@router.get("/metrics")
async def prometheus():
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(gw: Gateway = Depends(gateway), key: str = Depends(api_key)):
    return {"object": "list", "data": await gw.models()}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, gw: Gateway = Depends(gateway), key: str = Depends(api_key)):
    await gw.model_for(model)  # 404 model_not_found for an id this gateway does not serve
    return next(m for m in await gw.models() if m["id"] == model)


@router.post("/tokenize")
async def tokenize(req: openai_api.TokenizeRequest, gw: Gateway = Depends(gateway), key: str = Depends(api_key)):
    info = await gw.identity()
    await gw.model_for(req.model)
    lease, tokens = gw.lease(key, 1, slot=False), []  # metered: a key in debt tokenizes nothing; charged after
    try:
        if req.messages is not None:
            chat = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
            tokens = await asyncio.to_thread(gw.chat_tokens, chat)
        else:
            tokens = await asyncio.to_thread(gw.tokenizer.tokenize, req.prompt or "")
    finally:
        lease.release(len(tokens))
    return {"count": len(tokens), "max_model_len": info["n_ctx"], "tokens": tokens}


@router.post("/detokenize")
async def detokenize(req: openai_api.DetokenizeRequest, gw: Gateway = Depends(gateway),
                     key: str = Depends(api_key)):
    await gw.model_for(req.model)
    gw.check_ids(req.tokens, "tokens")
    lease = gw.lease(key, 1, slot=False)
    try:
        text = await asyncio.to_thread(gw.detokenize, req.tokens)
    finally:
        lease.release(len(req.tokens))
    return {"prompt": text}


@router.post("/v1/chat/completions")
async def chat_completions(req: openai_api.ChatRequest, request: Request, gw: Gateway = Depends(gateway),
                           key: str = Depends(api_key)):
    return await _serve(req, request, gw, key)


@router.post("/v1/completions")
async def completions(req: openai_api.CompletionRequest, request: Request, gw: Gateway = Depends(gateway),
                      key: str = Depends(api_key)):
    return await _serve(req, request, gw, key)


async def _serve(req: GenRequest, request: Request, gw: Gateway, key: str):
    # one trace per generation: this span (continuing the client's traceparent, if any) -> the edge client's
    # generation -> the verifier's session and rounds
    span = tracing.start_span("tandem.gateway.request", tracing.extract(list(request.headers.items())), "server",
                              {"http.route": request.url.path, "tandem.stream": req.stream})
    try:
        with tracing.use(span):
            prepared = await gw.prepare(req, key, request.is_disconnected)
            if not req.stream:
                body = await gw.complete(prepared, request.is_disconnected)
                metrics.REQUESTS.labels("200").inc()
                span.end()
                return body
            events = await gw.stream(prepared)
    except Exception as e:  # answered here: past the route, Starlette would log it as a crash and drop the connection
        err = api_error(e, gw.config.retry_after_s)
        span.set_attribute("http.status_code", err.status)
        span.set_status_error(err.message)
        span.end()
        raise err from None
    metrics.REQUESTS.labels("200").inc()
    return StreamingResponse(_ending(events, span), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _ending(events: AsyncIterator[str], span) -> AsyncIterator[str]:
    """The stream's events; its span ends with the stream (finished or abandoned)."""
    try:
        async for event in events:
            yield event
    finally:
        span.end()
