"""The REST gateway's boundary, with a scripted drafter client (no model): keys and body sizes checked before any
parsing, per-key quotas, readiness that follows the verifier, 500s that name an incident and nothing else, and a
non-streaming client that goes away freeing its drafter. The real stack is in tests/test_gateway.py."""
import time

import httpx
import pytest

from tandem.orchestrator.quota import KeyLimits, Quotas, QuotaExceeded

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
    url = serve_app(FakeClient())
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(url + path).status_code == 404, path
    assert httpx.get(url + "/metrics").status_code == 401
    assert "tandem_gateway" in httpx.get(url + "/metrics", headers=H).text
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
    url = serve_app(FakeClient(), limits=KeyLimits(tokens_per_minute=6))
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
                got.append("concurrency" if "generations" in str(e) else f"budget:{e.retry_after_s}")
        elif step[0] == "release":
            leases[step[1]].release(step[2])
            got.append(None)
        else:
            now[0] += step[1]
            got.append(None)
    assert got == expected
