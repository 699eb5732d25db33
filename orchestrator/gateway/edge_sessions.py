"""The session protocol over WebSocket, for clients that cannot speak gRPC (a browser tab, an app's web view), and
the edge tokens that open it.

``/v1/edge/session`` carries the gRPC ``Session`` stream's own messages: each binary WebSocket message from the
client is one serialized ``SessionRequest``, each from the gateway one ``SessionResponse`` (one protocol, two
transports; ``docs/protocol.md``). The gateway relays them to its verifier over gRPC with its own key, after
rewriting what the caller may not choose: the cache partition and, for an edge token, the most new tokens. An API
key's session runs in that key's partition (as its REST requests do, split further by its ``cache_salt``); an edge
token's in a partition of the token's own, or of its subject's devices when the minting call granted that
(``edge_tokens``), whatever ``cache_salt`` it sends, and unless granted its ``Opened`` says nothing of the cache
(``cached_tokens`` and ``prefill_us`` zero): a device never learns what another device of the same app sent. A
stream the verifier ends with an error closes the WebSocket with code 4000 + the gRPC status code (4003
INVALID_ARGUMENT, 4008 RESOURCE_EXHAUSTED, 4016 UNAUTHENTICATED, ...) and its message as the reason; the
verifier's own end after ``Closed`` is a normal close (1000).

Credentials, checked before the first message is read: an edge token (``edge_tokens``) or an API key, offered as
the subprotocol ``bearer.<credential>`` beside ``tandem.v1`` (browsers cannot set headers on a WebSocket), or as
``Authorization: Bearer`` by clients that can. Limits, all before the verifier is asked: WebSockets open at once
per key (``max_websockets_per_key``), a token's sessions counted from the moment its socket is accepted (so silent
sockets cannot pile up past ``max_sessions``), an Open within ``open_timeout_s``, and frames no larger than the
body limit (the server refuses a bigger frame before buffering it: ``app.server_options``).

``GET /v1/edge/target`` (either credential, as a header) gives a device what it needs before a session: the
verifier's Health less its load figures; ``GET /v1/edge/tokenizer`` the target's tokenizer as ``tokenizer.json``.
Each download costs its key ``DOWNLOAD_COST_TOKENS`` of its token budget (``--key-tokens-per-minute``).
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator
from pathlib import Path

import grpc
from fastapi import APIRouter, Depends, Request, Response, WebSocket, WebSocketDisconnect
from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict

from tandem.core import tenancy
from tandem.core.gguf_tokenizer import UnsupportedTokenizer, tokenizer_json
from tandem.edge.client import RemoteError
from tandem.protos import verifier_pb2 as pb

from . import edge_tokens
from .dependencies import api_key, gateway
from .errors import ApiError
from .gateway import Gateway

router = APIRouter()
SUBPROTOCOL = "tandem.v1"
CREDENTIAL = "bearer."  # a subprotocol carrying the credential
DOWNLOAD_COST_TOKENS = 1024  # what one device download (tokenizer, drafter file) takes from its key's token budget


class MintRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttl_s: int = 600
    max_sessions: int = 1
    max_new_tokens: int = 1024
    subject: str | None = None  # the app's id of the user the device belongs to (kept in the token as a digest)
    share_cache: bool = False  # the tokens of this key minted for ``subject`` share one cache partition


@router.post("/v1/edge-tokens")
async def mint(req: MintRequest, gw: Gateway = Depends(gateway), key: str = Depends(api_key)) -> dict:
    """A token for a device: it opens up to ``max_sessions`` sessions at once, each of at most ``max_new_tokens``
    new tokens, for ``ttl_s`` seconds, charged to the calling key's quotas, in a cache partition of its own (or,
    with ``share_cache``, its ``subject``'s)."""
    try:
        token, claims = edge_tokens.mint(gw.config.salt_secret, key, time.time(), req.ttl_s, req.max_sessions,
                                         req.max_new_tokens, req.subject, req.share_cache)
    except edge_tokens.TokenError as e:
        raise ApiError(400, str(e), code="invalid_value") from None
    return {"object": "edge_token", "token": token, "expires_at": claims.expires_at, "scope": "session",
            "max_sessions": claims.max_sessions, "max_new_tokens": claims.max_new_tokens,
            "share_cache": bool(claims.shared)}


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Caller:
    key: str  # the API key the session is charged to
    claims: edge_tokens.Claims | None  # when it came with an edge token

    @property
    def sees_cache(self) -> bool:
        """Whether ``Opened`` may tell this caller about the cache: an API key, or a token whose subject's devices
        were granted one cache. A token in a partition of its own is told nothing: it could learn only what its
        own device sent, and the zeros stay a last line should partitions ever be merged by mistake."""
        return self.claims is None or bool(self.claims.shared)


def _credential(ws: WebSocket) -> str:
    for offered in ws.scope.get("subprotocols") or ():
        if offered.startswith(CREDENTIAL):
            return offered[len(CREDENTIAL):]
    return _bearer(ws.headers.get("authorization") or "")


def caller(gw: Gateway, credential: str, now: float) -> Caller:
    """Who an edge session runs as: the key that minted its token, or the API key it presented."""
    keys = gw.config.keys
    if credential.startswith(edge_tokens.PREFIX + "."):
        try:
            claims = edge_tokens.verify(gw.config.salt_secret, credential, now)
        except edge_tokens.TokenError as e:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, str(e)) from None
        served = [k.decode() for k in keys.keys] if keys.enabled else ["anonymous"]
        secret = gw.config.salt_secret
        key = next((k for k in served
                    if hmac.compare_digest(edge_tokens.key_digest(secret, k), claims.key_digest)), None)
        if key is None:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "the key that minted this edge token is no longer served")
        return Caller(key, claims)
    if not keys.check(f"Bearer {credential}" if credential else None):
        raise Refused(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid credential: offer the subprotocol "
                                                       "'bearer.<edge token>' (or an Authorization header)")
    return Caller(credential or "anonymous", None)


def device(request: Request) -> "Caller":
    """The caller of a device-facing HTTP route: an edge token or an API key, as ``Authorization: Bearer``."""
    try:
        return caller(request.app.state.gateway, _bearer(request.headers.get("authorization") or ""), time.time())
    except Refused as e:
        raise ApiError(401, str(e), code="invalid_api_key") from None


def download(request: Request) -> "Caller":
    """``device``, charged ``DOWNLOAD_COST_TOKENS`` of its key's token budget (429 when spent): the files a device
    fetches are work and bandwidth like any other."""
    who = device(request)
    request.app.state.gateway.lease(who.key, DOWNLOAD_COST_TOKENS, slot=False).release(DOWNLOAD_COST_TOKENS)
    return who


TARGET_FIELDS = ("targetModel", "engine", "vocabSize", "vocabFingerprint", "nCtx", "chatTemplate", "bosToken",
                 "eosToken")  # Health less its load figures: those are every tenant's traffic


@router.get("/v1/edge/target")
async def target(gw: Gateway = Depends(gateway), _: Caller = Depends(device)) -> dict:
    """What a device needs before a session (docs/protocol.md, "Before a session"): the verifier's target, its
    vocabulary's size and fingerprint, context and chat template, as protobuf JSON. An API key or an edge token."""
    stub = gw.verifier_stub()
    if stub is None:
        raise ApiError(501, "this gateway has no verifier link for edge sessions", "server_error")
    try:
        health = await stub.Health(pb.HealthRequest(), timeout=5, metadata=gw.verifier_metadata())
    except grpc.aio.AioRpcError as e:
        raise ApiError(503, f"verifier: {e.details() or e.code().name}", "server_error", "verifier_unavailable",
                       retry_after_s=gw.config.retry_after_s) from None
    data = json_format.MessageToDict(health)
    return {k: data[k] for k in TARGET_FIELDS if k in data}


@router.get("/v1/edge/tokenizer")
async def tokenizer(gw: Gateway = Depends(gateway), _: Caller = Depends(download)) -> Response:
    """The target's tokenizer as a Hugging Face ``tokenizer.json``, for a device that tokenizes without llama.cpp
    (a browser): an HF target's own file, or a GGUF target's vocabulary converted (``core.gguf_tokenizer``, held
    to llama.cpp's tokenization). ``X-Vocab-Fingerprint`` names the vocabulary; it never changes under it."""
    loop = asyncio.get_running_loop()
    try:
        path, fingerprint = await loop.run_in_executor(None, _tokenizer_json, gw.pool.clients[0], gw.tokenizer_files)
    except RemoteError as e:
        raise ApiError(503 if e.code == grpc.StatusCode.UNAVAILABLE else 501, f"verifier: {e.details}",
                       "server_error", retry_after_s=gw.config.retry_after_s) from None
    except UnsupportedTokenizer as e:
        raise ApiError(501, str(e), "server_error") from None
    return Response(path.read_bytes(), media_type="application/json",
                    headers={"X-Vocab-Fingerprint": fingerprint, "Cache-Control": "private, max-age=86400"})


def _tokenizer_json(client, known: dict[str, Path]) -> tuple[Path, str]:
    """The target's tokenizer.json in the gateway's cache: fetched from the verifier (``EdgeClient``) and checked
    against its fingerprint once, a GGUF vocabulary converted once; after that a Health call finds it in ``known``
    (by fingerprint: a verifier replaced by another target gets its own)."""
    fingerprint = client.health().vocab_fingerprint
    if fingerprint in known and known[fingerprint].is_file():
        return known[fingerprint], fingerprint
    path, loaded = client.target_tokenizer_file()
    converted = path if path.suffix == ".json" else path.with_suffix(".tokenizer.json")
    if not converted.is_file():
        tmp = converted.with_name(f".{converted.name}.{os.getpid()}.tmp")
        tmp.write_text(tokenizer_json(path))
        tmp.replace(converted)
    known[loaded.vocab_fingerprint] = converted
    return converted, loaded.vocab_fingerprint


def _bearer(presented: str) -> str:
    return presented[7:].strip() if presented[:7].lower() == "bearer " else ""


@router.websocket("/v1/edge/session")
async def session(ws: WebSocket) -> None:
    gw: Gateway = ws.app.state.gateway
    offered = ws.scope.get("subprotocols") or ()
    await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    try:
        who = caller(gw, _credential(ws), time.time())
        with _held(gw.websockets, tenancy.tenant(who.key), gw.config.max_websockets_per_key,
                   f"this key already has {gw.config.max_websockets_per_key} WebSocket sessions open"):
            await _relay(ws, gw, who)
    except Refused as e:
        await _close(ws, 4000 + e.code.value[0], str(e))
    except WebSocketDisconnect:
        pass


async def _close(ws: WebSocket, code: int, reason: str) -> None:
    try:
        await ws.close(code, reason.encode()[:123].decode(errors="ignore"))  # a close frame's reason is 123 bytes
    except RuntimeError:  # already closed
        pass


@contextmanager
def _held(counts: dict[str, int], name: str, cap: int, refusal: str) -> Iterator[None]:
    """One of at most ``cap`` (0: no cap) held under ``name`` for the block (the gateway's one event loop counts)."""
    if cap and counts.get(name, 0) >= cap:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
    counts[name] = counts.get(name, 0) + 1
    try:
        yield
    finally:
        counts[name] -= 1
        if not counts[name]:
            del counts[name]


async def _first(ws: WebSocket, gw: Gateway, who: Caller) -> pb.SessionRequest:
    """The Open, checked and rewritten: the caller's cache partition (an edge token's own: the salt it sent is not
    its to choose), its opt-out of distillation unless its key opted in, the token's cap on new tokens."""
    request = await _receive(ws, gw.config.max_body_bytes)
    if not request.HasField("open"):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a session must be Open")
    o = request.open
    try:
        o.cache_salt = gw.device_salt(who.claims) if who.claims is not None else \
            gw.cache_salt(who.key, o.cache_salt or None)
    except ValueError as e:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    o.withhold_from_teacher = o.withhold_from_teacher or gw.withhold_from_teacher(who.key)
    if who.claims is not None:
        cap = who.claims.max_new_tokens
        o.limits.max_new_tokens = min(o.limits.max_new_tokens or cap, cap)
    return request


async def _receive(ws: WebSocket, max_bytes: int) -> pb.SessionRequest:
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    if message.get("bytes") is None:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "binary messages only: each a serialized SessionRequest")
    return _parse(message["bytes"], max_bytes)


def _parse(data: bytes, max_bytes: int) -> pb.SessionRequest:
    if len(data) > max_bytes:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"a message of {len(data)} bytes, over {max_bytes}")
    request = pb.SessionRequest()
    try:
        request.ParseFromString(data)
    except Exception:  # protobuf's DecodeError: not a SessionRequest
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "not a serialized tandem.v1.SessionRequest") from None
    return request


async def _relay(ws: WebSocket, gw: Gateway, who: Caller) -> None:
    stub = gw.verifier_stub()
    if stub is None:
        raise Refused(grpc.StatusCode.UNIMPLEMENTED, "this gateway has no verifier link for edge sessions")
    # a token's slot is taken from the moment its socket is accepted, not once its Open arrives: sockets that hold
    # back their Open count too
    cap = who.claims.max_sessions if who.claims else 0
    with _held(gw.edge_sessions, who.claims.token_id if who.claims else "", cap,
               f"this edge token already has its {cap} sessions open"):
        timeout_s = gw.config.open_timeout_s
        try:
            opening = await asyncio.wait_for(_first(ws, gw, who), timeout_s)
        except asyncio.TimeoutError:
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, f"no Open within {timeout_s:g} s of the session's "
                                                             f"start") from None
        o = opening.open
        try:
            lease = gw.lease(who.key, len(o.prompt_tokens) + o.limits.max_new_tokens)
        except ApiError as e:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message) from None
        committed = [len(o.prompt_tokens)]
        try:
            await _pump(ws, gw, stub, opening, committed, who.sees_cache)
        finally:
            lease.release(committed[0])  # the prompt and what was generated: what it used of its reservation


async def _pump(ws: WebSocket, gw: Gateway, stub, opening: pb.SessionRequest, committed: list[int],
                sees_cache: bool) -> None:
    call = stub.Session(metadata=gw.verifier_metadata())

    async def up() -> None:  # device -> verifier; a second Open is the verifier's to refuse
        while True:
            request = await _receive(ws, gw.config.max_body_bytes)
            await call.write(request)
            if request.HasField("close"):
                await call.done_writing()
                return

    async def down() -> None:  # verifier -> device
        while (response := await call.read()) is not grpc.aio.EOF:
            if response.HasField("verdict"):
                committed[0] = response.verdict.committed_len
            elif response.HasField("opened") and not sees_cache:
                response.opened.cached_tokens = response.opened.prefill_us = 0
            await ws.send_bytes(response.SerializeToString())

    uploads = downloads = None
    try:
        await call.write(opening)  # (a verifier that is down answers UNAVAILABLE here)
        uploads, downloads = asyncio.ensure_future(up()), asyncio.ensure_future(down())
        done, _ = await asyncio.wait({uploads, downloads}, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # an error on either side ends the session
        await downloads  # after the device's Close: the verifier's Closed, then its end of the stream
        await _close(ws, 1000, "")
    except grpc.aio.AioRpcError as e:
        await _close(ws, 4000 + e.code().value[0], e.details() or e.code().name)
    finally:
        for side in (uploads, downloads):
            if side is not None:
                side.cancel()
        call.cancel()
