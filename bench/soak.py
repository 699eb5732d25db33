"""Soak: mixed chat + code traffic through the REST gateway and the SDK for a set time, with clients that
disconnect and clients that send bad input; nothing may leak, grow or fail in an undocumented way.

    python -m bench.soak --duration 1800 --sessions 16 --json bench/out/soak.json        # the full soak
    python -m bench.soak --duration 40 --sessions 4 --max-tokens 8 --limit 2              # CI smoke

One ``tandem serve`` process (verifier + gateway, real model pair, API keys on) serves ``--sessions`` concurrent
clients: most speak REST through the official ``openai`` client, each with its own key; the rest (``--sdk``) are
SDK clients (``EdgeClient``, drafting on their own llama.cpp drafter over gRPC). Each request is, by a seeded draw,
a good one (streamed or not, temperature 0, HumanEval or ShareGPT), a disconnect (the client walks away after the
first tokens) or a bad one (no key, wrong key, oversized body, broken JSON, unknown model, invalid fields, a
prompt over the context, a stop string over the cap, a second concurrent request on a key allowed one; for the
SDK: token ids outside the vocabulary, a wrong verifier key, a malformed tree on a raw stream).

After the load, a cross-tenant probe: for ``--probes`` prompts, each opened by a system message no other request
carries, one API key sends the prompt (its conversation is cached when it ends), a second key sends the same prompt,
a third the prompt with a guessed continuation (the probes that recovered a secret token by token before caches
were partitioned), and the first key sends it again. The second and third keys must learn nothing
(``usage.prompt_tokens_details.cached_tokens`` 0: each sends one request per prompt, so its own cache cannot
explain a hit); the first key's repeat must hit its own cache (so the zero means partitioned, not an empty cache).
Then devices probe the same prompt: fresh edge tokens minted from the first key itself open sessions over the
gateway's WebSocket, on the prompt, on the prompt with the guess, and (a second token) on the prompt a first token
has just opened; a token in a partition of its own must read ``cached_tokens`` and ``prefill_us`` 0 in its
``Opened``. A token granted its subject's shared cache is told of the cache, so its 0 on the first key's prompt is
the partition itself; a second token of that subject must hit the first's entry, and the first key, over REST, its
own once the devices are done (so the devices' zeros are not an empty cache or a blind channel). Last, a keyless
caller on the verifier's gRPC port: Tokenizer, Session (an Open on the first probe's prompt) and DrafterAdapter,
with no ``authorization`` metadata, with a REST key, and with an edge token, must each end UNAUTHENTICATED (a REST
key or a token never opens the verifier); Health is open by design and must carry none of the probes' prompts.

Reported: p50/p99 of request latency and time to first token per time window; RSS of every process over time;
verifier sessions, engine KV blocks and gateway generations open at the end; outcomes by status; the probes'
findings (``cross_tenant``, the devices' under its ``device_probes``; ``keyless_verifier``). Exits 1 when a
request got an undocumented answer (a 500, a wrong status for a bad input, an error on a good request that is not
backpressure: 429/503 with Retry-After), when anything is still open after the load stops, when the server's RSS
grew more than ``--rss-growth-mb`` between the end of the warm-up and the end, when the probe learnt anything
across keys, when a device learnt anything of its own key's prompts (or the device probe's controls never hit), or
when the verifier answered a call without a verifier key (Health aside).
"""
from __future__ import annotations

import argparse
import os
import queue
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import httpx
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tandem.core import lifetime, logs
from tandem.core.sampling import Sampling
from tandem.orchestrator import models
from tandem.orchestrator.datasets import humaneval, humaneval_messages, sharegpt
from tandem.protos import verifier_pb2 as pb
from tandem.protos import verifier_pb2_grpc as pb_grpc

from .output import finish

VERIFIER_KEY = "soak-verifier-key"
BACKPRESSURE = {429, 503}


def _progress(msg: str) -> None:
    print(f"[bench.soak] {msg}", file=sys.stderr, flush=True)


@dataclass
class Event:
    t_s: float  # since the load started
    client: str  # rest | sdk
    action: str  # good | disconnect | bad:<case>
    status: str  # HTTP status or gRPC code name
    expected: bool  # a documented answer for this action
    latency_s: float
    ttft_s: float | None = None
    tokens: int = 0
    detail: str = ""  # what an undocumented answer said


# -- the stack -----------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """``tandem serve`` in a child process: verifier on gRPC, gateway on REST, verifier metrics on their own
    port. Dies with this process."""

    def __init__(self, args, rest_keys: list[str]):
        self.grpc_port, self.http_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self.address = f"127.0.0.1:{self.grpc_port}"
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.key = rest_keys[0]
        env = dict(os.environ, TANDEM_API_KEYS=",".join(rest_keys), TANDEM_VERIFIER_KEYS=VERIFIER_KEY,
                   TANDEM_VERIFIER_KEY=VERIFIER_KEY)
        cmd = [sys.executable, "-m", "tandem.orchestrator.cli", "serve", "--target", args.target, "--drafter",
               args.drafter, "--grpc-port", str(self.grpc_port), "--port", str(self.http_port), "--metrics-port",
               str(self.metrics_port), "--threads", "1", "--drafter-threads", "1", "--n-ctx", str(args.n_ctx),
               "--gateway-drafters", str(args.gateway_drafters), "--max-sessions", str(args.max_sessions),
               "--key-concurrency", "1", "--public-metrics"]
        self.proc = lifetime.spawn(cmd, env=env, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.proc.returncode} during start-up")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError("tandem serve was not ready within 600 s")

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9

    def gauges(self) -> dict[str, float]:
        """Open verifier sessions, engine KV blocks and gateway generations, from the two /metrics."""
        want = ("tandem_verifier_sessions", "tandem_verifier_kv_sequences", "tandem_gateway_sessions")
        out: dict[str, float] = {}
        for url in (f"http://127.0.0.1:{self.metrics_port}/metrics", self.url + "/metrics"):
            for line in httpx.get(url, timeout=5).text.splitlines():
                name, _, value = line.partition(" ")
                if name in want:
                    out[name] = float(value)
        return out


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        mod = argv[argv.index(b"-m") + 1].decode() if b"-m" in argv else Path(argv[0].decode()).name
        return f"{mod.rsplit('.', 1)[-1]}[{pid}]"
    except (OSError, ValueError, IndexError):
        return str(pid)


# -- clients -------------------------------------------------------------------------------------------------------
class Load:
    def __init__(self, args, stack: Stack, chats: list[tuple[str, list[dict]]], rest_keys: list[str]):
        self.args, self.stack, self.chats, self.rest_keys = args, stack, chats, rest_keys
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.duration
        self.events: list[Event] = []
        self.outputs: dict[tuple, tuple] = {}  # (prompt index, client) -> first greedy output
        self.mismatches = 0
        self.mismatch_examples: list[dict] = []
        self._lock = threading.Lock()

    def record(self, e: Event) -> None:
        with self._lock:
            self.events.append(e)

    def greedy(self, key: tuple, out: tuple) -> None:
        """Temperature 0: every answer to the same prompt should be the first one (a batch of other sessions can
        move a near-tie, so this is reported, not failed)."""
        with self._lock:
            first = self.outputs.setdefault(key, out)
            if first != out:
                self.mismatches += 1
                self.mismatch_examples.append({"prompt": key[0], "client": key[1], "first": first, "now": out})

    def now(self) -> float:
        return time.monotonic() - self.t0

    def choose(self, rng: random.Random) -> str:
        r = rng.random()
        if r < self.args.bad_fraction:
            return "bad"
        return "disconnect" if r < self.args.bad_fraction + self.args.disconnect_fraction else "good"

    # REST -------------------------------------------------------------------------------------------------------
    def rest_worker(self, i: int) -> None:
        from openai import APIStatusError, OpenAI
        rng = random.Random(self.args.seed * 1000 + i)
        key = self.rest_keys[i]
        client = OpenAI(base_url=self.stack.url + "/v1", api_key=key, max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        while time.monotonic() < self.deadline:
            p = rng.randrange(len(self.chats))
            action = self.choose(rng)
            t = time.monotonic()
            if action == "bad":
                case, status, ok = self.rest_bad(rng, key, model, self.chats[p][1])
                self.record(Event(self.now(), "rest", f"bad:{case}", str(status), ok, time.monotonic() - t))
                continue
            stream = action == "disconnect" or rng.random() < 0.5
            try:
                kw = dict(model=model, messages=self.chats[p][1], max_tokens=self.args.max_tokens, temperature=0)
                ttft, text = None, ""
                if stream:
                    s = client.chat.completions.create(stream=True, **kw)
                    chunks = 0
                    for chunk in s:
                        if chunk.choices and chunk.choices[0].delta.content:
                            ttft = ttft if ttft is not None else time.monotonic() - t
                            text += chunk.choices[0].delta.content
                            chunks += 1
                        if action == "disconnect" and chunks >= 2:
                            break
                    s.close()
                else:
                    r = client.chat.completions.create(**kw)
                    text = r.choices[0].message.content or ""
                if action == "good":
                    self.greedy((p, "rest"), (text,))
                self.record(Event(self.now(), "rest", action, "200", True, time.monotonic() - t, ttft,
                                  len(text)))
            except APIStatusError as e:
                retry = e.response.headers.get("retry-after")
                ok = e.status_code in BACKPRESSURE and retry is not None
                self.record(Event(self.now(), "rest", action, str(e.status_code), ok, time.monotonic() - t,
                                  detail="" if ok else str(e)[:300]))
                if ok and retry is not None:
                    time.sleep(min(float(retry), 5.0) * rng.uniform(0.2, 1.0))
            except Exception as e:  # a transport failure is an undocumented answer
                self.record(Event(self.now(), "rest", action, type(e).__name__, False, time.monotonic() - t,
                                  detail=str(e)[:300]))

    def rest_bad(self, rng: random.Random, key: str, model: str, messages: list[dict]) -> tuple[str, int, bool]:
        url = self.stack.url + "/v1/chat/completions"
        auth = {"Authorization": f"Bearer {key}"}
        body = {"model": model, "messages": messages, "max_tokens": 4}
        cases = {
            "no_key": (lambda: httpx.post(url, json=body), {401}),
            "wrong_key": (lambda: httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}), {401}),
            "huge_body": (lambda: httpx.post(url, content=b"x" * (2 << 20), headers=auth), {413}),
            "broken_json": (lambda: httpx.post(url, content=b'{"model": ', headers={**auth, "Content-Type":
                                                                                   "application/json"}), {400}),
            "unknown_model": (lambda: httpx.post(url, json={**body, "model": "nope"}, headers=auth), {404}),
            "bad_field": (lambda: httpx.post(url, json={**body, "max_tokens": -3}, headers=auth), {400}),
            "no_messages": (lambda: httpx.post(url, json={**body, "messages": []}, headers=auth), {400}),
            "long_stop": (lambda: httpx.post(url, json={**body, "stop": "x" * 4000}, headers=auth), {400}),
            "over_context": (lambda: httpx.post(url, json={**body, "messages": [
                {"role": "user", "content": "word " * (self.args.n_ctx * 2)}]}, headers=auth), {400}),
            "second_on_key": (lambda: self._second_on_key(url, auth, body), {429}),
        }
        case = rng.choice(sorted(cases))
        send, expected = cases[case]
        try:
            r = send()
        except httpx.HTTPError:
            return case, 0, False
        ok = r.status_code in expected or (r.status_code in BACKPRESSURE and "retry-after" in r.headers)
        if r.status_code in expected and r.status_code >= 400:
            ok = ok and "error" in r.json()  # OpenAI-shaped
        return case, r.status_code, ok

    def _second_on_key(self, url, auth, body) -> httpx.Response:
        """Two requests at once on a key allowed one: the second is 429 while the first streams.

        The first must be admitted before the second is sent: the gateway (all drafters busy) or the key (this
        client's last request, a disconnect noticed a little later) can still refuse it, and then the second could
        be admitted. It retries after each Retry-After a few times; if it never gets in, its answer is the result."""
        for attempt in range(5):
            admitted: queue.SimpleQueue = queue.SimpleQueue()
            done = threading.Event()
            th = threading.Thread(target=self._hold, args=(url, auth, body, admitted, done), daemon=True)
            th.start()
            refused = admitted.get(timeout=600)
            try:
                if refused is None:
                    return httpx.post(url, json=body, headers=auth, timeout=600)
            finally:
                done.set()
                th.join(600)
            if isinstance(refused, Exception):
                raise refused
            if refused.status_code not in BACKPRESSURE or attempt == 4:
                return refused
            time.sleep(min(float(refused.headers.get("retry-after", 1)), 5.0))
        raise AssertionError("unreachable")

    @staticmethod
    def _hold(url, auth, body, admitted: queue.SimpleQueue, done: threading.Event) -> None:
        """Stream a request until ``done``; put None on ``admitted`` once it streams, else its refusal."""
        try:
            with httpx.stream("POST", url, json={**body, "stream": True, "max_tokens": 8}, headers=auth,
                              timeout=600) as r:
                if r.status_code != 200:
                    r.read()
                    admitted.put(r)
                    return
                for _ in r.iter_lines():
                    admitted.put(None)  # the key is held until this stream ends
                    if done.is_set():
                        break
        except httpx.HTTPError as e:
            admitted.put(e)
        finally:
            admitted.put(None)

    # SDK --------------------------------------------------------------------------------------------------------
    def sdk_worker(self, i: int) -> None:
        from tandem.edge.client import EdgeClient, RemoteError
        from tandem.edge.drafter import load_drafter
        from tandem.edge.policy import DraftPolicy
        rng = random.Random(self.args.seed * 1000 + 500 + i)
        drafter = load_drafter("llama.cpp", model_path=self.args.drafter, n_ctx=self.args.n_ctx, n_threads=1)
        client = EdgeClient(drafter, self.stack.address, policy=DraftPolicy(), api_key=VERIFIER_KEY, max_resumes=3)
        greedy = Sampling(temperature=0.0)
        while time.monotonic() < self.deadline:
            p = rng.randrange(len(self.chats))
            action = self.choose(rng)
            t = time.monotonic()
            if action == "bad":
                case, status, ok = self.sdk_bad(rng)
                self.record(Event(self.now(), "sdk", f"bad:{case}", status, ok, time.monotonic() - t))
                continue
            try:
                gen = client.generate(client.prompt_tokens(self.chats[p][1]), max_new_tokens=self.args.max_tokens,
                                      sampling=greedy)
                ttft = None
                for n, _ in enumerate(gen):
                    ttft = ttft if ttft is not None else time.monotonic() - t
                    if action == "disconnect" and n >= 1:
                        gen.cancel()
                        break
                if action == "good":
                    self.greedy((p, "sdk"), tuple(gen.tokens))
                self.record(Event(self.now(), "sdk", action, "OK", True, time.monotonic() - t, ttft,
                                  len(gen.tokens)))
            except RemoteError as e:
                ok = e.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
                self.record(Event(self.now(), "sdk", action, e.code.name, ok, time.monotonic() - t,
                                  detail="" if ok else str(e)[:300]))
                if ok:
                    time.sleep(rng.uniform(0.2, 1.0))
            except Exception as e:
                self.record(Event(self.now(), "sdk", action, type(e).__name__, False, time.monotonic() - t,
                                  detail=str(e)[:300]))
        client.close()

    def sdk_bad(self, rng: random.Random) -> tuple[str, str, bool]:
        """Bad input on raw gRPC streams (the SDK would refuse some of it before sending)."""
        ok_open = pb.Open(prompt_tokens=[1, 2, 3], limits=pb.Limits(max_new_tokens=4))
        cases = {
            "token_ids": (pb.Open(prompt_tokens=[1, 2, 10 ** 7], limits=pb.Limits(max_new_tokens=4)), None,
                          VERIFIER_KEY, {"INVALID_ARGUMENT"}),
            "wrong_key": (ok_open, None, "nope", {"UNAUTHENTICATED"}),
            "malformed_tree": (ok_open, pb.DraftTree(tokens=[5, 6, 7], parents=[1, 2, 0]), VERIFIER_KEY,
                               {"INVALID_ARGUMENT"}),
            "oversized_tree": (ok_open, pb.DraftTree(tokens=[5] * 5000, parents=list(range(-1, 4999))),
                               VERIFIER_KEY, {"INVALID_ARGUMENT"}),
            "draft_before_open": (None, pb.DraftTree(tokens=[5], parents=[-1]), VERIFIER_KEY,
                                  {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND"}),
        }
        case = rng.choice(sorted(cases))
        open_msg, tree, key, expected = cases[case]
        code = self._raw(open_msg, tree, key)
        return case, code, code in expected or code == "RESOURCE_EXHAUSTED"

    def _raw(self, open_msg, tree, key: str) -> str:
        """Open (if given), then one Draft with ``tree`` (if given) once opened; the code the stream ends with."""
        with grpc.insecure_channel(self.stack.address) as ch:
            reqs: queue.SimpleQueue = queue.SimpleQueue()
            if open_msg is not None:
                reqs.put(pb.SessionRequest(open=open_msg))
            else:
                reqs.put(pb.SessionRequest(draft=pb.Draft(session_id="nope", committed_len=3, tree=tree)))
            stream = pb_grpc.VerifierStub(ch).Session(iter(reqs.get, None), timeout=120,
                                                      metadata=(("authorization", f"Bearer {key}"),))
            try:
                for r in stream:
                    if r.WhichOneof("kind") == "opened":
                        if tree is None:
                            reqs.put(pb.SessionRequest(close=pb.Close(session_id=r.opened.session_id)))
                        else:
                            reqs.put(pb.SessionRequest(draft=pb.Draft(session_id=r.opened.session_id,
                                                                      committed_len=3, tree=tree)))
                    elif r.WhichOneof("kind") == "closed":
                        break
                return "OK"
            except grpc.RpcError as e:
                return e.code().name
            finally:
                reqs.put(None)


# -- the cross-tenant probe ----------------------------------------------------------------------------------------
def victim(i: int, chat: list[dict], run: str) -> list[dict]:
    """Probe ``i``'s prompt: ``chat`` opened by a system message no other request carries (it names ``run``)."""
    return [{"role": "system", "content": f"Probe {i} of {run}."}, *chat]


def probe_tenants(stack: Stack, device: "Device", chats: list[tuple[str, list[dict]]], owner: str, prober: str,
                  guesser: str, n: int, run: str) -> dict:
    """What a second key, and devices holding tokens of the first key (``device``), learn of the first key's
    prompts through the prompt cache (see the module docstring)."""
    url, model = stack.url + "/v1/chat/completions", device.model

    def cached(key: str, messages: list[dict]) -> int:
        for _ in range(20):  # backpressure: wait and retry
            r = httpx.post(url, json={"model": model, "messages": messages, "max_tokens": 1, "temperature": 0},
                           headers={"Authorization": f"Bearer {key}"}, timeout=600)
            if r.status_code in BACKPRESSURE:
                time.sleep(min(float(r.headers.get("retry-after", 1)), 5.0))
                continue
            r.raise_for_status()
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        raise RuntimeError("the probe was refused for backpressure 20 times")

    rows, devices = [], []
    for i, (_, chat) in enumerate(chats[:n]):
        messages = victim(i, chat, run)
        guess = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + " And"}]
        row = {"first": cached(owner, messages)}  # the owner's conversation, kept when it ends
        row["other_key_same_prompt"] = cached(prober, messages)
        row["other_key_guess"] = cached(guesser, guess)
        row["owner_again"] = cached(owner, messages)
        devices.append(probe_devices(device, messages, guess, f"soak-probe-user-{i}-{time.time_ns()}"))
        row["owner_after_devices"] = cached(owner, messages)  # the owner's entry was there while the devices probed
        rows.append(row)
    return {"probes": rows, "leaked": sum(r["other_key_same_prompt"] + r["other_key_guess"] > 0 for r in rows),
            "owner_hits": sum(r["owner_again"] > 0 for r in rows),
            "device_probes": devices, "device_leaked": sum(device_leaked(d) for d in devices),
            "device_control_hits": sum(d["subject_again"]["cached_tokens"] > 0 for d in devices),
            "owner_hits_after_devices": sum(r["owner_after_devices"] > 0 for r in rows)}


class Device:
    """A device of one API key: edge tokens minted from the key, sessions over the gateway's WebSocket."""

    def __init__(self, stack: Stack, key: str):
        self.stack, self.auth = stack, {"Authorization": f"Bearer {key}"}
        self.ws_url = stack.url.replace("http://", "ws://") + "/v1/edge/session"
        self.model = httpx.get(stack.url + "/v1/models", headers=self.auth, timeout=30).json()["data"][0]["id"]
        self.target = httpx.get(stack.url + "/v1/edge/target", headers=self.auth, timeout=30).json()

    def token(self, subject: str | None = None) -> str:
        """A fresh token of the key; with ``subject``, one granted that subject's shared cache."""
        body: dict = {"ttl_s": 600, "max_sessions": 1, "max_new_tokens": 2}
        if subject is not None:
            body.update(subject=subject, share_cache=True)
        r = httpx.post(self.stack.url + "/v1/edge-tokens", json=body, headers=self.auth, timeout=30)
        r.raise_for_status()
        return r.json()["token"]

    def prompt(self, messages: list[dict]) -> list[int]:
        """The target's prompt ids for a conversation, as a device gets them (``/tokenize``)."""
        r = httpx.post(self.stack.url + "/tokenize", json={"model": self.model, "messages": messages},
                       headers=self.auth, timeout=60)
        r.raise_for_status()
        return r.json()["tokens"]

    def opening(self, prompt: list[int]) -> pb.Open:
        return pb.Open(vocab_size=self.target["vocabSize"], vocab_fingerprint=self.target["vocabFingerprint"],
                       prompt_tokens=prompt, limits=pb.Limits(max_new_tokens=2))

    def opened(self, token: str, prompt: list[int]) -> dict:
        """Open on ``prompt``, then Close: what the Opened told the device of the cache. A refusal for backpressure
        (close 4008 RESOURCE_EXHAUSTED, 4014 UNAVAILABLE) waits and retries; an answer that is not an Opened fails
        (its zeros would read as learning nothing)."""
        request = pb.SessionRequest(open=self.opening(prompt)).SerializeToString()
        for _ in range(20):
            try:
                with connect(self.ws_url, subprotocols=["tandem.v1", "bearer." + token], open_timeout=30) as ws:
                    ws.send(request)
                    first = pb.SessionResponse.FromString(ws.recv(timeout=300))
                    if not first.HasField("opened"):
                        raise RuntimeError(f"a device's session answered {first.WhichOneof('kind')}, not opened")
                    ws.send(pb.SessionRequest(close=pb.Close(session_id=first.opened.session_id))
                            .SerializeToString())
                    while not pb.SessionResponse.FromString(ws.recv(timeout=300)).HasField("closed"):
                        pass
                return {"cached_tokens": first.opened.cached_tokens, "prefill_us": first.opened.prefill_us}
            except ConnectionClosed as e:
                if e.rcvd is None or e.rcvd.code not in (4008, 4014):
                    raise
                time.sleep(1.0)
        raise RuntimeError("a device's session was refused for backpressure 20 times")


def probe_devices(device: Device, messages: list[dict], guess: list[dict], subject: str) -> dict:
    """What devices holding tokens of the victim's own key learn of its prompt. Each token is fresh, so its own
    sessions cannot explain a hit. A token of a partition of its own must read ``cached_tokens`` and ``prefill_us``
    0 on the victim's prompt, on the prompt with a guessed continuation, and (a second token) on the prompt a first
    token has just opened. A token granted its subject's shared cache is told of the cache, so its 0 on the
    victim's prompt is the partition itself, not the gateway's zeroing; a second token of that subject then hits
    the first's entry (the control: the device's channel reads a real cache when it may)."""
    prompt, guessed = device.prompt(messages), device.prompt(guess)
    row = {"prompt_tokens": len(prompt), "victim_prompt": device.opened(device.token(), prompt),
           "victim_guess": device.opened(device.token(), guessed)}
    row["second_device"] = device.opened(device.token(), prompt)  # after the first token opened the prompt
    row["subject_first"] = device.opened(device.token(subject), prompt)
    row["subject_again"] = device.opened(device.token(subject), prompt)
    return row


def device_leaked(row: dict) -> bool:
    """Whether a device probe learnt anything: a token of its own partition told anything of the cache, or a
    token of a fresh shared partition told of a hit on the victim's prompt."""
    own = (row["victim_prompt"], row["victim_guess"], row["second_device"])
    return any(o["cached_tokens"] or o["prefill_us"] for o in own) or row["subject_first"]["cached_tokens"] > 0


# -- the keyless verifier caller -----------------------------------------------------------------------------------
def probe_verifier(stack: Stack, opening: pb.Open, credentials: dict[str, str], secrets: list[str]) -> dict:
    """What the verifier's gRPC port answers a caller without a verifier key: no metadata, a REST key, or an edge
    token as ``authorization``. Tokenizer, Session (an Open on the victim's prompt) and DrafterAdapter must each end
    UNAUTHENTICATED; any other end counts as answered. Health is open by design (liveness probes): it answers
    with the target's identity and load, and must carry nothing of any prompt (none of the probes' secrets)."""
    calls = []
    with grpc.insecure_channel(stack.address) as ch:
        stub = pb_grpc.VerifierStub(ch)
        rpcs = {
            "Tokenizer": lambda md: stub.Tokenizer(pb.TokenizerRequest(), timeout=60, metadata=md),
            "Session": lambda md: stub.Session(iter([pb.SessionRequest(open=opening)]), timeout=60, metadata=md),
            "DrafterAdapter": lambda md: stub.DrafterAdapter(pb.AdapterRequest(sha256="0" * 64), timeout=60,
                                                             metadata=md),
        }
        for credential, value in credentials.items():
            metadata = (("authorization", f"Bearer {value}"),) if value else ()
            for rpc, call in rpcs.items():
                code = _ended(call(metadata))
                calls.append({"rpc": rpc, "credential": credential, "code": code,
                              "answered": code != "UNAUTHENTICATED"})
        try:
            text, code = str(stub.Health(pb.HealthRequest(), timeout=60)), "OK"
        except grpc.RpcError as e:
            text, code = "", e.code().name
        calls.append({"rpc": "Health", "credential": "none", "code": code, "answered": code == "OK",
                      "open_by_design": True, "reveals_prompt": any(s in text for s in secrets)})
    refusable = [c for c in calls if c["rpc"] != "Health"]
    return {"calls": calls, "answered": sum(c["answered"] for c in refusable),
            "refused": sum(not c["answered"] for c in refusable),
            "health_reveals_prompt": any(c.get("reveals_prompt") for c in calls)}


def _ended(call) -> str:
    """How a streaming call ends: its status code's name, or OK at its first answer (the call then cancelled)."""
    try:
        for _ in call:
            call.cancel()
            return "OK"
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


# -- the run -------------------------------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def windows(events: list[Event], duration: float, n: int = 10) -> list[dict]:
    width = max(duration / n, 1.0)
    out = []
    for w in range(n):
        lo, hi = w * width, (w + 1) * width
        good = [e for e in events if lo <= e.t_s < hi and e.action == "good" and e.status in ("200", "OK")]
        ttft = [e.ttft_s for e in good if e.ttft_s is not None]
        out.append({"t_s": round(hi, 1), "requests": len(good),
                    "latency_p50_s": percentile([e.latency_s for e in good], 0.5),
                    "latency_p99_s": percentile([e.latency_s for e in good], 0.99),
                    "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99)})
    return out


def sample_rss(stack: Stack, stop: threading.Event, every_s: float, t0: float, series: list[dict]) -> None:
    me = os.getpid()
    while not stop.is_set():
        row = {"t_s": round(time.monotonic() - t0, 1), "bench": round(rss_mb(me), 1)}
        for pid in descendants(stack.proc.pid):
            try:
                row[_name(pid)] = round(rss_mb(pid), 1)
            except OSError:
                pass
        series.append(row)
        stop.wait(every_s)


def plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    w = result["windows"]
    for key, label in (("latency_p50_s", "latency p50"), ("latency_p99_s", "latency p99"),
                       ("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99")):
        pts = [(x["t_s"], x[key]) for x in w if x[key] is not None]
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
    a.set_xlabel("time (s)")
    a.set_ylabel("seconds")
    a.set_title("good requests")
    a.legend()
    a.grid(alpha=0.3)
    names = sorted({k for row in result["rss_mb"] for k in row if k != "t_s"})
    for name in names:
        pts = [(row["t_s"], row[name]) for row in result["rss_mb"] if name in row]
        b.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
    b.set_xlabel("time (s)")
    b.set_ylabel("RSS (MiB)")
    b.set_title("memory by process")
    b.legend(fontsize=7)
    b.grid(alpha=0.3)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def report(result: dict, path: Path) -> None:
    lines = [f"# Soak: {result['sessions']} sessions for {result['duration_s']} s", "",
             f"{result['requests']} requests ({result['good_ok']} good answered, {result['backpressure']} "
             f"backpressure 429/503, {result['bad_inputs']} bad inputs, {result['disconnects']} disconnects); "
             f"undocumented answers: {result['undocumented']}; open at the end: {result['open_at_end']}; server "
             f"RSS growth after warm-up: {result['server_rss_growth_mb']} MiB (bound {result['rss_bound_mb']}).",
             "", "| window end (s) | good requests | latency p50 / p99 (s) | TTFT p50 / p99 (s) |", "|---|---|---|---|"]
    for w in result["windows"]:
        lines.append(f"| {w['t_s']} | {w['requests']} | {w['latency_p50_s']} / {w['latency_p99_s']} | "
                     f"{w['ttft_p50_s']} / {w['ttft_p99_s']} |")
    lines += ["", "| outcome | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(result["outcomes"].items())]
    probe = result.get("cross_tenant")
    if probe:
        lines += ["", "Cross-tenant probe (prompt tokens served from the cache; another key must see 0):", "",
                  "| first (owner) | other key, same prompt | other key, prompt + guess | owner again |",
                  "|---|---|---|---|"]
        lines += [f"| {r['first']} | {r['other_key_same_prompt']} | {r['other_key_guess']} | {r['owner_again']} |"
                  for r in probe["probes"]]
        lines += ["", "Devices holding tokens of the first key (each token fresh; Opened's cached tokens / prefill "
                  "µs; a token of its own partition must see 0 / 0, a token sharing its subject's cache 0 cached on "
                  "the first key's prompt, and the subject's second token hits the first's):", "",
                  "| prompt tokens | token, same prompt | token, prompt + guess | second token, same prompt | "
                  "subject's first token | subject's second token | owner after the devices |",
                  "|---|---|---|---|---|---|---|"]
        cell = "{0[cached_tokens]} / {0[prefill_us]}".format
        lines += [f"| {d['prompt_tokens']} | {cell(d['victim_prompt'])} | {cell(d['victim_guess'])} | "
                  f"{cell(d['second_device'])} | {cell(d['subject_first'])} | {cell(d['subject_again'])} | "
                  f"{r['owner_after_devices']} |" for d, r in zip(probe["device_probes"], probe["probes"])]
    keyless = result.get("keyless_verifier")
    if keyless:
        lines += ["", f"The verifier's gRPC port without a verifier key: {keyless['refused']} calls refused, "
                  f"{keyless['answered']} answered (Health is open by design, and must carry no prompt):", "",
                  "| call | credential | ended | answered |", "|---|---|---|---|"]
        lines += [f"| {c['rpc']} | {c['credential']} | {c['code']} | {'yes' if c['answered'] else 'no'} |"
                  for c in keyless["calls"]]
    if result.get("plot"):
        lines += ["", f"![soak]({Path(result['plot']).name})"]
    path.write_text("\n".join(lines) + "\n")


def probe_problems(probe: dict | None, keyless: dict | None) -> list[str]:
    """What the probes found that fails the soak: a second key, or a device holding a token of the first key,
    learnt anything of the first key's prompts; a probe's controls never hit (its zeros then prove nothing); the
    verifier answered a call without a verifier key (Health aside), or its Health carried a probe's prompt."""
    problems = []
    if probe is not None and probe["leaked"]:
        problems.append(f"another API key was served {probe['leaked']} of the first key's prompts from the cache")
    if probe is not None and not probe["owner_hits"]:
        problems.append("the cross-tenant probe's owner never hit its own cache: the probe proves nothing")
    if probe is not None and probe["device_leaked"]:
        problems.append(f"a device holding a token of the first key learnt of {probe['device_leaked']} of its "
                        f"prompts through Opened (cached_tokens or prefill_us)")
    if probe is not None and not (probe["device_control_hits"] and probe["owner_hits_after_devices"]):
        problems.append("the device probe's controls never hit (a second device of a subject sharing one cache, "
                        "the owner after the devices): the probe proves nothing")
    if keyless is not None and keyless["answered"]:
        seen = ", ".join(f"{c['rpc']} ({c['credential']}) -> {c['code']}" for c in keyless["calls"]
                         if c["answered"] and c["rpc"] != "Health")
        problems.append(f"the verifier answered {keyless['answered']} calls without a verifier key: {seen}")
    if keyless is not None and keyless["health_reveals_prompt"]:
        problems.append("the verifier's open Health carried a probe's prompt")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    ap.add_argument("--sessions", type=int, default=16, help="concurrent clients")
    ap.add_argument("--sdk", type=int, default=None, help="of which SDK clients (default: a quarter, at least 1)")
    ap.add_argument("--limit", type=int, default=8, help="prompts per dataset (HumanEval, ShareGPT)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--bad-fraction", type=float, default=0.15)
    ap.add_argument("--disconnect-fraction", type=float, default=0.1)
    ap.add_argument("--gateway-drafters", type=int, default=4)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--rss-growth-mb", type=float, default=256.0,
                    help="largest allowed growth of the server's RSS from the end of warm-up to the end")
    ap.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling interval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probes", type=int, default=2,
                    help="prompts of the cross-tenant probe after the load (0: none, nor the keyless verifier calls)")
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/soak.md"))
    args = ap.parse_args(argv)
    logs.configure()
    args.target = str(models.resolve(args.target, "target"))
    args.drafter = str(models.resolve(args.drafter, "drafter"))
    n_sdk = args.sdk if args.sdk is not None else max(1, args.sessions // 4)
    n_rest = max(0, args.sessions - n_sdk)
    args.max_sessions = args.gateway_drafters + n_sdk + 2
    chats = [("humaneval", humaneval_messages(p)) for p in humaneval(args.limit)] + \
            [("sharegpt", c) for c in sharegpt(args.limit)]
    rest_keys = [f"soak-key-{i}" for i in range(max(1, n_rest))]
    probe_keys = ["soak-probe-owner", "soak-probe-other", "soak-probe-guess"]  # never used by the load
    _progress(f"starting the stack ({n_rest} REST + {n_sdk} SDK clients, {args.duration:.0f} s)")
    stack = Stack(args, rest_keys + probe_keys)
    load = Load(args, stack, chats, rest_keys)
    rss: list[dict] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(stack, stop, args.sample_s, load.t0, rss), daemon=True)
    sampler.start()
    try:
        workers = [threading.Thread(target=load.rest_worker, args=(i,), daemon=True) for i in range(n_rest)]
        workers += [threading.Thread(target=load.sdk_worker, args=(i,), daemon=True) for i in range(n_sdk)]
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            time.sleep(min(30.0, args.duration / 4))
            done = len(load.events)
            _progress(f"{load.now():.0f} s: {done} requests, "
                      f"{sum(not e.expected for e in load.events)} undocumented")
        for w in workers:
            w.join()
        probe = keyless = None
        if args.probes:
            _progress(f"cross-tenant probe on {args.probes} prompts, then keyless verifier calls")
            run, device = f"soak run {os.getpid()}-{time.time_ns()}", Device(stack, probe_keys[0])
            probe = probe_tenants(stack, device, chats, *probe_keys, args.probes, run)
            keyless = probe_verifier(stack, device.opening(device.prompt(victim(0, chats[0][1], run))),
                                     {"none": "", "rest_key": probe_keys[1], "edge_token": device.token()}, [run])
        # everything the clients opened must be closed soon after they stop
        deadline, gauges = time.monotonic() + 30, {}
        while time.monotonic() < deadline:
            gauges = stack.gauges()
            if not any(gauges.values()):
                break
            time.sleep(1)
    finally:
        stop.set()
        sampler.join()
        status = stack.stop()
    events = load.events
    server = [row for row in rss if any(k.startswith("cli[") for k in row)]
    growth = None
    if server:
        key = next(k for k in server[0] if k.startswith("cli["))
        warm = [r[key] for r in server if r["t_s"] >= 0.2 * args.duration]
        tail = [r[key] for r in server if r["t_s"] >= 0.8 * args.duration]
        growth = round(max(tail) - warm[0], 1) if warm and tail else None
    outcomes = Counter(f"{e.client} {e.action} -> {e.status}" for e in events)
    undocumented = [asdict(e) for e in events if not e.expected]
    good_ok = sum(e.action == "good" and e.status in ("200", "OK") for e in events)
    result = {
        "duration_s": args.duration, "sessions": args.sessions, "rest_clients": n_rest, "sdk_clients": n_sdk,
        "requests": len(events), "good_ok": good_ok,
        "backpressure": sum(e.status in ("429", "503", "RESOURCE_EXHAUSTED", "UNAVAILABLE") and e.expected
                            and not e.action.startswith("bad") for e in events),
        "bad_inputs": sum(e.action.startswith("bad") for e in events),
        "disconnects": sum(e.action == "disconnect" for e in events),
        "bad_cases": sorted({e.action[4:] for e in events if e.action.startswith("bad")}),
        "undocumented": len(undocumented), "undocumented_examples": undocumented[:10],
        "open_at_end": gauges, "greedy_mismatches": load.mismatches,
        "greedy_mismatch_examples": load.mismatch_examples[:5],
        "server_rss_growth_mb": growth, "rss_bound_mb": args.rss_growth_mb, "server_exit": status,
        "outcomes": dict(outcomes), "windows": windows(events, args.duration), "rss_mb": rss,
        "max_tokens": args.max_tokens, "prompts": len(chats), "limit": args.limit, "cross_tenant": probe,
        "keyless_verifier": keyless,
    }
    args.report.parent.mkdir(parents=True, exist_ok=True)
    png = plot(result, args.report)
    result["plot"] = str(png) if png else None
    leaks = {k: v for k, v in gauges.items() if v}
    problems = []
    if undocumented:
        seen = "; ".join(f"{e['client']} {e['action']} -> {e['status']} at {e['t_s']:.0f} s" for e in undocumented[:5])
        problems.append(f"{len(undocumented)} undocumented answers ({seen})")
    if leaks or not gauges:
        problems.append(f"still open after the load: {leaks or 'gauges unreadable'}")
    if growth is not None and growth > args.rss_growth_mb:
        problems.append(f"server RSS grew {growth} MiB > {args.rss_growth_mb}")
    if not good_ok:
        problems.append("no good request was answered")
    problems += probe_problems(probe, keyless)
    result["ok"] = not problems
    return finish(result, args.json, report, args.report, not problems, "; ".join(problems), "soak")


if __name__ == "__main__":
    sys.exit(main())
