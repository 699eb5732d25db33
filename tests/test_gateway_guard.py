"""The REST gateway's boundary, with a scripted drafter client (no model): keys and body sizes checked before any
parsing, per-key quotas, readiness that follows the verifier, 500s that name an incident and nothing else, and a
non-streaming client that goes away freeing its drafter. The real stack is in tests/test_gateway.py."""
import time

import httpx
import pytest

from tandem.core.auth import ApiKeys
from tandem.core.quota import KeyLimits, Quotas, QuotaExceeded

from scripted_gateway import BODY, H, FakeClient


def test_no_key_no_parsing_and_bodies_are_capped(serve_app):
    url = serve_app(FakeClient(), max_body_bytes=2048)
    garbage = httpx.post(url + "/v1/chat/completions", content=b"{not json",
                         headers={"Content-Type": "application/json"})
    assert garbage.status_code == 401 and garbage.json()["error"]["code"] == "invalid_api_key"  # not a schema 400
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * 4000 + b'"}]}'
    assert httpx.post(url + "/v1/chat/completions", content=big, headers=H).status_code == 413

    def chunked():
        for _ in range(10):
            yield b"a" * 1000

    r = httpx.post(url + "/v1/chat/completions", content=chunked(), headers=H)  # no Content-Length: counted
    assert r.status_code == 413
    assert httpx.post(url + "/v1/chat/completions", json=BODY, headers=H).status_code == 200


def test_docs_and_metrics_are_not_public(serve_app):
    """/metrics counts every tenant's traffic: a scraper's key opens it, an API key does not."""
    url = serve_app(FakeClient(), metrics_keys=ApiKeys.of(["scraper"]))
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(url + path).status_code == 404, path
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/metrics", headers=H).status_code == 401
    assert "tandem_gateway" in httpx.get(url + "/metrics", headers={"Authorization": "Bearer scraper"}).text
    assert httpx.get(serve_app(FakeClient()) + "/metrics", headers=H).status_code == 401  # no scraper key: closed
    public = serve_app(FakeClient(), public_metrics=True)
    assert httpx.get(public + "/metrics").status_code == 200


def test_readiness_follows_the_verifier(serve_app):
    client = FakeClient()
    url = serve_app(client, identity_ttl_s=0.0)
    assert httpx.get(url + "/readyz").status_code == 200
    client.up = False
    r = httpx.get(url + "/readyz")
    assert r.status_code == 503 and "unreachable" in r.json()["status"]
    client.up = True
    assert httpx.get(url + "/readyz").status_code == 200


def test_internal_errors_name_an_incident_not_internals(serve_app):
    url = serve_app(FakeClient(fail=True))
    r = httpx.post(url + "/v1/chat/completions", json=BODY, headers=H)
    assert r.status_code == 500 and "incident" in r.json()["error"]["message"]
    assert "secret" not in r.text and "passwd" not in r.text


def test_a_non_streaming_client_that_leaves_frees_its_drafter(serve_app):
    client = FakeClient(delay_s=0.05)
    url = serve_app(client)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json={**BODY, "max_tokens": 400}, headers=H, timeout=0.5)
    deadline = time.monotonic() + 5
    while not client.gens[0].closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.gens[0].closed and len(client.gens[0].tokens) < 100  # stopped long before 400 tokens
    assert httpx.post(url + "/v1/chat/completions", json=BODY, headers=H).status_code == 200  # drafter is back


def test_per_key_token_budget_answers_429_with_retry_after(serve_app):
    """The budget counts prompt and completion tokens: the scripted prompt is 3 tokens, max_tokens 4."""
    short = serve_app(FakeClient(), limits=KeyLimits(tokens_per_minute=6))
    r = httpx.post(short + "/v1/chat/completions", json=BODY, headers=H)
    assert r.status_code == 429 and "prompt's 3 tokens" in r.json()["error"]["message"]
    url = serve_app(FakeClient(), limits=KeyLimits(tokens_per_minute=7))
    assert httpx.post(url + "/v1/chat/completions", json=BODY, headers=H).status_code == 200
    r = httpx.post(url + "/v1/chat/completions", json=BODY, headers=H)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert "tokens per minute" in r.json()["error"]["message"]
    other = httpx.post(url + "/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer k2"})
    assert other.status_code == 200  # budgets are per key


@pytest.mark.parametrize("limits, steps, expected", [
    # (concurrency, tokens/min); steps: ("acquire", key, max_tokens) | ("release", index, used) | ("wait", s)
    (KeyLimits(concurrency=1), [("acquire", "a", 5), ("acquire", "a", 5)], ["ok", "concurrency"]),
    (KeyLimits(concurrency=1), [("acquire", "a", 5), ("release", 0, 5), ("acquire", "a", 5)], ["ok", None, "ok"]),
    (KeyLimits(concurrency=1), [("acquire", "a", 5), ("acquire", "b", 5)], ["ok", "ok"]),
    (KeyLimits(tokens_per_minute=60), [("acquire", "a", 40), ("acquire", "a", 40)], ["ok", "budget:20"]),
    (KeyLimits(tokens_per_minute=60), [("acquire", "a", 40), ("release", 0, 10), ("acquire", "a", 40)],
     ["ok", None, "ok"]),  # 30 unused tokens came back
    (KeyLimits(tokens_per_minute=60), [("acquire", "a", 60), ("wait", 30.0), ("acquire", "a", 30)],
     ["ok", None, "ok"]),  # refilled at 1 token/s
])
def test_quota_table(limits, steps, expected):
    now = [0.0]
    q = Quotas(limits, clock=lambda: now[0])
    leases, got = [], []
    for step in steps:
        if step[0] == "acquire":
            try:
                leases.append(q.acquire(step[1], step[2]))
                got.append("ok")
            except QuotaExceeded as e:
                got.append("concurrency" if e.limit == "concurrency" else f"budget:{e.retry_after_s}")
        elif step[0] == "release":
            leases[step[1]].release(step[2])
            got.append(None)
        else:
            now[0] += step[1]
            got.append(None)
    assert got == expected


def test_a_key_past_its_budget_gets_nothing_tokenized_and_tokenize_is_metered(serve_app):
    """The quota is taken before any tokenization: a key in debt is refused with the prompt never rendered, and
    /tokenize and /detokenize charge what they process to the same budget (a key cannot tokenize for free)."""
    client = FakeClient()
    url = serve_app(client, limits=KeyLimits(tokens_per_minute=60))
    big = httpx.post(url + "/tokenize", json={"prompt": "x" * 50}, headers=H)
    assert big.status_code == 200 and big.json()["count"] == 50
    assert httpx.post(url + "/detokenize", json={"tokens": [120] * 9}, headers=H).status_code == 200  # 59 spent
    rendered = len(client.rendered)
    r = httpx.post(url + "/v1/chat/completions", json=BODY, headers=H)
    assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"]
    assert len(client.rendered) == rendered  # refused before the chat template or the tokenizer ran
    assert httpx.post(url + "/tokenize", json={"prompt": "x" * 5}, headers=H).status_code == 200  # 1 token left
    assert httpx.post(url + "/tokenize", json={"prompt": "y"}, headers=H).status_code == 429  # in debt now
    assert httpx.post(url + "/tokenize", json={"prompt": "y"}, headers={"Authorization": "Bearer k2"}
                      ).status_code == 200  # per key


@pytest.mark.parametrize("limits, steps, expected", [
    # acquire / charge / release: a reservation settles both ways, and work past the budget leaves a debt
    (KeyLimits(tokens_per_minute=60), [("acquire", "a", 100), ("acquire", "a", 1), ("wait", 40.0),
                                      ("acquire", "a", 1), ("wait", 1.0), ("acquire", "a", 1)],
     ["ok", "budget:41", None, "budget:1", None, "ok"]),  # 100 admitted at a full bucket: 40 of debt to refill
    (KeyLimits(tokens_per_minute=60), [("acquire", "a", 10), ("charge", 0, 45), ("charge", 0, 10)],
     ["ok", "ok", "budget:5"]),  # 5 left after 55: a charge of 10 is refused
    (KeyLimits(tokens_per_minute=60), [("acquire", "a", 10), ("release", 0, 70), ("acquire", "a", 1)],
     ["ok", None, "budget:11"]),  # used past the reservation: charged (60 - 70 = -10)
])
def test_quota_debts_and_charges(limits, steps, expected):
    now = [0.0]
    q = Quotas(limits, clock=lambda: now[0])
    leases, got = [], []
    for step in steps:
        try:
            if step[0] == "acquire":
                leases.append(q.acquire(step[1], step[2]))
            elif step[0] == "charge":
                leases[step[1]].charge(step[2])
            elif step[0] == "release":
                leases[step[1]].release(step[2])
                got.append(None)
                continue
            else:
                now[0] += step[1]
                got.append(None)
                continue
            got.append("ok")
        except QuotaExceeded as e:
            got.append(f"budget:{e.retry_after_s}" if e.limit == "tokens_per_minute" else e.limit)
    assert got == expected


def test_readyz_is_cheap_however_often_it_is_asked(serve_app):
    """A flood of /readyz shares the verifier's last answer (and at most one Health call in flight): it cannot pile
    up health calls, or fill the threads that tokenize."""
    import concurrent.futures
    client = FakeClient()
    calls = []
    health = client.health
    client.health = lambda timeout_s=5.0: calls.append(1) or time.sleep(0.2) or health(timeout_s)
    url = serve_app(client, identity_ttl_s=30.0)
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        codes = list(pool.map(lambda _: httpx.get(url + "/readyz", timeout=30).status_code, range(64)))
    assert codes == [200] * 64 and len(calls) == 1


def test_a_top_k_past_any_vocabulary_is_a_400(serve_app):
    url = serve_app(FakeClient())
    r = httpx.post(url + "/v1/chat/completions", json={**BODY, "top_k": 2 ** 40}, headers=H)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


# -- many users at once: a queue for the drafters -----------------------------------------------------------------
def _concurrently(n, fn):
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))


def _gauge(url, name):
    text = httpx.get(url + "/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_eight_concurrent_chats_on_one_drafter_are_all_answered(serve_app):
    """Two users of an app must not see 429s: with one drafter, requests wait their turn in the queue."""
    import openai
    client = FakeClient(delay_s=0.01)
    url = serve_app(client, public_metrics=True)
    oai = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)  # no retries: each answer is the first
    waits = _gauge(url, "tandem_gateway_queue_wait_seconds_count")  # (the process's metrics: other tests' too)
    answers = _concurrently(8, lambda i: oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=10))
    assert [a.choices[0].message.content for a in answers] == ["x" * 10] * 8
    assert len(client.calls) == 8
    assert _gauge(url, "tandem_gateway_queue_wait_seconds_count") == waits + 8
    assert _gauge(url, "tandem_gateway_queued") == 0


def test_the_queue_shows_in_metrics_and_readiness_and_429_only_when_full(serve_app):
    client = FakeClient(delay_s=0.05)
    url = serve_app(client, queue_depth=2, public_metrics=True)
    import threading
    codes = []
    long_body = {**BODY, "max_tokens": 40}  # 2 s each
    threads = [threading.Thread(target=lambda: codes.append(
        httpx.post(url + "/v1/chat/completions", json=long_body, headers=H, timeout=30).status_code))
        for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.1)
        if t is threads[0]:  # generating, nobody waiting: no drafter is free, and the next request would be taken
            assert httpx.get(url + "/readyz").status_code == 200
    assert _gauge(url, "tandem_gateway_queued") == 2  # one generating, two waiting
    ready = httpx.get(url + "/readyz")
    assert ready.status_code == 503 and ready.json()["queued"] == 2 and ready.json()["queue_depth"] == 2
    full = httpx.post(url + "/v1/chat/completions", json=BODY, headers=H)
    assert full.status_code == 429 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["code"] == "drafters_busy" and "2 requests are waiting" in full.json()["error"][
        "message"]
    for t in threads:
        t.join()
    assert codes == [200, 200, 200]
    assert httpx.get(url + "/readyz").status_code == 200


def test_no_queue_answers_429_at_once_and_a_wait_past_its_timeout_is_a_503(serve_app):
    client = FakeClient(delay_s=0.05)
    import threading
    for config, status, code in (({"queue_depth": 0}, 429, "drafters_busy"),
                                 ({"queue_timeout_s": 0.3}, 503, "queue_timeout")):
        url = serve_app(client, **config)
        busy = threading.Thread(target=httpx.post, args=(url + "/v1/chat/completions",),
                                kwargs={"json": {**BODY, "max_tokens": 30}, "headers": H, "timeout": 30})
        busy.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", json=BODY, headers=H, timeout=30)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
        assert r.headers["retry-after"] == "1"
        assert time.monotonic() - t0 < (0.2 if status == 429 else 1.0)
        busy.join()
    assert httpx.get(url + "/readyz").status_code == 200  # with a queue, and nobody in it


def test_a_queued_client_that_leaves_frees_its_place_and_never_generates(serve_app):
    client = FakeClient(delay_s=0.05)
    url = serve_app(client, queue_depth=4, public_metrics=True)
    import threading
    busy = threading.Thread(target=httpx.post, args=(url + "/v1/chat/completions",),
                            kwargs={"json": {**BODY, "max_tokens": 40}, "headers": H, "timeout": 30})
    busy.start()
    time.sleep(0.2)
    with pytest.raises(httpx.ReadTimeout):  # waits in line, then gives up
        httpx.post(url + "/v1/chat/completions", json={**BODY, "max_tokens": 3}, headers=H, timeout=0.5)
    deadline = time.monotonic() + 5
    while _gauge(url, "tandem_gateway_queued") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gauge(url, "tandem_gateway_queued") == 0  # left the line long before the drafter came free
    busy.join()
    time.sleep(0.3)
    assert [c["max_new_tokens"] for c in client.calls] == [40]  # the one that left never generated
