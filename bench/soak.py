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

Reported: p50/p99 of request latency and time to first token per time window; RSS of every process over time;
verifier sessions, engine KV blocks and gateway generations open at the end; outcomes by status; the probe's
findings (``cross_tenant``). Exits 1 when a request got an undocumented answer (a 500, a wrong status for a bad
input, an error on a good request that is not backpressure: 429/503 with Retry-After), when anything is still open
after the load stops, when the server's RSS grew more than ``--rss-growth-mb`` between the end of the warm-up and
the end, or when the probe learnt anything across keys.
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
               args.drafter, "--port", str(self.grpc_port), "--http-port", str(self.http_port), "--metrics-port",
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
def probe_tenants(stack: Stack, chats: list[tuple[str, list[dict]]], owner: str, prober: str, guesser: str,
                  n: int) -> dict:
    """What a second key learns of a first key's prompts through the prompt cache (see the module docstring)."""
    url = stack.url + "/v1/chat/completions"
    model = httpx.get(stack.url + "/v1/models", headers={"Authorization": f"Bearer {owner}"},
                      timeout=30).json()["data"][0]["id"]

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

    rows = []
    for i, (_, chat) in enumerate(chats[:n]):
        messages = [{"role": "system", "content": f"Probe {i} of soak run {os.getpid()}-{time.time_ns()}."},
                    *chat]
        guess = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + " And"}]
        row = {"first": cached(owner, messages)}  # the owner's conversation, kept when it ends
        row["other_key_same_prompt"] = cached(prober, messages)
        row["other_key_guess"] = cached(guesser, guess)
        row["owner_again"] = cached(owner, messages)
        rows.append(row)
    return {"probes": rows, "leaked": sum(r["other_key_same_prompt"] + r["other_key_guess"] > 0 for r in rows),
            "owner_hits": sum(r["owner_again"] > 0 for r in rows)}


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
    if result.get("plot"):
        lines += ["", f"![soak]({Path(result['plot']).name})"]
    path.write_text("\n".join(lines) + "\n")


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
    ap.add_argument("--probes", type=int, default=2, help="prompts of the cross-tenant probe after the load (0: none)")
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
        probe = None
        if args.probes:
            _progress(f"cross-tenant probe on {args.probes} prompts")
            probe = probe_tenants(stack, chats, *probe_keys, args.probes)
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
    if probe is not None and probe["leaked"]:
        problems.append(f"another API key was served {probe['leaked']} of the first key's prompts from the cache")
    if probe is not None and not probe["owner_hits"]:
        problems.append("the cross-tenant probe's owner never hit its own cache: the probe proves nothing")
    result["ok"] = not problems
    return finish(result, args.json, report, args.report, not problems, "; ".join(problems), "soak")


if __name__ == "__main__":
    sys.exit(main())
