"""The web chat page (GET /chat) in a real browser against the real stack: it streams the answer, shades each
run of tokens one verify forward committed and lists each round's drafted tokens accepted and rejected, read from the
SSE event ids the gateway sets to ``forward:drafted:accepted``."""
import json
import shutil
import time

import httpx
import pytest

from scripted_gateway import KEY, FakeClient

PROMPT = "Write a Python function that adds two numbers."


def test_the_page_is_static_and_locked_down(serve_app):
    url = serve_app(FakeClient())
    r = httpx.get(f"{url}/chat")  # no key: the page carries nothing; its API calls need one
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp and "default-src 'none'" in csp
    assert "innerHTML" not in r.text  # answers are inserted as text


@pytest.mark.models
def test_streamed_deltas_carry_the_forward_that_committed_them(serve_app, server, drafter):
    """Raw SSE: every text delta has an id, forwards and counts never go down, lock-step chains put several deltas
    under one forward, and the counts at the last delta are the generation's (the answer ends on its length)."""
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    client = EdgeClient(drafter, server, TreeShape(1, 4, 4), stream=False)
    url = serve_app(client)
    auth = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"]
    ids, stats = [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=auth,
                      json={"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=120) as r:
        event_id, finish = None, None
        for line in r.iter_lines():
            if line.startswith("id: "):
                event_id = tuple(int(x) for x in line[4:].split(":"))
            elif line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line:
                ids.append(event_id)
                event_id = None
            elif line.startswith("data: {") and '"tandem"' in line:
                stats = json.loads(line[6:])["tandem"]
            if line.startswith("data: {") and '"finish_reason": "' in line:
                finish = json.loads(line[6:])["choices"][0]["finish_reason"]
    client.close()
    # (temperature 0: the same answer every run, one that ends on its length, so its last forward committed text;
    # a sampled answer may end on a forward whose only token is the end of generation, which carries no delta)
    assert finish == "length"
    assert ids and None not in ids and ids == sorted(ids) and all(len(i) == 3 for i in ids)
    assert len({i[0] for i in ids}) < len(ids)  # speculation: some forward committed more than one delta
    assert ids[-1][1:] == (stats["drafted_tokens"], stats["accepted_tokens"]) and 0 < ids[-1][2] <= ids[-1][1]


@pytest.mark.models
def test_the_page_shows_runs_of_tokens_one_forward_committed(serve_app, server, drafter):
    """In Chromium: the page's answer is the REST answer (temperature 0, lock-step chains: the same generation),
    each forward's run is one span, and the accepted and drafted counts it shows are the response's own."""
    from playwright.sync_api import expect, sync_playwright

    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("Debian's chromium is not installed (`make test` installs it as root: apt-get install chromium)")
    client = EdgeClient(drafter, server, TreeShape(1, 4, 4), stream=False)
    url = serve_app(client, default_max_tokens=48)
    auth = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"]
    rest = httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=180, json={
        "model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0}).json()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(f"{url}/chat")
            page.fill("#key", KEY)
            page.fill("#prompt", PROMPT)
            page.click("#send")
            expect(page.locator("#stats")).to_contain_text("tau", timeout=180_000)  # the usage chunk arrived
            runs = page.eval_on_selector_all(
                ".answer span.run", "els => els.map(e => [e.dataset.forward, e.dataset.n, e.className, e.textContent])")
            rounds = page.eval_on_selector_all(
                ".rounds li", "els => els.map(e => [Number(e.dataset.drafted), Number(e.dataset.accepted)])")
            listed = page.locator(".rounds summary").text_content()
            stats = page.locator("#stats")
            shown = (stats.get_attribute("data-accepted"), stats.get_attribute("data-drafted"), stats.text_content())
        finally:
            browser.close()
    client.close()
    forwards = [int(r[0]) for r in runs]
    assert forwards == sorted(set(forwards))  # one span per forward, in order
    assert any(int(r[1]) > 1 for r in runs)  # runs of several tokens: drafts accepted in one forward
    assert all(("lone" in r[2]) == (r[1] == "1") for r in runs)
    assert "".join(r[3] for r in runs) == rest["choices"][0]["message"]["content"]
    t = rest["tandem"]
    assert (int(shown[0]), int(shown[1])) == (t["accepted_tokens"], t["drafted_tokens"])
    assert f"rejected {t['drafted_tokens'] - t['accepted_tokens']}" in shown[2]
    assert f"verify forwards {t['verify_forwards']}" in shown[2]
    # round by round: every forward with text is listed, and the rounds add up to the response's own counts
    assert len(rounds) >= len(runs) and all(0 <= a <= d for d, a in rounds)
    assert any(a > 0 for _, a in rounds) and any(a < d for d, a in rounds)  # accepted and rejected drafts both shown
    assert (sum(d for d, _ in rounds), sum(a for _, a in rounds)) == (t["drafted_tokens"], t["accepted_tokens"])
    assert f"accepted {t['accepted_tokens']}, rejected {t['drafted_tokens'] - t['accepted_tokens']}" in listed


def test_the_page_is_off_with_a_flag(serve_app):
    assert httpx.get(f"{serve_app(FakeClient(), chat_page=False)}/chat").status_code == 404


def test_every_request_gets_an_id_and_one_access_log_line(serve_app):
    import logging
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    access = logging.getLogger("tandem.gateway.access")
    level, propagate = access.level, access.propagate
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False  # to this handler only: not to whatever stream an earlier test left on "tandem"
    try:
        url = serve_app(FakeClient())
        r = httpx.get(f"{url}/v1/models")  # no key: refused by the guard, logged all the same
        ok = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        deadline = time.monotonic() + 5  # the line is written once the response has gone
        while len(records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
        access.propagate = propagate
    assert r.status_code == 401 and ok.status_code == 200
    ids = [r.headers["x-request-id"], ok.headers["x-request-id"]]
    assert len(set(ids)) == 2
    fields = [rec.fields for rec in records if rec.fields["path"] == "/v1/models"]
    assert [(f["id"], f["status"]) for f in fields] == [(ids[0], 401), (ids[1], 200)]
    assert all(KEY not in str(f) for f in fields)


def test_cors_is_off_unless_origins_are_configured(serve_app):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    closed = serve_app(FakeClient())
    assert "access-control-allow-origin" not in httpx.options(f"{closed}/v1/chat/completions",
                                                              headers=preflight).headers
    url = serve_app(FakeClient(), cors_origins=("https://app.example",))
    r = httpx.options(f"{url}/v1/chat/completions", headers=preflight)  # a preflight carries no key
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(f"{url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert other.headers.get("access-control-allow-origin") != "https://evil.example"


@pytest.mark.models
def test_the_answer_says_what_the_policy_chose_and_why(serve_app, server, drafter):
    from tandem.edge.client import EdgeClient
    client = EdgeClient(drafter, server)  # the draft policy (the default)
    url = serve_app(client)
    auth = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"]
    r = httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=180, json={
        "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24}).json()
    client.close()
    policy = r["tandem"]["policy"]
    assert policy["mode"] in policy["predicted_tokens_per_s"] and policy["rtt_ms"] >= 0
    assert policy["predicted_tokens_per_s"][policy["mode"]] > 0
