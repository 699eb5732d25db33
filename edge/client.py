"""Edge client: runs the round loop (draft -> verify over gRPC -> commit) and streams text as it is committed.

    gen = EdgeClient(drafter, "127.0.0.1:50051").chat([{"role": "user", "content": "hi"}], max_new_tokens=64)
    for text in gen:
        print(text, end="")
    print(gen.stats.summary())

The first tree rides on the Open message (prompt prefill and first verification in one call). The committed token
history lives here (the source of truth); the verifier's verdicts are checked against it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import grpc

from cloud.acceptance import Sampling
from cloud.tree import DraftTree
from orchestrator import auth
from orchestrator.policy import DraftPolicy, Round
from protos import verifier_pb2 as pb
from protos import verifier_pb2_grpc as pb_grpc

from .drafter import Drafter
from .drafting import BuiltTree, TreeShape, first_choice_path, graft, subtree
from .ngram import NgramDrafter
from .text import TextStream

log = logging.getLogger("tandem.edge.client")


class RemoteError(RuntimeError):
    """The verifier refused a request or could not be reached; ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"verifier: {code.name}: {details}")
        self.code = code
        self.details = details


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0  # verify forwards on the target
    drafted_nodes: int = 0
    accepted_tokens: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)  # rounds accepting a node at depth d (index d-1)
    reached_by_depth: list[int] = field(default_factory=list)  # rounds whose tree reached depth d with d-1 accepted
    draft_us: int = 0
    verify_us: int = 0
    queue_us: int = 0
    network_us: int = 0  # round time minus the verifier's own time: RTT + (de)serialisation
    prefill_us: int = 0
    resumes: int = 0  # sessions re-opened on the committed history after the verifier became unavailable
    proactive_hits: int = 0  # rounds whose next tree was drafted while the verdict was in flight, and held
    speculate_us: int = 0  # drafting done while waiting for verdicts
    ngram_nodes: int = 0  # nodes grafted from n-gram matches (edge.ngram)
    ngram_accepted: int = 0  # ... and accepted
    wall_s: float = 0.0

    def record_round(self, tree_depth: int, n_nodes: int, n_accepted: int) -> None:
        self.rounds += 1
        self.drafted_nodes += n_nodes
        self.accepted_tokens += n_accepted
        while len(self.accepted_by_depth) < tree_depth:
            self.accepted_by_depth.append(0)
            self.reached_by_depth.append(0)
        for d in range(1, tree_depth + 1):
            if n_accepted >= d - 1:
                self.reached_by_depth[d - 1] += 1
            if n_accepted >= d:
                self.accepted_by_depth[d - 1] += 1

    @property
    def tau(self) -> float:
        """Committed tokens per verify forward."""
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def alpha_by_depth(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_by_depth, self.reached_by_depth)]

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    def summary(self) -> str:
        return (f"{self.generated_tokens} tokens, tau {self.tau:.2f}, {self.tokens_per_s:.1f} tokens/s "
                f"({self.rounds} verify forwards, {self.accepted_tokens}/{self.drafted_nodes} drafted accepted)")


@dataclass(frozen=True)
class _InFlight:
    """The tree on the wire and how it maps onto the drafter's own tree (they differ after a proactive hit: then
    the wire carries the subtree below the bonus node, which was committed already)."""
    book: BuiltTree  # the drafter's tree, what commit() takes
    sent: DraftTree
    to_book: tuple[int, ...]  # sent node -> book node
    prefix: tuple[int, ...] = ()  # book nodes committed above the sent root
    prefix_tokens: tuple[int, ...] = ()


class Generation:
    """Iterate for text chunks; afterwards ``tokens``, ``text``, ``finish_reason`` and ``stats`` are final."""

    def __init__(self, client: "EdgeClient", prompt: Sequence[int], max_new_tokens: int, sampling: Sampling,
                 stop: Sequence[str], shape: TreeShape):
        self._client = client
        self.prompt = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.shape = shape
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # "stop" (EOS or stop string) | "length"
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self._stream = TextStream(stop)
        self._flight: _InFlight | None = None  # the tree in flight
        self._round_draft_us = 0
        self._run = 0  # verdicts still due from the decode run in flight (0: not a run)
        self._drafter_behind = len(self.prompt)  # committed tokens the drafter has not evaluated
        self._iter = self._generate()

    def __iter__(self) -> Iterator[str]:
        return self._iter

    def __next__(self) -> str:
        return next(self._iter)

    def cancel(self) -> None:
        """Stop generating and close the verifier session now (tokens so far stay in ``tokens``/``text``)."""
        self._iter.close()

    close = cancel

    def result(self) -> "Generation":
        for _ in self:
            pass
        return self

    def _generate(self) -> Iterator[str]:
        client = self._client
        if not client._busy.acquire(blocking=False):
            raise RuntimeError("this EdgeClient is already generating: its drafter mirrors one session at a "
                               "time; use one client per concurrent conversation")
        t_start = time.perf_counter()
        try:
            client.drafter.start(self.prompt)
            if client.ngram is not None:
                client.ngram.start(self.prompt)
            while True:
                try:
                    yield from self._connection()
                    if client.ngram is not None:
                        client.ngram.finish()
                    return
                except grpc.RpcError as e:
                    # UNAVAILABLE: the replica (or the link) is gone. The committed history lives here, so a new
                    # session re-prefills it on a live replica and generation continues where it stopped.
                    if e.code() != grpc.StatusCode.UNAVAILABLE or self.stats.resumes >= client.max_resumes:
                        raise RemoteError(e.code(), e.details()) from None
                    self.stats.resumes += 1
                    log.warning("verifier unavailable (%s); resuming at %d committed tokens (attempt %d)",
                                e.details(), len(self.prompt) + len(self.tokens), self.stats.resumes)
                    # drop the tree in flight; keep what was committed above it (the bonus after a proactive hit)
                    f = self._flight
                    client.drafter.commit(f.book, list(f.prefix), list(f.prefix_tokens))
                    time.sleep(client.backoff_s * 2 ** (self.stats.resumes - 1))
        finally:
            self.stats.wall_s = time.perf_counter() - t_start
            client._busy.release()

    def _shape(self) -> TreeShape | None:
        policy = self._client.policy
        return policy.choose(self._drafter_behind) if policy else self.shape

    def _decode_steps(self) -> int:
        """Length of a decode run (a round without drafting): until the policy's next probe, or the client's."""
        policy = self._client.policy
        steps = policy.decode_steps if policy else self._client.decode_steps
        return max(1, min(steps, self.max_new_tokens - len(self.tokens)))

    def _draft(self, limit_nodes: int, limit_depth: int) -> _InFlight:
        """This round's tree: the policy's shape (or the fixed one) within the granted limits; empty = no draft."""
        shape = self._shape()
        if shape is not None:  # tokens the drafter has not seen (prompt, decode run) are not this tree's cost
            t0 = time.perf_counter_ns()
            self._client.drafter.catch_up()
            if self._client.policy is not None:
                self._client.policy.observe_catch_up(self._drafter_behind, (time.perf_counter_ns() - t0) / 1e6)
            self._drafter_behind = 0
        t0 = time.perf_counter_ns()
        self._run = 0
        if shape is None:  # no drafting: the verifier decodes a run of tokens and streams them back
            built = BuiltTree(DraftTree(), (), ())
            self._run = self._decode_steps()
        else:
            built = self._client.drafter.draft(TreeShape(shape.k, min(shape.n, limit_nodes),
                                                         min(shape.d, limit_depth)))
        self._round_draft_us = (time.perf_counter_ns() - t0) // 1000
        self.stats.draft_us += self._round_draft_us
        sent, added = built.tree, 0
        if shape is not None and self._client.ngram is not None:  # a free branch from repeated spans
            sent, added = graft(built.tree, self._client.ngram.propose(limit_depth), limit_nodes, limit_depth)
            self.stats.ngram_nodes += added
        self._flight = _InFlight(built, sent, tuple(range(len(built.tree))) + (-1,) * added)
        return self._flight

    def _speculate(self, flight: _InFlight, limit_nodes: int, limit_depth: int):
        """Proactive drafting: while the verdict is on its way, draft the next tree assuming the drafter's first
        choices are all accepted. One level deeper, so that its subtree under the guessed bonus token has the
        planned depth. Returns (assumed path in the drafter's tree, speculative tree) or None."""
        policy = self._client.policy
        shape = policy.peek(self._drafter_behind) if policy else self.shape  # the next round decides for real
        if not self._client.proactive or shape is None or not len(flight.sent) or \
                not hasattr(self._client.drafter, "speculate"):  # an engine without speculative drafting
            return None
        path = list(flight.prefix) + _book_nodes(flight, first_choice_path(flight.sent))
        t0 = time.perf_counter_ns()
        spec = self._client.drafter.speculate(flight.book, path, TreeShape(
            shape.k, min(shape.n, limit_nodes) + 1, min(shape.d, limit_depth) + 1))
        self.stats.speculate_us += (time.perf_counter_ns() - t0) // 1000
        return (path, spec) if spec is not None and spec.tree.children[0] else None

    def _connection(self) -> Iterator[str]:
        """One session stream, opened on the committed history so far; yields text until generation ends."""
        client, drafter = self._client, self._client.drafter
        history = self.prompt + self.tokens
        requests: queue.SimpleQueue = queue.SimpleQueue()
        responses = client._stub.Session(iter(requests.get, None), timeout=client.timeout_s,
                                         metadata=client._metadata)
        try:
            flight = self._draft(client.max_tree_nodes, client.max_tree_depth)
            committed_len = len(history)
            requests.put(pb.SessionRequest(open=pb.Open(
                target_model=client.target_model, vocab_size=drafter.tokenizer.n_vocab,
                vocab_fingerprint=drafter.tokenizer.vocab_fingerprint,
                sampling=pb.SamplingParams(temperature=self.sampling.temperature, top_k=self.sampling.top_k,
                                           top_p=self.sampling.top_p, seed=self.sampling.seed),
                prompt_tokens=history,
                limits=pb.Limits(max_new_tokens=self.max_new_tokens - len(self.tokens),
                                 max_tree_nodes=client.max_tree_nodes, max_tree_depth=client.max_tree_depth),
                first_draft=_draft_to_wire("", committed_len, flight.sent, self._run))))
            t_round = time.perf_counter_ns()
            spec = self._speculate(flight, client.max_tree_nodes, client.max_tree_depth)
            opened = _next(responses, "opened")
            sid = opened.session_id
            self.stats.prefill_us += opened.prefill_us
            verdict = opened.first_verdict
            first_round = True  # it also waited for the prompt prefill, on both sides
            streamed = False  # a later verdict of a decode run
            limits = opened.limits
            while True:
                self._account(verdict, flight.sent, t_round, opened.prefill_us if first_round else 0, first_round,
                              streamed)
                first_round = False
                accepted = list(verdict.accepted)
                new = [flight.sent.tokens[i] for i in accepted] + ([verdict.bonus_token]
                                                                   if verdict.bonus_token >= 0 else [])
                committed_len += len(new)
                if verdict.committed_len != committed_len:
                    raise RuntimeError(f"verifier reports committed length {verdict.committed_len}, the edge "
                                       f"has {committed_len}: protocol violation")
                self.stats.ngram_accepted += sum(1 for i in accepted if flight.to_book[i] < 0)
                for tok in new:
                    self.tokens.append(tok)
                    if client.ngram is not None:
                        client.ngram.extend((tok,))
                    if chunk := self._stream.push(drafter.tokenizer.piece(tok)):
                        self.text += chunk
                        yield chunk
                    if self._stream.stopped:
                        break
                self.stats.generated_tokens = len(self.tokens)
                if self._stream.stopped or verdict.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    self.finish_reason = ("length" if verdict.finish_reason == pb.FINISH_REASON_LENGTH
                                          and not self._stream.stopped else "stop")
                    break
                book_path = list(flight.prefix) + _book_nodes(flight, accepted)
                streamed = self._run > 1
                if not len(flight.sent):
                    self._drafter_behind += len(new)
                if streamed:  # the decode run goes on: its next verdict is already on its way
                    self._run -= 1
                    drafter.commit(flight.book, [], new)
                    t_round = time.perf_counter_ns()
                    verdict = _next(responses, "verdict")
                    continue
                if spec is not None and book_path == spec[0] and \
                        verdict.bonus_token == spec[1].tree.tokens[spec[1].tree.children[0][0]]:
                    # the guess held: the speculative tree's subtree under the bonus goes out right away
                    self.stats.proactive_hits += 1
                    book = drafter.adopt()
                    bonus_node = book.tree.children[0][0]
                    sent, to_book = subtree(book.tree, bonus_node)
                    flight = self._flight = _InFlight(book, sent, to_book, (bonus_node,), (verdict.bonus_token,))
                    self._round_draft_us = 0
                else:
                    drafter.commit(flight.book, book_path, list(flight.prefix_tokens) + new)
                    flight = self._draft(limits.max_tree_nodes, limits.max_tree_depth)
                t_round = time.perf_counter_ns()
                requests.put(pb.SessionRequest(draft=_draft_to_wire(sid, committed_len, flight.sent, self._run)))
                spec = self._speculate(flight, limits.max_tree_nodes, limits.max_tree_depth)
                verdict = _next(responses, "verdict")
            if tail := self._stream.finish():
                self.text += tail
                yield tail
            try:  # generation is complete; a failing close loses nothing
                requests.put(pb.SessionRequest(close=pb.Close(session_id=sid)))
                requests.put(None)
                _next(responses, "closed")
            except (grpc.RpcError, RuntimeError) as e:
                log.info("close of session %s failed: %s", sid, e)
        finally:
            requests.put(None)
            responses.cancel()

    def _account(self, verdict: pb.Verdict, tree: DraftTree, t_round_ns: int, server_extra_us: int,
                 first_round: bool, streamed: bool) -> None:
        round_us = (time.perf_counter_ns() - t_round_ns) // 1000
        self.stats.verify_us += verdict.verify_us
        self.stats.queue_us += verdict.queue_us
        self.stats.network_us += max(0, round_us - verdict.verify_us - verdict.queue_us - server_extra_us)
        self.stats.record_round(tree.depth, len(tree), len(verdict.accepted))
        if self._client.policy is not None:
            # the first round of a connection also prefilled the prompt on the verifier: that time is not a round's
            chain = 0  # leading accepted nodes that were the drafter's first choice under their parent
            for node in verdict.accepted:
                if tree.children[tree.parents[node] + 1][0] != node:
                    break
                chain += 1
            # the drafter's own width (a grafted n-gram branch is not the drafter's work)
            width = max((len(c) for c in self._flight.book.tree.children), default=0)
            self._client.policy.observe(Round(
                width=width, depth=tree.depth, nodes=len(tree), accepted=len(verdict.accepted),
                chain_accepted=chain, draft_ms=self._round_draft_us / 1000,
                verify_ms=(verdict.verify_us + verdict.queue_us) / 1000,
                round_ms=max(0, round_us - server_extra_us) / 1000, streamed=streamed))


def _book_nodes(flight: _InFlight, sent_path: Sequence[int]) -> list[int]:
    """A path of sent nodes as the drafter's nodes, up to the first grafted (n-gram) node the drafter never saw."""
    out = []
    for i in sent_path:
        if flight.to_book[i] < 0:
            break
        out.append(flight.to_book[i])
    return out


def _draft_to_wire(sid: str, committed_len: int, tree: DraftTree, decode_steps: int = 0) -> pb.Draft:
    return pb.Draft(session_id=sid, committed_len=committed_len, decode_steps=decode_steps if not len(tree) else 0,
                    tree=pb.DraftTree(tokens=tree.tokens, parents=tree.parents))


def _next(responses, kind: str):
    msg = next(responses, None)
    if msg is None or msg.WhichOneof("kind") != kind:
        raise RuntimeError(f"verifier ended the stream or answered {msg and msg.WhichOneof('kind')!r} where "
                           f"{kind!r} was due")
    return getattr(msg, kind)


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
    def __init__(self, drafter: Drafter, address: str, shape: TreeShape | None = TreeShape(),
                 timeout_s: float = 600.0, target_model: str = "", max_tree_nodes: int = 64, max_tree_depth: int = 16,
                 max_resumes: int = 3, backoff_s: float = 0.2, policy: "DraftPolicy | None" = None,
                 interceptors: Sequence[grpc.StreamStreamClientInterceptor] = (), proactive: bool = False,
                 decode_steps: int = 1 << 20, api_key: str | None = None, tls_ca: str | None = None,
                 tls_server_name: str | None = None, ngram: "NgramDrafter | None" = None):
        """``shape``: the fixed tree of every round, or None for no drafting (cloud-only decoding, streamed back in
        runs of ``decode_steps`` tokens; the default is the whole generation in one run). ``policy``: choose each
        round's tree from measured RTT, costs and acceptance (orchestrator.policy) instead; ``interceptors`` wrap
        the channel (e.g. an emulated network delay); ``proactive``: draft the next tree while a verdict is in
        flight (hides the round trip when guesses hold). ``api_key``: sent as ``authorization: Bearer`` metadata
        (default ``$TANDEM_API_KEY``); ``tls_ca``: PEM the verifier's certificate chains to (TLS when set), and
        ``tls_server_name`` the name in that certificate if it is not the address's host.

        ``ngram``: graft prompt-lookup drafts (edge.ngram) onto every drafted tree, free repeated spans.

        One generation at a time per client: the drafter mirrors one session. Use one client per concurrent
        conversation (``orchestrator.gateway`` keeps a pool of them)."""
        self.drafter = drafter
        self.proactive = proactive
        self.policy = policy
        self.max_resumes = max_resumes
        self.backoff_s = backoff_s
        self.address = address
        self.shape = shape
        self.timeout_s = timeout_s
        self.target_model = target_model
        self.decode_steps = decode_steps
        self.ngram = ngram
        self.max_tree_nodes = max(max_tree_nodes, shape.n if shape else 0)
        self.max_tree_depth = max(max_tree_depth, shape.d if shape else 0)
        api_key = api_key if api_key is not None else os.environ.get("TANDEM_API_KEY", "")
        self._metadata = ((auth.HEADER, f"Bearer {api_key}"),) if api_key else ()
        self._channel = grpc.intercept_channel(auth.channel(address, tls_ca, tls_server_name), *interceptors)
        self._stub = pb_grpc.VerifierStub(self._channel)
        self._busy = threading.Lock()

    def close(self) -> None:
        self._channel.close()

    def health(self, timeout_s: float = 5.0) -> pb.HealthResponse:
        return _health(self._stub, timeout_s, self._metadata)

    def generate(self, prompt: Sequence[int], max_new_tokens: int = 256, sampling: Sampling = Sampling(),
                 stop: Sequence[str] = (), shape: TreeShape | None | str = "client") -> Generation:
        """``shape``: this generation's fixed tree, None for no drafting; by default the client's."""
        return Generation(self, prompt, max_new_tokens, sampling, stop, self.shape if shape == "client" else shape)

    def chat(self, messages: Sequence[dict], stream: bool = False, **kwargs):
        """Answer a conversation (``[{"role": ..., "content": ...}]``, the model's chat template applies).

        ``stream=False``: the finished ``Generation`` (``text``, ``tokens``, ``finish_reason``, ``stats``).
        ``stream=True``: an iterator of text deltas as tokens commit, then, last, the ``GenerationStats``.
        Keyword arguments are ``generate``'s (``max_new_tokens``, ``sampling``, ``stop``, ``shape``)."""
        gen = self.generate(self.prompt_tokens(messages), **kwargs)
        if not stream:
            return gen.result()
        return _with_stats(gen)

    def prompt_tokens(self, messages: Sequence[dict]) -> list[int]:
        tok = self.drafter.tokenizer
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
        if not stream:
            return asyncio.to_thread(self.sync.chat, messages, **kwargs)
        return self._stream(messages, kwargs)

    async def _stream(self, messages, kwargs):
        gen = await asyncio.to_thread(self.sync.generate, self.sync.prompt_tokens(messages), **kwargs)
        it = iter(gen)
        try:
            while True:
                chunk = await asyncio.to_thread(next, it, None)
                if chunk is None:
                    break
                yield chunk
        finally:
            await asyncio.to_thread(gen.cancel)
        yield gen.stats

    async def health(self, timeout_s: float = 5.0) -> pb.HealthResponse:
        return await asyncio.to_thread(self.sync.health, timeout_s)

    def close(self) -> None:
        self.sync.close()
