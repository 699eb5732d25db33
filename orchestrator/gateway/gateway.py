"""The serving class, ``Gateway``: what the REST routes (``serving``) and the relayed edge sessions
(``edge_sessions``) call. It owns the drafter pool, per-key quotas and the verifier's identity, and turns one
OpenAI request into one generation: ``prepare`` (everything that can refuse it: model, quota, context, a drafter),
then ``complete`` (the whole answer) or ``stream`` (server-sent events as OpenAI sends them). Generation runs on a
worker thread behind ``edge.bridge.aiter_thread``; a caller that goes away stops it at the next token.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncGenerator, AsyncIterator, Iterator, cast

from tandem.core import auth, tenancy
from tandem.core.chat_template import TemplateError
from tandem.core.model_id import model_slug
from tandem.core.quota import Lease, Quotas, QuotaExceeded
from tandem.edge.bridge import aiter_thread
from tandem.edge.client import EdgeClient, Generation, RemoteError
from tandem.protos import verifier_pb2_grpc as pb_grpc

from . import metrics, openai_api, tool_calls
from .config import GatewayConfig
from .drafter_pool import DrafterPool, Gone, PoolFull, QueueTimeout
from .errors import ApiError, api_error

log = logging.getLogger("tandem.gateway")

GenRequest = openai_api.ChatRequest | openai_api.CompletionRequest


@dataclass
class Prepared:
    """A request ``Gateway.prepare`` admitted: its drafter, prompt, budget and quota lease, ready to generate."""
    client: EdgeClient
    prompt: list[int]
    max_new: int
    req: GenRequest
    lease: Lease
    model: str
    cache_salt: str  # the caller's cache partition (core.tenancy)
    withhold_from_teacher: bool  # the caller's tenant did not opt in to distillation
    echo: str = ""  # completions with echo: the prompt's text, sent before the completion
    top_logprobs: int | None = None  # logprobs asked: alternatives per token
    gen: Generation | None = None  # once started
    logprobs_sent: int = 0  # tokens whose logprobs a stream has sent


class Gateway:
    def __init__(self, pool: DrafterPool, config: GatewayConfig):
        self.pool, self.config = pool, config
        self.quotas = Quotas(config.limits)
        self._identity: dict | None = None
        self._identity_at = 0.0
        self._asking: asyncio.Future | None = None  # the Health call in flight, which every caller shares
        # Health calls run on their own thread: a flood of /readyz never queues behind (or starves) tokenizing
        self._health_thread = ThreadPoolExecutor(1, thread_name_prefix="gateway-health")
        self.created = int(time.time())  # /v1/models' "created": when this gateway started serving the model
        self.edge_sessions: dict[str, int] = {}  # relayed sessions open, by edge token id ("": API keys)
        self.websockets: dict[str, int] = {}  # relayed sessions' sockets open, by key (tenancy.tenant)
        self.tokenizer_files: dict[str, Path] = {}  # the target's tokenizer.json served to devices, by fingerprint
        self._verifier_channel = None  # made on the first relayed session, inside the serving loop

    def verifier_stub(self) -> pb_grpc.VerifierStub | None:
        """An asyncio stub of the verifier for relayed edge sessions (None without a ``VerifierLink``)."""
        link = self.config.verifier
        if link is None:
            return None
        if self._verifier_channel is None:
            self._verifier_channel = auth.channel(link.address, link.tls_ca, link.server_name, aio=True)
        return pb_grpc.VerifierStub(self._verifier_channel)

    def verifier_metadata(self) -> tuple:
        link = self.config.verifier
        return ((auth.HEADER, f"Bearer {link.key}"),) if link and link.key else ()

    async def close(self) -> None:
        self._health_thread.shutdown(wait=False)
        if self._verifier_channel is not None:
            await self._verifier_channel.close()

    async def identity(self, fresh: bool = False) -> dict:
        """The verifier's target and context, from a Health call at most ``identity_ttl_s`` old (raises ApiError 503
        when the verifier does not answer: /readyz follows the verifier, not a memory of it). One call at a time:
        callers arriving while it runs wait for its answer."""
        if fresh or self._identity is None or time.monotonic() - self._identity_at > self.config.identity_ttl_s:
            if self._asking is None or self._asking.done():
                self._asking = asyncio.ensure_future(self._ask())
            await asyncio.shield(self._asking)
        assert self._identity is not None
        return self._identity

    async def _ask(self) -> None:
        """One Health call; its answer (or its failure) is recorded before any caller waiting on it resumes."""
        loop = asyncio.get_running_loop()
        try:
            h = await loop.run_in_executor(self._health_thread, self.pool.clients[0].health, 2.0)
        except RemoteError as e:
            self._identity = None
            raise api_error(e, self.config.retry_after_s) from None
        if h.draining:
            self._identity = None
            raise ApiError(503, "verifier: shutting down", "server_error", "verifier_unavailable",
                           retry_after_s=self.config.retry_after_s)
        self._identity, self._identity_at = {"model": h.target_model, "n_ctx": h.n_ctx,
                                             "sessions": h.active_sessions, "max_sessions": h.max_sessions}, \
            time.monotonic()

    def cache_salt(self, key: str, requested: str | None) -> str:
        """The salt this caller's generations carry to the verifier (core.tenancy.gateway_salt)."""
        return tenancy.gateway_salt(self.config.salt_secret, key, requested)

    def device_salt(self, claims) -> str:
        """The salt of an edge token's sessions (core.tenancy.device_salt): the token's own partition, or its
        subject's devices' when the minting call granted them one."""
        return tenancy.device_salt(self.config.salt_secret, claims.key_digest, claims.cache_scope)

    def withhold_from_teacher(self, key: str) -> bool:
        """Whether this caller's sessions must keep nothing for distillation: all but ``teach_keys``' (opt-in)."""
        teach = self.config.teach_keys
        return not (teach.enabled and teach.check(key))

    def lease(self, key: str, tokens: int, slot: bool = True) -> Lease:
        """The key's quota for one request reserving ``tokens`` (429 when spent); ``slot`` False: metered, not
        counted against the key's concurrency."""
        try:
            return self.quotas.acquire(key, tokens, slot)
        except QuotaExceeded as e:
            raise ApiError(429, str(e), "rate_limit_exceeded", "rate_limit_exceeded",
                           retry_after_s=e.retry_after_s) from None

    async def model_ids(self) -> list[str]:
        """The served id (``--served-model-name``, else a slug of the target's name) and its aliases."""
        first = self.config.model_name or model_slug((await self.identity())["model"])
        return [first, *(a for a in self.config.aliases if a != first)]

    async def model_id(self) -> str:
        return (await self.model_ids())[0]

    async def models(self) -> list[dict]:
        """``/v1/models``' entries: one per id, aliases included."""
        info = await self.identity()
        return [{"id": name, "object": "model", "created": self.created, "owned_by": "tandem", "root": info["model"],
                 "max_model_len": info["n_ctx"]} for name in await self.model_ids()]

    @property
    def tokenizer(self):
        """The drafters' tokenizer: the target's vocabulary (the verifier checks its fingerprint at every Open). It
        only reads the vocabulary, so any drafter's serves while that drafter generates."""
        return self.pool.clients[0].drafter.tokenizer

    async def model_for(self, requested: str | None) -> str:
        ids = await self.model_ids()
        if requested is not None and requested not in ids:
            raise ApiError(404, f"The model '{requested}' does not exist; this server serves '{ids[0]}'.",
                           code="model_not_found", param="model")
        return ids[0]

    def check_ids(self, tokens: list[int], param: str) -> None:
        n_vocab = self.tokenizer.n_vocab
        bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {n_vocab})", param=param,
                           code="invalid_value")

    def _prompt(self, req: GenRequest) -> tuple[list[int], str]:
        """Prompt ids and, for an echo, its text (runs on a worker thread)."""
        if isinstance(req, openai_api.ChatRequest):
            return self.chat_tokens(req.chat_messages(), req.template_tools()), ""
        if isinstance(req.prompt, str):
            return self.tokenizer.tokenize(req.prompt), req.prompt if req.echo else ""
        ids = cast(list[int], list(req.prompt))  # (its validator leaves a string or one list of ids)
        self.check_ids(ids, "prompt")
        return ids, self.detokenize(ids) if req.echo else ""

    def chat_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Messages (and the tools offered) rendered by the target's chat template (the verifier's) and tokenized;
        a conversation the template refuses (e.g. roles that do not alternate) is a 400 with its message."""
        try:
            return self.pool.clients[0].prompt_tokens(messages, tools) if tools else \
                self.pool.clients[0].prompt_tokens(messages)
        except TemplateError as e:
            raise ApiError(400, f"messages: {e}", param="messages", code="invalid_value") from None

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.tokenizer.piece(t) for t in tokens).decode("utf-8", errors="replace")

    async def prepare(self, req: GenRequest, key: str, disconnected=None) -> Prepared:
        """Everything that can refuse a request, before any generation: model, quota, context, a drafter (waiting
        in line for one if need be, unless ``disconnected()`` says the caller left). The quota comes first
        (reserving ``max_tokens``): a key past its budget gets nothing tokenized; the prompt's tokens are then
        charged too, and stay charged if the request is refused after tokenizing."""
        info = await self.identity()
        model = await self.model_for(req.model)
        self.check_ids(list(req.logit_bias or ()), "logit_bias")
        max_new = req.max_new_tokens(self.config.default_max_tokens)
        lease = self.lease(key, max_new)
        prompt: list[int] = []
        try:
            prompt, echo = await asyncio.to_thread(self._prompt, req)  # off the loop
            what = "messages" if isinstance(req, openai_api.ChatRequest) else "prompt"
            try:
                lease.charge(len(prompt))
            except QuotaExceeded as e:
                raise ApiError(429, f"{e} (the prompt's {len(prompt)} tokens count)", "rate_limit_exceeded",
                               "rate_limit_exceeded", retry_after_s=e.retry_after_s) from None
            if req.max_new_tokens(0) == 0:  # not asked: what fits, up to the default
                max_new = min(max_new, max(1, info["n_ctx"] - len(prompt) - 16))
            if len(prompt) + max_new > info["n_ctx"]:
                raise ApiError(400, f"This model's maximum context length is {info['n_ctx']} tokens. However, you "
                                    f"requested {len(prompt) + max_new} tokens ({len(prompt)} in the {what}, "
                                    f"{max_new} in the completion). Please reduce the length of the {what} or "
                                    f"completion.", code="context_length_exceeded", param=what)
            salt = self.cache_salt(key, req.cache_salt)
            client = await self.drafter(salt, prompt, disconnected)
        except BaseException:
            lease.release(len(prompt))  # tokenizing was work done for this key
            raise
        return Prepared(client, prompt, max_new, req, lease, model, salt, self.withhold_from_teacher(key), echo,
                         req.wanted_logprobs())

    async def drafter(self, salt: str, prompt: list[int], disconnected=None) -> EdgeClient:
        """A drafter for this request (the next turn of a chat: the one that has the last), now or in its turn."""
        c = self.config
        client = self.pool.acquire(salt, prompt)
        if client is not None:
            metrics.QUEUE_WAIT_SECONDS.observe(0.0)
            return client
        metrics.QUEUED.inc()
        t0 = time.perf_counter()
        try:
            return await self.pool.lend(salt, prompt, max_waiting=c.queue_depth, timeout_s=c.queue_timeout_s,
                                        gone=disconnected)
        except PoolFull:
            raise ApiError(429, f"All {len(self.pool.clients)} drafters are busy and {c.queue_depth} requests are "
                                "waiting for one; retry shortly.", "rate_limit_exceeded", "drafters_busy",
                           retry_after_s=c.retry_after_s) from None
        except QueueTimeout:
            raise ApiError(503, f"No drafter came free within {c.queue_timeout_s:g} s; retry shortly.",
                           "server_error", "queue_timeout", retry_after_s=c.retry_after_s) from None
        except Gone:
            raise ApiError(499, "client closed the request", code="client_closed") from None
        finally:
            metrics.QUEUED.dec()
            metrics.QUEUE_WAIT_SECONDS.observe(time.perf_counter() - t0)

    async def _generate(self, p: Prepared) -> AsyncGenerator[str | tuple[str, Generation], None]:
        """Text deltas as tokens commit, then ("done", generation); the drafter and quota are given back however it
        ends (finished, failed, or abandoned by a client that went away)."""
        def give_back(tokens: int) -> None:
            metrics.SESSIONS.dec()
            p.lease.release(len(p.prompt) + tokens)
            self.pool.release(p.client)

        t0, ttft = time.perf_counter(), None
        metrics.SESSIONS.inc()
        try:
            gen = p.gen = p.client.generate(p.prompt, max_new_tokens=p.max_new, sampling=p.req.sampling(),
                                            stop=p.req.stop or [], top_logprobs=p.top_logprobs,
                                            constraint=p.req.constraint(), cache_salt=p.cache_salt,
                                            withhold_from_teacher=p.withhold_from_teacher)
            # given back on the generation's thread, once it has really ended (see edge.bridge)
            bridge = aiter_thread(_deltas(gen), on_exit=lambda: give_back(len(gen.tokens)))
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

    async def complete(self, p: Prepared, disconnected) -> dict:
        """The whole answer; stops (and frees the session) if ``disconnected()`` turns true meanwhile."""
        texts: list[str] = []
        done: list[tuple[str, Generation]] = []

        async def consume():
            async for item in self._generate(p):
                if isinstance(item, tuple):
                    done.append(item)
                else:
                    texts.append(item)

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
        if isinstance(p.req, openai_api.CompletionRequest):
            return openai_api.text_completion(openai_api.completion_id("cmpl"), p.model, p.echo + gen.text,
                                              gen.finish_reason or "stop", gen.stats, self._logprobs(p))
        text, calls, finish = gen.text, [], gen.finish_reason or "stop"
        if p.req.template_tools():
            text, found = tool_calls.parse(gen.text)
            calls = [c.wire() for c in found]
            finish = "tool_calls" if calls and finish == "stop" else finish
        return openai_api.completion(openai_api.completion_id(), p.model, text, finish, gen.stats,
                                     self._logprobs(p), calls)

    def _logprobs(self, p: Prepared) -> dict | None:
        """The target's logprobs of the tokens committed since the last call (all of them, for a whole answer), in
        the request's API shape; None when not asked. Streams send each with the chunk in which it arrived."""
        gen = p.gen
        if p.top_logprobs is None or gen is None:  # (not asked; or, never here, not started)
            return None
        entries = gen.logprobs[p.logprobs_sent:len(gen.tokens)]
        p.logprobs_sent += len(entries)
        if isinstance(p.req, openai_api.CompletionRequest):
            return openai_api.text_logprobs(entries, gen.piece)
        return openai_api.chat_logprobs(entries, gen.piece)

    async def stream(self, p: Prepared) -> AsyncIterator[str]:
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

    async def _sse(self, p: Prepared, first, items) -> AsyncIterator[str]:
        include_usage = bool(p.req.stream_options and p.req.stream_options.include_usage)
        created = int(time.time())
        if isinstance(p.req, openai_api.CompletionRequest):
            cid = openai_api.completion_id("cmpl")

            def delta(text=None, finish=None, stats=None):
                return openai_api.text_chunk(cid, p.model, created, text or "", finish, stats,
                                             None if stats else self._logprobs(p))
            opening = delta(p.echo) if p.echo else None
        else:
            cid = openai_api.completion_id()
            calls = tool_calls.ToolCallStream() if p.req.template_tools() else None

            def delta(text=None, finish=None, stats=None):
                return openai_api.chunk(cid, p.model, created, None if stats else {"content": text} if text else {},
                                        finish, stats, None if stats else self._logprobs(p))
            opening = openai_api.chunk(cid, p.model, created, {"role": "assistant", "content": ""})
            if calls is not None:  # content and complete tool calls, split as text arrives
                delta = self._tool_deltas(calls, delta, lambda d, f=None: openai_api.chunk(cid, p.model, created, d, f))

        def data(obj, at: "Delta | None" = None) -> str:
            # a text delta's event id is "forward:drafted:accepted": the verify forward that committed it, and the
            # generation's drafted and accepted tokens counted up to that forward (SSE ids are ignored by OpenAI
            # clients; the chat page shows speculation round by round with them)
            head = f"id: {at.forward}:{at.drafted}:{at.accepted}\n" if at is not None else ""
            return f"{head}data: {json.dumps(obj)}\n\n"

        async def all_items():
            yield first
            async for item in items:
                yield item

        if opening:
            yield data(opening)
        try:
            async for item in all_items():
                if isinstance(item, tuple):
                    gen = item[1]
                    for chunk in _many(delta(finish=gen.finish_reason or "stop")):
                        yield data(chunk)
                    if include_usage:
                        yield data(delta(stats=gen.stats))
                else:
                    for chunk in _many(delta(item)):
                        yield data(chunk, item if isinstance(item, Delta) else None)
        except Exception as e:
            err = api_error(e, self.config.retry_after_s)
            metrics.ERRORS.labels(err.code or str(err.status)).inc()
            yield data(openai_api.error(err.message, err.type, err.param, err.code))
        yield "data: [DONE]\n\n"


    @staticmethod
    def _tool_deltas(calls: "tool_calls.ToolCallStream", plain, chunk):
        """Wrap a chat delta builder so text goes through the tool-call splitter: content deltas, then one
        ``tool_calls`` delta per complete call; the finish reason is "tool_calls" when the model called any."""
        def delta(text=None, finish=None, stats=None):
            if stats is not None:
                return plain(stats=stats)
            parts = calls.push(text or "") if finish is None else calls.finish()
            out = []
            for part in parts:
                if isinstance(part, str):
                    out.append(plain(part))
                else:
                    out.append(chunk({"tool_calls": [part.wire(calls.calls.index(part))]}))
            if finish is not None:
                out.append(plain(finish="tool_calls" if calls.calls and finish == "stop" else finish))
            return out
        return delta


class Delta(str):
    """A text delta, with the number of the verify forward that committed its tokens and the generation's drafted
    and accepted tokens up to that forward."""
    forward: int
    drafted: int
    accepted: int


def _deltas(gen) -> Iterator[str]:
    """``gen``'s text deltas as ``Delta``s, counted on the generation's own thread (so the counts are those of the
    forward that committed them, not a later one); closing this closes the generation."""
    try:
        for text in gen:
            d = Delta(text)
            d.forward, d.drafted, d.accepted = gen.stats.rounds, gen.stats.drafted_nodes, gen.stats.accepted_tokens
            yield d
    finally:
        gen.cancel()


def _many(chunks) -> list:
    return chunks if isinstance(chunks, list) else [chunks]
