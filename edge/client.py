"""Edge client: the thin transport around the round loop (edge/rounds.py), and the SDK's entry point.

    gen = EdgeClient(drafter, "127.0.0.1:50051").chat([{"role": "user", "content": "hi"}], max_new_tokens=64)
    for text in gen:
        print(text, end="")
    print(gen.stats.summary())

Three things run at once during a generation: the verifier stream (a reader thread puts every message on one event
queue), the drafter (a worker thread runs its jobs in order, results onto the same queue), and this generator,
which feeds events to the round loop, carries out its actions and yields text as tokens commit. The committed
token history lives here (the source of truth); the verifier's verdicts are checked against it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import weakref
import time
from contextlib import aclosing
from pathlib import Path
from typing import Iterator, Sequence

import grpc

from tandem.core import auth, tracing, wire
from tandem.core.chat_template import ChatTemplate, TemplateError
from tandem.core.errors import TandemError
from tandem.core.messages import AdapterInfo, Constraint, Limits, OpenRequest, TokenLogprobs
from tandem.core.sampling import Sampling
from tandem.core.tree import TreeShape
from tandem.core.vocab import is_fingerprint
from tandem.protos import verifier_pb2 as pb
from tandem.protos import verifier_pb2_grpc as pb_grpc

from .adapters import DrafterAdapters
from .bridge import aiter_thread
from .drafter import Drafter
from .extra_ids import ExtraIds
from .ngram import NgramDrafter
from .planner import FixedPlanner, Planner
from .rounds import (NO_TREE, Emit, GenerationStats, Job, ProtocolError, RoundLoop, SendClose, SendDraft,
                     SendOpen)
from .text import TextStream

log = logging.getLogger("tandem.edge.client")

__all__ = ["AsyncEdgeClient", "EdgeClient", "Generation", "GenerationStats", "RemoteError", "health"]


class RemoteError(TandemError, RuntimeError):
    """The verifier refused a request or could not be reached; ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"verifier: {code.name}: {details}")
        self.code = code
        self.details = details


class _DrafterWorker:
    """Runs drafter jobs one at a time on its own thread; each job's outcome goes onto the event queue as
    ("job", tag, result, draft_ms, (caught-up tokens, ms), time).

    A generation does not wait for its worker's last job when it ends (a tree or a long catch-up still running
    when the last verdict arrives would hold the answer back for nothing): the worker finishes that one job on its
    own and drops the rest. The drafter's next worker waits for it (``after``) before touching the drafter, on its
    own thread, so the next generation's Open and the tokens the verifier decodes alone are not held up either;
    ``wait_idle(drafter)`` waits for it before using a drafter outside an ``EdgeClient``."""

    def __init__(self, drafter: Drafter, events: queue.SimpleQueue):
        self.drafter, self.events = drafter, events
        self._after: _DrafterWorker | None = None
        self._forget = False
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="drafter", daemon=True)
        self._started = threading.Event()

    def start(self, after: "_DrafterWorker | None" = None, forget: bool = False) -> None:
        """``forget``: drop the cells the drafter kept from earlier sessions before the first job (they belong to
        another cache partition)."""
        self._after, self._forget = after, forget
        self._thread.start()
        self._started.set()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """No more jobs: queued ones are dropped (their generation is over), the one in progress finishes (the
        drafter is never left mid-operation), then the thread ends."""
        try:
            while True:
                self._jobs.get_nowait()
        except queue.Empty:
            pass
        self._jobs.put(None)

    def join(self) -> None:
        self._started.wait()  # registered before it started: a waiter may come that early
        self._thread.join()

    def _loop(self) -> None:
        if self._after is not None:  # the previous generation's last job still owns the drafter
            self._after.join()
            self._after = None
        if self._forget:
            try:
                self.drafter.start([])
            except BaseException as e:
                self.events.put(("fail", e))
                return
        while (job := self._jobs.get()) is not None:
            try:
                result, draft_ms, catch_up = self._run(job)
                self.events.put(("job", job.tag, result, draft_ms, catch_up, time.perf_counter()))
            except BaseException as e:  # a drafter failure ends the generation with that error
                self.events.put(("fail", e))

    def _run(self, job: Job):
        d, result, draft_ms, catch_up = self.drafter, None, 0.0, (0, 0.0)
        for op, *args in job.ops:
            t0 = time.perf_counter()
            if op in ("catch_up", "draft"):
                pending = d.pending()
                d.catch_up()
                t1 = time.perf_counter()
                catch_up = (pending, (t1 - t0) * 1000)
                if op == "draft":
                    result = d.draft(args[0])
                    draft_ms = (time.perf_counter() - t1) * 1000
            elif op == "start":
                d.start(args[0])
            elif op == "extend":
                d.commit(NO_TREE, (), args[0])
            elif op == "commit":
                d.commit(*args)
            elif op == "speculate":
                result = d.speculate(*args)
                draft_ms = (time.perf_counter() - t0) * 1000
            elif op == "adopt":
                result = d.adopt()
            else:
                raise ValueError(f"unknown drafter operation {op!r}")
        return result, draft_ms, catch_up


# the last worker of each drafter, whose final job may still run after its generation ended
_LAST_WORKER: "weakref.WeakKeyDictionary[object, _DrafterWorker]" = weakref.WeakKeyDictionary()
_LAST_WORKER_LOCK = threading.Lock()


def _hand_over(drafter: Drafter, worker: _DrafterWorker) -> "_DrafterWorker | None":
    """Record ``worker`` as the drafter's current one; returns the previous one (to wait for), or raises
    TypeError for a drafter that cannot be tracked (no weak references): then generations join at their end."""
    with _LAST_WORKER_LOCK:
        previous = _LAST_WORKER.get(drafter)
        _LAST_WORKER[drafter] = worker
    return previous


def wait_idle(drafter: Drafter) -> None:
    """Wait until no finished generation's last job still uses ``drafter`` (before using it directly)."""
    with _LAST_WORKER_LOCK:
        try:
            worker = _LAST_WORKER.get(drafter)
        except TypeError:
            return
    if worker is not None:
        worker.join()


class _Transport:
    """One session stream; every response (or the stream's end or error) goes onto the event queue tagged with
    this connection's number, so a dropped connection's late messages are recognised."""

    def __init__(self, stub: pb_grpc.VerifierStub, metadata, timeout_s: float, events: queue.SimpleQueue,
                 conn: int):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call = stub.Session(iter(self._requests.get, None), timeout=timeout_s, metadata=metadata)
        self._events, self.conn = events, conn
        threading.Thread(target=self._read, name="verifier-stream", daemon=True).start()

    def send(self, msg: pb.SessionRequest) -> None:
        self._requests.put(msg)

    def end_requests(self) -> None:
        self._requests.put(None)

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()

    def _read(self) -> None:
        try:
            for msg in self._call:
                self._events.put(("msg", self.conn, msg, time.perf_counter()))
            self._events.put(("end", self.conn, None, time.perf_counter()))
        except grpc.RpcError as e:
            self._events.put(("error", self.conn, e, time.perf_counter()))


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

    def _generate(self) -> Iterator[str]:
        client, loop = self._client, self._loop
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
        events: queue.SimpleQueue = queue.SimpleQueue()
        worker = _DrafterWorker(client.drafter, events)
        try:
            previous, tracked = _hand_over(client.drafter, worker), True
        except TypeError:  # an untrackable drafter: this generation waits for its own last job at the end
            previous, tracked = None, False
        # the drafter's kept cells, like every cache, serve only the partition that filled them (core.tenancy)
        worker.start(after=previous, forget=client._partition != self.cache_salt)
        client._partition = self.cache_salt
        span = tracing.start_span("tandem.generate", self._trace_parent, "client",
                                  {"tandem.prompt_tokens": len(self.prompt), "tandem.max_new_tokens":
                                   self.max_new_tokens, "tandem.verifier": client.address})
        metadata = client._metadata + tracing.inject(span)  # the verifier's spans join this trace
        try:
            self._planner.new_request(self.cache_salt)  # what it learns of a text stays with its partition
            if client.ngram is not None:
                client.ngram.start(self.prompt, self.cache_salt)
            conn = 0
            while True:
                conn += 1
                transport = _Transport(client._stub, metadata, client.timeout_s, events, conn)
                try:
                    yield from self._connection(transport, worker, events)
                    break
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
            loop.stats.wall_s = time.perf_counter() - t_start
            explain = getattr(self._planner, "last_decision", None)
            loop.stats.policy = explain() if explain is not None else {}
            st = loop.stats
            span.set_attributes({"tandem.generated_tokens": st.generated_tokens, "tandem.tau": round(st.tau, 3),
                                 "tandem.verify_forwards": st.rounds, "tandem.resumes": st.resumes,
                                 "tandem.finish_reason": self.finish_reason or "cancelled"})
            span.end()
            client._busy.release()

    def _connection(self, transport: _Transport, worker: _DrafterWorker, events: queue.SimpleQueue) -> Iterator[str]:
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

    def _execute(self, actions, transport: _Transport, worker: _DrafterWorker, sid: str) -> None:
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
                    withhold_from_teacher=self.withhold_from_teacher)))
            elif isinstance(a, SendClose):
                transport.send(wire.close_to_wire(sid))
                transport.end_requests()
            elif isinstance(a, Emit):
                raise ProtocolError("text is emitted by the generator, not executed")


def _health(stub: pb_grpc.VerifierStub, timeout_s: float, metadata=()) -> pb.HealthResponse:
    try:
        return stub.Health(pb.HealthRequest(), timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as e:
        raise RemoteError(e.code(), e.details()) from None


def health(address: str, timeout_s: float = 5.0, tls_ca: str | None = None) -> pb.HealthResponse:
    """Ask the verifier at ``address`` for its identity and load."""
    with auth.channel(address, tls_ca) as channel:
        return _health(pb_grpc.VerifierStub(channel), timeout_s)


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
        self._chat: ChatTemplate | bool | None = ChatTemplate(chat_template) if chat_template else None
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
        return _health(self._stub, timeout_s, self._metadata)

    def target_tokenizer(self, timeout_s: float = 120.0):
        """The target's tokenizer (a ``core.llama_runtime.LlamaModel`` of its vocabulary, or a
        ``core.hf_tokenizer.HfTokenizer``), fetched from the verifier once and cached under its vocabulary
        fingerprint, which the loaded file must have."""
        return self.target_tokenizer_file(timeout_s)[1]

    def target_tokenizer_file(self, timeout_s: float = 120.0) -> tuple[Path, object]:
        """The target's tokenizer file (a vocabulary-only GGUF or a ``tokenizer.json``, ``translate.SUFFIX``) in
        this client's cache, and the tokenizer loaded from it (see ``target_tokenizer``)."""
        from .translate import SUFFIX, load_tokenizer, tokenizer_cache
        h = self.health()
        if not h.vocab_fingerprint:
            raise RemoteError(grpc.StatusCode.FAILED_PRECONDITION, "the verifier publishes no vocabulary fingerprint")
        if not is_fingerprint(h.vocab_fingerprint):  # (it names a file here: nothing else may)
            raise RemoteError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"the verifier publishes a vocabulary fingerprint that is not a sha256 (64 lowercase "
                              f"hex digits): {h.vocab_fingerprint[:80]!r}")
        cached = [p for p in (tokenizer_cache(h.vocab_fingerprint, k) for k in SUFFIX) if p.is_file()]
        if cached:
            path = cached[0]
        else:
            try:
                chunks = list(self._stub.Tokenizer(pb.TokenizerRequest(), timeout=timeout_s, metadata=self._metadata))
            except grpc.RpcError as e:
                raise RemoteError(e.code(), e.details()) from None
            kind = chunks[0].format if chunks else ""
            if kind not in SUFFIX:
                raise RemoteError(grpc.StatusCode.UNIMPLEMENTED, f"the verifier's tokenizer comes as {kind!r}, which "
                                                                 f"this client cannot load")
            path = tokenizer_cache(h.vocab_fingerprint, kind)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(b"".join(c.data for c in chunks))
            tmp.replace(path)
        tokenizer = load_tokenizer(path, h.vocab_size)
        if tokenizer.vocab_fingerprint != h.vocab_fingerprint:
            path.unlink(missing_ok=True)
            raise RemoteError(grpc.StatusCode.DATA_LOSS, "the verifier's tokenizer file does not have the vocabulary "
                                                         "fingerprint it publishes")
        return path, tokenizer

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
