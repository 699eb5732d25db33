"""The REST gateway on the real pair: the official ``openai`` client unchanged (stream and not), OpenAI-style
errors with the right status for every bad request, capacity answers with Retry-After, disconnects freeing the
session, metrics, and auth. Every failure case is followed by a request that must still succeed."""
import json
import queue
import threading
import time

import httpx
import openai
import pytest
import uvicorn

import grpc

from tandem.cloud import reference
from tandem.edge.client import EdgeClient
from tandem.core.tree import TreeShape
from tandem.core.auth import ApiKeys
from tandem.orchestrator.gateway.app import create_app
from tandem.orchestrator.gateway.config import GatewayConfig
from tandem.orchestrator.gateway.drafter_pool import DrafterPool
from tandem.protos import verifier_pb2 as pb
from tandem.protos import verifier_pb2_grpc as pb_grpc

pytestmark = pytest.mark.models

KEY = "test-key-1"
QUESTION = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome, "
                                          "with a docstring and three usage examples."}]


@pytest.fixture(scope="module")
def gateway(verifier, make_drafter):
    address, backend = verifier
    pool = DrafterPool([EdgeClient(make_drafter(), address, TreeShape(1, 4, 4))])
    config = GatewayConfig(keys=ApiKeys.of([KEY, "other-key"]), model_name="tandem-test",
                           metrics_keys=ApiKeys.of(["scraper-key"]))
    app = create_app(pool, config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield {"url": f"http://127.0.0.1:{port}", "pool": pool, "backend": backend, "config": config}
    server.should_exit = True
    thread.join(10)
    pool.close()


@pytest.fixture(scope="module")
def oai(gateway):
    return openai.OpenAI(base_url=gateway["url"] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def expected(gateway, engine, noise):
    """What the SDK answers to QUESTION with the gateway's own drafter (24 tokens at temperature 0), checked
    lossless against target-only decoding (up to a measured near-tie); the gateway must return exactly this."""
    client = gateway["pool"].acquire()
    try:
        gen = client.chat(QUESTION, max_new_tokens=24)
    finally:
        gateway["pool"].release(client)
    verdict = reference.classify(gen.tokens, reference.greedy(engine, gen.prompt, 24), noise)
    assert verdict.ok, str(verdict)
    return gen.text


def still_serves(oai):
    r = oai.chat.completions.create(model="tandem-test", messages=[{"role": "user", "content": "Say hi"}],
                                    max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_openai_client_non_stream(oai, expected):
    r = oai.chat.completions.create(model="tandem-test", messages=QUESTION, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24
    stats = r.model_extra["tandem"]
    assert stats["tau"] >= 1 and stats["verify_forwards"] <= 24


def test_openai_client_stream_with_usage(oai, expected):
    chunks = list(oai.chat.completions.create(model="tandem-test", messages=QUESTION, max_tokens=24, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].model_extra["tandem"]["tau"] >= 1


def test_stop_string_and_seeded_sampling(oai):
    r = oai.chat.completions.create(model="tandem-test", messages=QUESTION, max_tokens=40, temperature=0,
                                    stop=["\n"])
    assert "\n" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    a, b = (oai.chat.completions.create(model="tandem-test", messages=QUESTION, max_tokens=12, temperature=0.8,
                                        top_p=0.9, seed=7).choices[0].message.content for _ in range(2))
    assert a == b  # equal seeds replay equal samples


@pytest.mark.parametrize("extra", [dict(top_k=1), dict(min_p=1.0)])
def test_sampling_controls_shape_the_targets_distribution(oai, expected, extra):
    """top_k 1 (or min_p 1) leaves only the target's most probable token, so sampling hot through the speculative
    path must give the greedy answer: the verifier samples the modified target, not the raw one."""
    r = oai.chat.completions.create(model="tandem-test", messages=QUESTION, max_tokens=24, temperature=1.8,
                                    extra_body=extra)
    assert r.choices[0].message.content == expected


def test_logprobs_are_the_targets_own(oai, gateway, engine, noise, expected):
    """Logprobs through the speculative path (tokens accepted from trees and decoded alone alike) against
    target-only decoding's log-softmax of the same positions: the verifier's values, not the drafter's."""
    r = oai.chat.completions.create(model="tandem-test", messages=QUESTION, max_tokens=24, temperature=0,
                                    logprobs=True, top_logprobs=3)
    assert r.choices[0].message.content == expected
    content = r.choices[0].logprobs.content
    assert len(content) == 24 and "".join(c.token for c in content) == expected
    prompt = gateway["pool"].clients[0].prompt_tokens(QUESTION)
    ref = reference.greedy(engine, prompt, 24)
    diffs = [abs(c.logprob - lp) for c, lp in zip(content, ref.logprobs)]
    # batch shapes move logits by up to `noise` (max over the vocabulary); log-softmax by at most twice that
    assert max(diffs) <= 2 * noise and sum(diffs) / len(diffs) < 0.05, diffs
    for c in content:  # greedy: the committed token is the most probable one, listed first
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)
    still_serves(oai)


def test_structured_output_through_the_official_client(oai):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = oai.chat.completions.create(
        model="tandem-test", max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Describe a person called Ann, aged 31, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tandem-test", messages=QUESTION, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}})
    assert e.value.body["param"] == "response_format" and "objectx" in e.value.body["message"]
    still_serves(oai)


def test_completions_are_the_targets_continuation(oai, gateway, engine, noise):
    """``/v1/completions`` through the speculative path, prompt as text and as token ids, with echo, checked
    against target-only decoding of the same ids."""
    prompt = "def is_prime(n: int) -> bool:\n"
    client = gateway["pool"].acquire()
    try:
        ids = client.drafter.tokenizer.tokenize(prompt)
        gen = client.generate(ids, max_new_tokens=20).result()
    finally:
        gateway["pool"].release(client)
    verdict = reference.classify(gen.tokens, reference.greedy(engine, ids, 20), noise)
    assert verdict.ok, str(verdict)
    r = oai.completions.create(model="tandem-test", prompt=prompt, max_tokens=20, temperature=0, echo=True)
    assert r.choices[0].text == prompt + gen.text and r.usage.prompt_tokens == len(ids)
    chunks = list(oai.completions.create(model="tandem-test", prompt=ids, max_tokens=20, temperature=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == gen.text
    assert chunks[-1].choices[0].finish_reason == "length"
    tokens = httpx.post(gateway["url"] + "/tokenize", json={"prompt": prompt},
                        headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    assert tokens == ids
    still_serves(oai)


@pytest.mark.parametrize("kwargs,status,fragment", [
    (dict(messages=[]), 400, "messages"),
    (dict(temperature=5), 400, "temperature"),
    (dict(n=2), 400, "n"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    (dict(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (dict(model="gpt-17"), 404, "does not exist"),
    (dict(max_tokens=100_000), 400, "maximum context length"),
])
def test_bad_requests_get_openai_errors(oai, kwargs, status, fragment):
    args = dict(model="tandem-test", messages=QUESTION, max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(**args)
    assert e.value.status_code == status
    assert fragment in e.value.body["message"], e.value.body
    still_serves(oai)


def test_auth(gateway, oai):
    bad = openai.OpenAI(base_url=gateway["url"] + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tandem-test", messages=QUESTION, max_tokens=2)
    r = httpx.get(gateway["url"] + "/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert [m.id for m in oai.models.list()] == ["tandem-test"]
    still_serves(oai)


def test_probes_and_metrics(gateway, oai):
    assert httpx.get(gateway["url"] + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(gateway["url"] + "/readyz").json()
    assert ready["status"] == "ready" and ready["model"] == "tandem-test" and ready["drafters"] == 1
    still_serves(oai)
    assert httpx.get(gateway["url"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 401
    text = httpx.get(gateway["url"] + "/metrics", headers={"Authorization": "Bearer scraper-key"}).text
    for name in ("tandem_gateway_requests_total{status=\"200\"}", "tandem_gateway_committed_tokens_total",
                 "tandem_gateway_tau_bucket", "tandem_gateway_rtt_seconds_bucket", "tandem_gateway_errors_total",
                 "tandem_verifier_verify_seconds_bucket", "tandem_verifier_queue_seconds_bucket",
                 "tandem_verifier_depth_accepted_total", "tandem_verifier_sessions",
                 # vLLM's speculative-decoding names, labelled with the target's model id
                 'tandem_spec_decode_num_drafts_total{model_name="qwen2.5-coder-1.5b-instruct-q4_k_m"}',
                 'tandem_spec_decode_num_accepted_tokens_per_pos_total{model_name="qwen2.5-coder-1.5b-instruct-q4_k_m",'
                 'position="0"}', "tandem_verifier_round_committed_tokens_bucket"):
        assert name in text, name
    drafts, drafted, accepted = (_sample(text, f"tandem_spec_decode_num_{n}_total") for n in
                                 ("drafts", "draft_tokens", "accepted_tokens"))
    assert 0 < accepted <= drafted and drafts <= drafted  # what acceptance-rate dashboards divide


def _sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def stream_lines(gateway, max_tokens):
    """A raw SSE request; returns (response context, line iterator)."""
    ctx = httpx.stream("POST", gateway["url"] + "/v1/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "tandem-test", "messages": QUESTION, "max_tokens": max_tokens, "stream": True,
                             "temperature": 0})
    return ctx


def wait_for(cond, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_request_waits_for_the_busy_drafter_and_a_disconnect_frees_the_session(gateway, oai):
    """The only drafter generating: the next request waits its turn (a 429 only with no room in the queue) and is
    answered as soon as the first client goes away and its session closes."""
    import concurrent.futures
    backend, pool, config = gateway["backend"], gateway["pool"], gateway["config"]
    post = lambda: httpx.post(gateway["url"] + "/v1/chat/completions",  # noqa: E731
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                              json={"model": "tandem-test", "messages": QUESTION, "max_tokens": 2})
    with concurrent.futures.ThreadPoolExecutor(1) as threads:
        with stream_lines(gateway, 400) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # generating now: the only drafter is taken
            waiting = threads.submit(post)
            assert wait_for(lambda: pool.waiting() == 1)
            depth, config.queue_depth = config.queue_depth, 1  # the queue is full now
            try:
                busy = post()
            finally:
                config.queue_depth = depth
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["type"] == "rate_limit_exceeded"
            assert busy.json()["error"]["code"] == "drafters_busy"
            assert backend.active_sessions() == 1 and not waiting.done()
        # the client went away mid-stream: its session closes, and the drafter goes to the request waiting
        answered = waiting.result(timeout=120)
    assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 2
    assert wait_for(lambda: backend.active_sessions() == 0 and pool.free() == 1), backend.active_sessions()
    still_serves(oai)


def test_full_verifier_answers_503_with_retry_after(gateway, oai, engine):
    """Every verifier session taken by other clients: RESOURCE_EXHAUSTED becomes 503 + Retry-After."""
    address = gateway["pool"].clients[0].address
    import grpc
    held = []
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.VerifierStub(ch)
        prompt = engine.model.tokenize("hello")
        while gateway["backend"].active_sessions() < gateway["backend"].info.max_sessions:
            reqs = queue.SimpleQueue()
            responses = stub.Session(iter(reqs.get, None), timeout=60)
            reqs.put(pb.SessionRequest(open=pb.Open(prompt_tokens=prompt, limits=pb.Limits(max_new_tokens=4))))
            next(responses)
            held.append((reqs, responses))
        try:
            with pytest.raises(openai.APIStatusError) as e:
                oai.chat.completions.create(model="tandem-test", messages=QUESTION, max_tokens=2)
            assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
            assert "maximum" in e.value.body["message"]
        finally:
            for reqs, responses in held:
                reqs.put(None)
                responses.cancel()
    assert wait_for(lambda: gateway["backend"].active_sessions() == 0)
    still_serves(oai)


def test_rest_over_tls(gateway, cert):
    """The same app behind uvicorn with a certificate: HTTPS works against the CA, plain HTTP does not."""
    app = create_app(gateway["pool"], GatewayConfig(keys=ApiKeys.of([KEY]), model_name="tandem-test"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           ssl_certfile=str(cert[0]), ssl_keyfile=str(cert[1])))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        import ssl
        ca = ssl.create_default_context(cafile=str(cert[0]))
        assert httpx.get(f"https://127.0.0.1:{port}/healthz", verify=ca).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        with pytest.raises(httpx.HTTPError):  # an unknown CA is refused
            httpx.get(f"https://127.0.0.1:{port}/healthz")
    finally:
        server.should_exit = True
        thread.join(10)


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def device_opened(url: str, credential: str, prompt: list[int], fp: str, n_vocab: int) -> pb.Opened:
    """A device's session over the gateway's WebSocket: Open on ``prompt``, then Close; its Opened."""
    from websockets.sync.client import connect
    opening = pb.SessionRequest(open=pb.Open(vocab_size=n_vocab, vocab_fingerprint=fp, prompt_tokens=prompt,
                                             limits=pb.Limits(max_new_tokens=2)))
    with connect(url.replace("http://", "ws://") + "/v1/edge/session",
                 subprotocols=["tandem.v1", "bearer." + credential], open_timeout=10) as ws:
        ws.send(opening.SerializeToString())
        opened = pb.SessionResponse.FromString(ws.recv(timeout=60)).opened
        ws.send(pb.SessionRequest(close=pb.Close(session_id=opened.session_id)).SerializeToString())
        while not pb.SessionResponse.FromString(ws.recv(timeout=60)).HasField("closed"):
            pass
    return opened


def test_tandem_serve_runs_verifier_and_gateway_in_one_process(target_path, drafter_path, tmp_path):
    """The product path: `tandem serve` (verifier + REST gateway), configured by environment, answered by the
    official client; two API keys never share the prompt cache, nor two devices of one key; with REST keys set the
    verifier answers no keyless call; a second serve on either port fails at once naming it; SIGTERM during a
    generation lets it finish, then stops the process cleanly."""
    import os
    import signal
    import subprocess
    import sys
    http_port, grpc_port = free_port(), free_port()
    keys = tmp_path / "keys"
    keys.write_text("serve-key\nother-key\n")
    env = dict(os.environ, TANDEM_API_KEYS_FILE=str(keys), TANDEM_PORT=str(grpc_port),
               TANDEM_HTTP_PORT=str(http_port),
               TANDEM_THREADS="1", TANDEM_DRAFTER_THREADS="1", TANDEM_N_CTX="1024", TANDEM_MAX_SESSIONS="1",
               TANDEM_GATEWAY_TREE="1,3,3", TANDEM_TARGET=str(target_path), TANDEM_DRAFTER=str(drafter_path))
    proc = subprocess.Popen([sys.executable, "-m", "tandem.orchestrator.cli", "serve"], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert "verifier ready" in proc.stdout.readline()
        assert "gateway ready" in proc.stdout.readline()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="serve-key", max_retries=0)
        deadline = time.monotonic() + 30
        while True:
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5 and r.choices[0].message.content
        # the same prompt from another key finds nothing of it in the cache; the first key finds its own
        other = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="other-key", max_retries=0)
        b = other.chat.completions.create(model=model, messages=QUESTION, max_tokens=1, temperature=0)
        assert b.usage.prompt_tokens_details.cached_tokens == 0
        a = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1, temperature=0)
        assert a.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 1
        # two devices holding tokens of the same key: the second learns nothing of the first's prompt
        url, auth = f"http://127.0.0.1:{http_port}", {"Authorization": "Bearer serve-key"}
        target = httpx.get(f"{url}/v1/edge/target", headers=auth, timeout=10).json()
        prompt = httpx.post(f"{url}/tokenize", headers=auth, json={"model": model, "messages": QUESTION},
                            timeout=30).json()["tokens"]
        devices = [httpx.post(f"{url}/v1/edge-tokens", headers=auth, json={}, timeout=10).json()["token"]
                   for _ in range(2)]
        device_opened(url, devices[0], prompt, target["vocabFingerprint"], target["vocabSize"])
        second = device_opened(url, devices[1], prompt, target["vocabFingerprint"], target["vocabSize"])
        assert second.cached_tokens == 0 and second.prefill_us == 0
        # REST keys are set and no verifier key: the verifier still answers no keyless call
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            with pytest.raises(grpc.RpcError) as keyless:
                list(pb_grpc.VerifierStub(ch).Tokenizer(pb.TokenizerRequest(), timeout=10))
            assert keyless.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # a second serve on a port in use fails at once, naming the port, before it loads anything
        for ports in ((grpc_port, free_port()), (free_port(), http_port)):
            t0 = time.monotonic()
            again = subprocess.run([sys.executable, "-m", "tandem.orchestrator.cli", "serve", "--port",
                                    str(ports[0]), "--http-port", str(ports[1])], env=env, capture_output=True,
                                   text=True, timeout=60)
            assert again.returncode != 0 and time.monotonic() - t0 < 10
            used = ports[0] if ports[0] == grpc_port else ports[1]
            assert f":{used}" in again.stderr and "in use" in again.stderr, again.stderr
        huge = httpx.post(f"http://127.0.0.1:{http_port}/v1/chat/completions", headers={
            "Authorization": "Bearer serve-key"}, json={"model": model, "messages": QUESTION, "top_k": 2 ** 40})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "top_k"
        # SIGTERM during a generation: the process drains, so the answer in flight finishes in full
        stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = iter(stream)
        first = next(c for c in chunks if c.choices and c.choices[0].delta.content)
        proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert rest[-1].usage.completion_tokens == 16
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
        assert first.choices[0].delta.content
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_serve_in_vllms_spelling_answers_eight_users_at_once_on_one_drafter(target_path, drafter_path):
    """`tandem serve --model M --api-key k --port P --grpc-port G --gateway-drafters 1`: REST on P needing k, the
    verifier on G, and 8 concurrent chat completions through the official client (no retries) all answered."""
    import concurrent.futures
    import os
    import subprocess
    import sys

    from tandem.core import lifetime
    from tandem.edge.client import health
    http_port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_API_KEY", "TANDEM_VERIFIER_KEY"))}
    env.update(TANDEM_THREADS="1", TANDEM_DRAFTER_THREADS="1", TANDEM_N_CTX="1024", TANDEM_MAX_SESSIONS="1")
    proc = lifetime.spawn([sys.executable, "-m", "tandem.orchestrator.cli", "serve", "--model", str(target_path),
                           "--drafter", str(drafter_path), "--api-key", "k", "--port", str(http_port), "--grpc-port",
                           str(grpc_port), "--gateway-drafters", "1", "--gateway-tree", "1,3,3"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert f"verifier ready on 127.0.0.1:{grpc_port} " in proc.stdout.readline()
        assert f"gateway ready on http://127.0.0.1:{http_port} (1 drafters" in proc.stdout.readline()
        assert health(f"127.0.0.1:{grpc_port}").target_model
        url = f"http://127.0.0.1:{http_port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="not-k", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
        model = client.models.list().data[0].id
        with concurrent.futures.ThreadPoolExecutor(8) as threads:
            answers = list(threads.map(lambda i: client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=4,
                temperature=0), range(8)))
        assert [a.usage.completion_tokens for a in answers] == [4] * 8
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "deprecated" not in proc.stderr.read()


def test_the_gateways_verifier_going_away_is_a_503_until_it_is_back(engine, make_drafter):
    """Kill the gateway's verifier (its gRPC server stops): requests are 503 with Retry-After and /readyz fails;
    once a verifier serves that address again, both recover without restarting the gateway."""
    from tandem.cloud.backend import LocalBackend
    from tandem.cloud.server import serve
    backend = LocalBackend(engine, max_sessions=2)
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    pool = DrafterPool([EdgeClient(make_drafter(), address, TreeShape(1, 3, 3), max_resumes=0)])
    app = create_app(pool, GatewayConfig(keys=ApiKeys.of([KEY]), model_name="tandem-test", identity_ttl_s=0.0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    try:
        still_serves(oai)
        srv.stop(grace=None)  # the verifier dies
        with pytest.raises(openai.APIStatusError) as e:
            still_serves(oai)
        assert e.value.status_code == 503 and e.value.response.headers.get("retry-after")
        assert httpx.get(url + "/readyz").status_code == 503
        srv, _ = serve(backend=backend, address=address)  # and comes back on the same address
        deadline = time.monotonic() + 30
        while httpx.get(url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the gateway did not see its verifier come back"
            time.sleep(0.5)
        still_serves(oai)
        assert backend.active_sessions() == 0
    finally:
        server.should_exit = True
        thread.join(10)
        pool.close()
        srv.stop(grace=None)
        backend.scheduler.stop()


@pytest.mark.models
def test_the_device_side_endpoint_drafts_here_and_verifies_in_another_process(target_path, drafter_path):
    """`tandem serve --verifier HOST:PORT` (the device-side OpenAI endpoint) in one process, the verifier in
    another, the official openai client talking to the first: the answer is the verifier's target's."""
    import os
    import socket
    import subprocess
    import sys

    from tandem.core import lifetime
    from tandem.edge.client import RemoteError, health

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    grpc_port, http_port = free_port(), free_port()
    env = dict(os.environ, TANDEM_THREADS="1", TANDEM_DRAFTER_THREADS="1", TANDEM_N_CTX="1024")
    verifier = lifetime.spawn([sys.executable, "-m", "tandem.orchestrator.cli", "serve", "--port", str(grpc_port),
                               "--http-port", "0", "--target", str(target_path), "--max-sessions", "1"], env=env,
                              stdout=subprocess.DEVNULL)
    device = None
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                health(f"127.0.0.1:{grpc_port}", timeout_s=2)
                break
            except RemoteError:
                assert verifier.poll() is None and time.monotonic() < deadline, "the verifier did not start"
                time.sleep(0.3)
        device = lifetime.spawn([sys.executable, "-m", "tandem.orchestrator.cli", "serve", "--verifier",
                                 f"127.0.0.1:{grpc_port}", "--http-port", str(http_port), "--drafter",
                                 str(drafter_path), "--gateway-tree", "1,4,4"], env=env, stdout=subprocess.DEVNULL)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0)
        while True:
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert device.poll() is None and time.monotonic() < deadline + 60, "the device endpoint did not start"
                time.sleep(0.3)
        assert model == "qwen2.5-coder-1.5b-instruct-q4_k_m"  # the remote verifier's target
        r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
        assert r.usage.completion_tokens == 24 and r.choices[0].message.content
        extra = r.model_extra["tandem"]
        assert extra["verify_forwards"] < 24 and extra["accepted_tokens"] > 0  # drafted on the device
    finally:
        for proc in (device, verifier):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
