"""Edge client: the thin transport around the round loop (edge/rounds.py), and the SDK's entry point.

    gen = EdgeClient(drafter, "127.0.0.1:50051").chat([{"role": "user", "content": "hi"}], max_new_tokens=64)
    for text in gen:
        print(text, end="")
    print(gen.stats.summary())

Three things run at once during a generation: the verifier stream (edge/transport.py: a reader thread puts every
message on one event queue), the drafter (edge/drafter_worker.py: a worker thread runs its jobs in order, results
onto the same queue), and this generator, which feeds events to the round loop, carries out its actions and yields
text as tokens commit. The committed token history lives here (the source of truth); the verifier's verdicts are
checked against it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from contextlib import aclosing
from pathlib import Path
from typing import Generator, Iterator, Literal, Sequence

import grpc

from tandem.core import auth, tracing, wire
from tandem.core.chat_template import ChatTemplate, TemplateError
from tandem.core.messages import AdapterInfo, Constraint, Limits, OpenRequest, TokenLogprobs
from tandem.core.sampling import Sampling
from tandem.core.tree import TreeShape
from tandem.protos import verifier_pb2 as pb
from tandem.protos import verifier_pb2_grpc as pb_grpc

from .actions import Emit, Job, SendClose, SendDraft, SendOpen
from .adapters import DrafterAdapters
from .bridge import aiter_thread
from .drafter import Drafter
from .drafter_worker import DrafterWorker, Event, hand_over, wait_idle
from .extra_ids import ExtraIds
from .generation_stats import GenerationStats
from .ngram import NgramDrafter
from .planner import FixedPlanner, Planner
from .rounds import ProtocolError, RoundLoop
from .text import TextStream
from .transport import RemoteError, SessionStream, target_tokenizer_file, verifier_health

log = logging.getLogger("tandem.edge.client")

__all__ = ["AsyncEdgeClient", "EdgeClient", "Generation", "GenerationStats", "RemoteError", "health", "wait_idle"]


class Generation:
    """Iterate for text chunks; afterwards ``tokens``, ``text``, ``finish_reason`` and ``stats`` are final."""

    def __init__(self, client: "EdgeClient", prompt: Sequence[int], max_new_tokens: int, sampling: Sampling,
                 stop: Sequence[str], planner: Planner, top_logprobs: int | None = None,
                 constraint: Constraint | None = None, cache_salt: str = "", withhold_from_teacher: bool = False):
        self._client = client
        self.cache_salt = cache_salt
        self.withhold_from_teacher = withhold_from_teacher
        self.prompt = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.top_logprobs = top_logprobs
        self.constraint = constraint
        self.logprobs: list[TokenLogprobs] = []  # the target's, one per committed token (when asked)
        self.text = ""
        self.finish_reason: str | None = None  # "stop" (EOS or stop string) | "length"
        self._loop = RoundLoop(prompt, max_new_tokens, planner,
                               Limits(max_new_tokens, client.max_tree_nodes, client.max_tree_depth),
                               ngram=client.ngram, speculate=client.proactive and hasattr(client.drafter,
                                                                                         "speculate"))
        self._stream = TextStream(stop)
        # the target's ids past the drafter's: named by every Opened, known from this client's earlier generations
        self._extra: ExtraIds | None = client._extra
        self._trace_parent = tracing.current_context()  # the caller's trace: this generation's span hangs below
        self._planner = planner
        self._iter = self._generate()

    @property
    def tokens(self) -> list[int]:
        return self._loop.generated

    @property
    def stats(self) -> GenerationStats:
        return self._loop.stats

    def __iter__(self) -> Iterator[str]:
        return self._iter

    def __next__(self) -> str:
        return next(self._iter)

    def piece(self, token: int) -> bytes:
        """What a committed (or logprob alternative) token id renders as, including the target's ids past the
        drafter's vocabulary (``edge.extra_ids``)."""
        tokenizer = self._client.drafter.tokenizer
        return tokenizer.piece(token) if self._extra is None else self._extra.piece(tokenizer, token)

    def cancel(self) -> None:
        """Stop generating and close the verifier session now (tokens so far stay in ``tokens``/``text``)."""
        self._iter.close()

    close = cancel

    def result(self) -> "Generation":
        for _ in self:
            pass
        return self

    def _generate(self) -> Generator[str, None, None]:
        client = self._client
        if not client._busy.acquire(blocking=False):
            raise RuntimeError("this EdgeClient is already generating: its drafter mirrors one session at a "
                               "time; use one client per concurrent conversation")
        t_start = time.perf_counter()
        if client.adapters is not None:  # (a swap first waits for the last generation's last job to end)
            try:
                client.adapters.before_generation(self.cache_salt, lambda: wait_idle(client.drafter))
            except BaseException:
                client._busy.release()
                raise
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        worker, tracked = self._start_worker(events)
        span = tracing.start_span("tandem.generate", self._trace_parent, "client",
                                  {"tandem.prompt_tokens": len(self.prompt), "tandem.max_new_tokens":
                                   self.max_new_tokens, "tandem.verifier": client.address})
        metadata = client._metadata + tracing.inject(span)  # the verifier's spans join this trace
        try:
            self._planner.new_request(self.cache_salt)  # what it learns of a text stays with its partition
            if client.ngram is not None:
                client.ngram.start(self.prompt, self.cache_salt)
            yield from self._sessions(worker, events, metadata)
            if client.ngram is not None:  # sessions with a pinned seed keep their output out of shared caches
                client.ngram.finish(share=self.sampling.seed is None)
        except BaseException as e:
            if not isinstance(e, GeneratorExit):  # closed early by its consumer: not an error
                span.record_exception(e)
            raise
        finally:
            worker.close()
            if not tracked:
                worker.join()
            self._finish_stats(time.perf_counter() - t_start, span)
            client._busy.release()

    def _start_worker(self, events: queue.SimpleQueue[Event]) -> tuple[DrafterWorker, bool]:
        """This generation's drafter thread, started once the last generation's last job has let go of the drafter;
        and whether that hand-over is tracked (else this generation waits for its own last job at its end)."""
        client = self._client
        worker = DrafterWorker(client.drafter, events)
        try:
            previous, tracked = hand_over(client.drafter, worker), True
        except TypeError:  # an untrackable drafter: this generation waits for its own last job at the end
            previous, tracked = None, False
        # the drafter's kept cells, like every cache, serve only the partition that filled them (core.tenancy)
        worker.start(after=previous, forget=client._partition != self.cache_salt)
        client._partition = self.cache_salt
        return worker, tracked

    def _sessions(self, worker: DrafterWorker, events: queue.SimpleQueue[Event],
                  metadata: Sequence[tuple[str, str]]) -> Iterator[str]:
        """Session streams until the generation ends: a new one on the committed history each time the verifier
        becomes unavailable (up to ``max_resumes``, with exponential backoff)."""
        client, loop = self._client, self._loop
        conn = 0
        while True:
            conn += 1
            transport = SessionStream(client._stub, metadata, client.timeout_s, events, conn)
            try:
                yield from self._connection(transport, worker, events)
                return
            except grpc.RpcError as e:
                # UNAVAILABLE: the replica (or the link) is gone. The committed history lives here, so a new
                # session re-prefills it on a live replica and generation continues where it stopped.
                if e.code() != grpc.StatusCode.UNAVAILABLE or loop.stats.resumes >= client.max_resumes:
                    raise RemoteError(e.code(), e.details()) from None
                loop.stats.resumes += 1
                log.warning("verifier unavailable (%s); resuming at %d committed tokens (attempt %d)",
                            e.details(), len(loop.committed), loop.stats.resumes)
                self._execute(loop.on_connection_lost(), transport, worker, "")
                time.sleep(client.backoff_s * 2 ** (loop.stats.resumes - 1))
            finally:
                transport.close()

    def _finish_stats(self, wall_s: float, span: tracing.Span) -> None:
        """The generation's last statistics (its wall time, the policy's last decision), onto its span too."""
        st = self._loop.stats
        st.wall_s = wall_s
        explain = getattr(self._planner, "last_decision", None)
        st.policy = explain() if explain is not None else {}
        span.set_attributes({"tandem.generated_tokens": st.generated_tokens, "tandem.tau": round(st.tau, 3),
                             "tandem.verify_forwards": st.rounds, "tandem.resumes": st.resumes,
                             "tandem.finish_reason": self.finish_reason or "cancelled"})
        span.end()

    def _connection(self, transport: SessionStream, worker: DrafterWorker,
                    events: queue.SimpleQueue[Event]) -> Iterator[str]:
        """One session stream, opened on the committed history so far; yields text until generation ends."""
        loop, sid = self._loop, ""
        pending = list(loop.begin(time.perf_counter()))
        while True:
            for action in pending:
                if isinstance(action, Emit):
                    for tok in action.tokens:
                        if chunk := self._stream.push(self.piece(tok)):
                            self.text += chunk
                            yield chunk
                        if self._stream.stopped:
                            self._execute(loop.on_stop_string(), transport, worker, sid)
                            break
                else:
                    self._execute([action], transport, worker, sid)
            if loop.finish is not None and self.finish_reason is None:
                self.finish_reason = loop.finish
                if tail := self._stream.finish():
                    self.text += tail
                    yield tail
            kind, *event = events.get()
            if kind == "fail":
                raise event[0]
            if kind == "job":
                tag, result, draft_ms, catch_up, t = event
                pending = loop.on_job_done(tag, result, draft_ms, catch_up, t)
                continue
            conn, msg, t = event
            if conn != transport.conn:
                continue  # a late message of a dropped connection
            if kind == "error":
                raise msg
            if kind == "end" or msg.WhichOneof("kind") == "closed":
                if loop.finish is None:
                    raise ProtocolError("the verifier ended the stream before the generation finished")
                return
            which = msg.WhichOneof("kind")
            if which == "opened":
                opened = wire.opened_from_wire(msg.opened)
                sid = opened.session_id
                if opened.extra_pieces:
                    self._extra = self._client.extra_ids(opened.extra_pieces)
                if opened.adapter is not None and self._client.adapters is not None:
                    self._client.adapters.offer(opened.adapter, self.cache_salt)
                pending = loop.on_opened(opened, t)
            elif which == "verdict":
                verdict = wire.verdict_from_wire(msg.verdict)
                self.logprobs.extend(verdict.logprobs)
                pending = loop.on_verdict(verdict, t)
            else:
                raise ProtocolError(f"unexpected {which!r} message from the verifier")

    def _execute(self, actions, transport: SessionStream, worker: DrafterWorker, sid: str) -> None:
        client = self._client
        for a in actions:
            if isinstance(a, Job):
                worker.submit(a if self._extra is None else self._extra.job(a))
            elif isinstance(a, SendDraft):
                transport.send(wire.draft_to_wire(sid, a.draft))
            elif isinstance(a, SendOpen):
                tok = client.drafter.tokenizer
                transport.send(wire.open_to_wire(OpenRequest(
                    a.prompt, self.sampling, Limits(a.max_new_tokens, client.max_tree_nodes, client.max_tree_depth),
                    tok.n_vocab, tok.vocab_fingerprint, client.target_model, a.decode_steps, self.top_logprobs,
                    a.prior_output, self.constraint, self.cache_salt,
                    withhold_from_teacher=self.withhold_from_teacher, host_draft=a.host_draft)))
            elif isinstance(a, SendClose):
                transport.send(wire.close_to_wire(sid))
                transport.end_requests()
            elif isinstance(a, Emit):
                raise ProtocolError("text is emitted by the generator, not executed")


def health(address: str, timeout_s: float = 5.0, tls_ca: str | None = None) -> pb.HealthResponse:
    """Ask the verifier at ``address`` for its identity and load."""
    with auth.channel(address, tls_ca) as channel:
        return verifier_health(pb_grpc.VerifierStub(channel), timeout_s)


class EdgeClient:
    def __init__(self, drafter: Drafter, address: str, shape: TreeShape | None | str = "policy",
                 timeout_s: float = 600.0, target_model: str = "", max_tree_nodes: int = 64, max_tree_depth: int = 16,
                 max_resumes: int = 3, backoff_s: float = 0.2, policy: Planner | None = None,
                 interceptors: Sequence[grpc.StreamStreamClientInterceptor] = (), proactive: bool = False,
                 api_key: str | None = None, tls_ca: str | None = None, tls_server_name: str | None = None,
                 ngram: NgramDrafter | None = None, stream: bool = True, chat_template: str | None = None,
                 adapters: bool = True):
        """``shape``: "policy" (the default) lets the draft policy (``edge.policy.DraftPolicy``) choose
        what to draft from measured RTT, costs and acceptance; a ``TreeShape`` is drafted whenever the drafter is
        free, None drafts nothing (cloud-only decoding, streamed). ``stream`` (with a shape): the verifier decodes
        alone between trees (fastest) or waits for each tree (fewest verifier forwards). ``policy``: a planner
        of your own (or a ``DraftPolicy`` with other settings or the ``cloud_cost`` objective); ``interceptors``
        wrap the channel (e.g. an emulated network delay); ``proactive``: draft the next tree while a verdict is
        in flight (both drafter engines). ``api_key``: sent as
        ``authorization: Bearer`` metadata (default: ``core.auth.client_key``, from
        ``$TANDEM_VERIFIER_KEY[_FILE]``); ``tls_ca``: PEM the verifier's
        certificate chains to, "system" for the public roots, "none" for plaintext; by default TLS with the
        system roots off loopback (``core.auth.transport``); ``tls_server_name`` the name in the certificate if it
        is not the address's host. ``ngram``: graft prompt-lookup drafts (edge.ngram) onto every drafted tree.
        ``chat_template``: the Jinja template conversations are rendered with; by default the verifier's (its
        target's, from Health, fetched once), else the drafter model's own. ``adapters``: fetch the drafter
        adapters the verifier distils for a partition and draft that partition's generations with them
        (``edge.adapters``; drafters that take adapters only).

        One generation at a time per client: the drafter mirrors one session. Use one client per concurrent
        conversation (``orchestrator.gateway.drafter_pool`` keeps a pool of them)."""
        self.drafter = drafter
        self.proactive = proactive
        self.max_resumes = max_resumes
        self.backoff_s = backoff_s
        self.address = address
        if policy is None and shape == "policy":
            from tandem.edge.policy import DraftPolicy
            policy = DraftPolicy()
        if isinstance(shape, str) and shape != "policy":
            raise ValueError(f"shape must be a TreeShape, None or 'policy', got {shape!r}")
        self.policy = policy
        self.planner: Planner = policy or FixedPlanner(shape if isinstance(shape, TreeShape) else None, stream)
        self.timeout_s = timeout_s
        self.target_model = target_model
        self.ngram = ngram
        self.max_tree_nodes = max(max_tree_nodes, shape.n if isinstance(shape, TreeShape) else 0)
        self.max_tree_depth = max(max_tree_depth, shape.d if isinstance(shape, TreeShape) else 0)
        if api_key is None:
            api_key = auth.client_key()
        self._metadata = ((auth.HEADER, f"Bearer {api_key}"),) if api_key else ()
        self._channel = grpc.intercept_channel(auth.channel(address, tls_ca, tls_server_name), *interceptors)
        self._stub = pb_grpc.VerifierStub(self._channel)
        self._busy = threading.Lock()
        # the conversations' template: None until the verifier's is fetched, False when there is none
        self._chat: ChatTemplate | Literal[False] | None = ChatTemplate(chat_template) if chat_template else None
        self._partition = ""  # the cache salt of this client's last generation (whose cells the drafter kept)
        self._extra: ExtraIds | None = None
        self.adapters = DrafterAdapters(drafter, self._fetch_adapter) \
            if adapters and DrafterAdapters.supported(drafter) else None

    def extra_ids(self, pieces: Sequence[bytes]) -> ExtraIds:
        """The target's ids past the drafter's vocabulary, as the verifier rendered them (kept across
        generations: a target's are the same at every Open)."""
        if self._extra is None or self._extra.pieces != tuple(pieces):
            self._extra = ExtraIds(self.drafter.tokenizer, pieces)
        return self._extra

    def close(self) -> None:
        wait_idle(self.drafter)  # a last drafter job may still run: let it end before the drafter goes
        self._channel.close()

    def __enter__(self) -> "EdgeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def health(self, timeout_s: float = 5.0) -> pb.HealthResponse:
        return verifier_health(self._stub, timeout_s, self._metadata)

    def target_tokenizer(self, timeout_s: float = 120.0):
        """The target's tokenizer (a ``core.llama_runtime.LlamaModel`` of its vocabulary, or a
        ``core.hf_tokenizer.HfTokenizer``), fetched from the verifier once and cached under its vocabulary
        fingerprint, which the loaded file must have."""
        return self.target_tokenizer_file(timeout_s)[1]

    def target_tokenizer_file(self, timeout_s: float = 120.0) -> tuple[Path, object]:
        """The target's tokenizer file (a vocabulary-only GGUF or a ``tokenizer.json``, ``translate.SUFFIX``) in
        this client's cache, and the tokenizer loaded from it (see ``target_tokenizer``)."""
        return target_tokenizer_file(self._stub, self._metadata, self.health(), timeout_s)

    def _fetch_adapter(self, info: AdapterInfo, cache_salt: str) -> bytes:
        chunks = self._stub.DrafterAdapter(pb.AdapterRequest(sha256=info.sha256, cache_salt=cache_salt),
                                           timeout=self.timeout_s, metadata=self._metadata)
        return b"".join(c.data for c in chunks)

    def pair_with_target(self) -> str:
        """Match the drafter to the verifier's target, once, before generating: "native" (the same vocabulary),
        "padded" (the target's extends the drafter's; the verifier checks it at every Open), or "translated": the
        target's tokenizer differs, so the drafter is wrapped to draft in the target's ids (``edge.translate``)."""
        from .translate import TranslatingDrafter
        own = self.drafter.tokenizer
        if self.health().vocab_fingerprint in ("", own.vocab_fingerprint):
            return "native"
        target = self.target_tokenizer()
        if own.n_vocab <= target.n_vocab and target.vocab_fingerprint_of(own.n_vocab) == own.vocab_fingerprint:
            return "padded"
        wait_idle(self.drafter)
        self.drafter = TranslatingDrafter(self.drafter, target)
        return "translated"

    def generate(self, prompt: Sequence[int], max_new_tokens: int = 256, sampling: Sampling = Sampling(),
                 stop: Sequence[str] = (), planner: Planner | None = None,
                 top_logprobs: int | None = None, constraint: Constraint | None = None,
                 cache_salt: str = "", withhold_from_teacher: bool = False) -> Generation:
        """``planner``: this generation's planner (e.g. ``FixedPlanner(TreeShape(...))``); by default the
        client's. ``top_logprobs`` set: ``Generation.logprobs`` gets the target's log-probability of every token
        (with that many alternatives), computed by the verifier from the target's own logits. ``constraint``:
        structured output (``Constraint(json_schema=...)`` or ``Constraint(json_object=True)``), enforced by the
        verifier on the target's distribution. ``cache_salt``: the cache partition (core.tenancy) this generation
        reads and feeds, on the verifier and in this client's own caches (n-grams, the drafter's kept cells);
        empty: the verifier key's. ``withhold_from_teacher``: the verifier keeps nothing of this generation for
        distilling the drafter even if this client's key opted in (a gateway sets it for tenants that did not)."""
        return Generation(self, prompt, max_new_tokens, sampling, stop, planner or self.planner, top_logprobs,
                          constraint, cache_salt, withhold_from_teacher)

    def chat(self, messages: Sequence[dict], stream: bool = False, **kwargs):
        """Answer a conversation (``[{"role": ..., "content": ...}]``, the model's chat template applies).

        ``stream=False``: the finished ``Generation`` (``text``, ``tokens``, ``finish_reason``, ``stats``).
        ``stream=True``: an iterator of text deltas as tokens commit, then, last, the ``GenerationStats``.
        Keyword arguments are ``generate``'s (``max_new_tokens``, ``sampling``, ``stop``, ``planner``)."""
        gen = self.generate(self.prompt_tokens(messages), **kwargs)
        if not stream:
            return gen.result()
        return _with_stats(gen)

    def prompt_tokens(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """A conversation's prompt ids, rendered by the target's chat template (see ``chat_template``) with the
        ``tools`` it may call (OpenAI function definitions); raises ``core.chat_template.TemplateError`` when the
        template refuses the conversation."""
        tok = self.drafter.tokenizer
        if self._chat is None:
            h = self.health()  # once: the target's template, published by the verifier
            self._chat = ChatTemplate(h.chat_template, h.bos_token, h.eos_token) if h.chat_template else False
        if self._chat:
            return tok.tokenize(self._chat.render(messages, tools=tools))
        if tools:
            raise TemplateError("no chat template from the verifier: cannot offer tools")
        return tok.tokenize(tok.chat_prompt(messages))


def _with_stats(gen: Generation) -> Iterator["str | GenerationStats"]:
    yield from gen  # closing this iterator early closes the generation, and with it the verifier session
    yield gen.stats


class AsyncEdgeClient:
    """asyncio face of ``EdgeClient``: the same rounds, run on a worker thread.

        client = AsyncEdgeClient(EdgeClient(drafter, address))
        result = await client.chat(messages)                    # finished Generation
        async for item in client.chat(messages, stream=True):  # text deltas, then GenerationStats
            ...
    Leaving the ``async for`` early (or cancelling the task) closes the verifier session."""

    def __init__(self, client: EdgeClient):
        self.sync = client

    def chat(self, messages: Sequence[dict], stream: bool = False, **kwargs):
        """``stream=False``: a coroutine of the finished ``Generation``; cancelling it closes the verifier session
        at the next token. ``stream=True``: an async iterator of text deltas, then the ``GenerationStats``."""
        if not stream:
            return self._whole(messages, kwargs)
        return self._stream(messages, kwargs)

    async def _start(self, messages, kwargs) -> Generation:
        # the prompt's template may come from the verifier (a Health call the first time): off the event loop
        return self.sync.generate(await asyncio.to_thread(self.sync.prompt_tokens, messages), **kwargs)

    async def _whole(self, messages, kwargs) -> Generation:
        gen = await self._start(messages, kwargs)
        async with aclosing(aiter_thread(gen)) as chunks:  # a cancelled task leaves this: the session closes
            async for _ in chunks:
                pass
        return gen

    async def _stream(self, messages, kwargs):
        gen = await self._start(messages, kwargs)
        async with aclosing(aiter_thread(gen)) as chunks:  # leaving early closes the session at once
            async for chunk in chunks:
                yield chunk
        yield gen.stats

    async def health(self, timeout_s: float = 5.0) -> pb.HealthResponse:
        return await asyncio.to_thread(self.sync.health, timeout_s)

    def close(self) -> None:
        self.sync.close()

    async def __aenter__(self) -> "AsyncEdgeClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.close)  # waits for a drafter job still running: not on the loop
