"""The web chat page (GET /chat) in a real browser (Chromium, driven by Playwright). Against the real stack: it
streams the answer, shades each run of tokens one verify forward committed and lists each round's drafted tokens
accepted and rejected, read from the SSE event ids the gateway sets to ``forward:drafted:accepted``. Against a
scripted client (no model): it fits a phone and a desktop, renders markdown sanitised and still shaded, Stop ends
the generation on the server, nothing is sent twice, New chat forgets, the server's errors are shown in its words,
and the draft policy's reason is given. Screenshots go to $TANDEM_ARTIFACTS (default tests/artifacts/)."""
import json
import os
import re
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from scripted_gateway import KEY, FakeClient, FakeGeneration
from tandem.orchestrator.gateway import chat_page

PROMPT = "Write a Python function that adds two numbers."
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("TANDEM_ARTIFACTS") or ROOT / "tests" / "artifacts")
DESKTOP, PHONE = {"width": 1280, "height": 800}, {"width": 390, "height": 844}


def test_the_page_is_static_and_locked_down(serve_app):
    url = serve_app(FakeClient())
    r = httpx.get(f"{url}/chat")  # no key: the page carries nothing; its API calls need one
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp and "default-src 'none'" in csp
    # everything it runs is in the page (the markdown library inlined): nothing from another origin
    assert not re.search(r"<script[^>]*\ssrc=", r.text) and "DOMPurify" in r.text
    # the page's own code never parses an answer as markup (the sanitiser hands back DOM nodes)
    own = chat_page._PAGE + chat_page._LOCAL
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", own)


def test_the_inlined_markdown_bundle_is_what_clients_web_builds(tmp_path):
    """orchestrator/gateway/chat_markdown.js is clients/web's `npm run chat-markdown` output at package-lock.json's
    versions of marked and DOMPurify: rebuilt here and compared, byte for byte."""
    web = ROOT / "clients" / "web"
    if not (web / "node_modules" / "marked").is_dir():
        pytest.fail("clients/web has no node_modules (or an old one): `make web` installs them (npm ci)")
    out = tmp_path / "chat_markdown.js"
    subprocess.run(["node", "scripts/chat-markdown-bundle.mjs", str(out)], cwd=web, check=True, timeout=120)
    assert out.read_text() == chat_page.MARKDOWN_JS, "stale: run `npm run chat-markdown` in clients/web"


def test_the_way_to_force_drafting_the_page_names_is_a_real_option():
    from tandem.orchestrator import cli
    argv = chat_page.FORCE_DRAFTING.split()
    assert argv[:2] == ["tandem", "serve"]
    args = cli.parser().parse_args(argv[1:])
    assert args.gateway_tree == argv[-1] and chat_page.FORCE_DRAFTING in chat_page.PAGE


class Scripted(FakeGeneration):
    """An answer in verify forwards: each list of pieces one forward (drafted 4, all but one piece accepted); None
    fails the generation there."""

    def __init__(self, forwards, delay_s=0.0, policy=None):
        super().__init__(0, delay_s, False)
        self._it = self._forwards(forwards, policy or {})

    def _forwards(self, forwards, policy):
        try:
            for pieces in forwards:
                if pieces is None:
                    raise RuntimeError("the verifier fell over")
                self.stats.rounds += 1
                self.stats.drafted_nodes += 4
                self.stats.accepted_tokens += len(pieces) - 1
                for piece in pieces:
                    time.sleep(self.delay_s)
                    self.tokens.append(120)
                    self.text += piece
                    self.stats.generated_tokens += 1
                    yield piece
            self.stats.policy = policy
            self.finish_reason = "stop"
        finally:
            self.closed = True


class ScriptedClient(FakeClient):
    def __init__(self, forwards, delay_s=0.0, policy=None):
        super().__init__()
        self.forwards, self.answer_delay_s, self.policy = forwards, delay_s, policy

    def generate(self, prompt, **kwargs):
        super().generate(prompt, **kwargs)  # (recorded)
        self.gens[-1] = Scripted(self.forwards, self.answer_delay_s, self.policy)
        return self.gens[-1]


@contextmanager
def chromium_page(viewport=DESKTOP):
    """A page in Debian's Chromium; fails the test on any uncaught error in the page."""
    from playwright.sync_api import sync_playwright
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("Debian's chromium is not installed (`make test` installs it as root: apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=viewport)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            yield page
            assert not errors, errors
        finally:
            browser.close()


def ask(page, url, prompt, key=KEY, wait_for="tau"):
    page.goto(f"{url}/chat")
    if key:
        page.fill("#key", key)
    page.fill("#prompt", prompt)
    page.click("#send")
    if wait_for:
        from playwright.sync_api import expect
        expect(page.locator("#stats")).to_contain_text(wait_for, timeout=30_000)


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


LONG_LINE = "x = [" + ", ".join(str(i) for i in range(80)) + "]\n"  # wider than a phone
MARKDOWN = [["Here is ", "**the sum**"], [" of two numbers:\n\n", "```python\n"],
            ["def add(a, b):\n", "    return a + b\n"], [LONG_LINE, "```\n\n"],
            ["- one\n", "- two\n\n"],
            ['A tag as text: <img src=x onerror="window.pwned=1"> and ', "[a link](javascript:window.pwned=2).\n\n"],
            ["<script>window.pwned=3</script>\n"]]


# each shaded piece of the rendered markdown, its forward's run, and the visible characters shaded and not
SHADING = """answer => {
  const runs = {};
  for (const r of answer.querySelectorAll('.runs span.run')) runs[r.dataset.forward] = [r.textContent, r.className];
  const md = answer.querySelector('.md'), walker = document.createTreeWalker(md, NodeFilter.SHOW_TEXT);
  const pieces = [], count = (t) => t.replace(/\\s/g, '').length;
  let shaded = 0, visible = 0;
  while (walker.nextNode()) {
    const node = walker.currentNode, span = node.parentElement.closest('span.shade');
    visible += count(node.data);
    if (span) { shaded += count(node.data); pieces.push([span.dataset.forward, node.data, span.className]); }
  }
  return {runs, pieces, shaded, visible};
}"""


def check_shading(page, answer=".answer >> nth=-1", covered=0.9):
    """Every shaded piece of the rendered answer is text of the forward it names, shaded as that forward's run,
    in the order of the forwards; at least ``covered`` of the visible characters are shaded."""
    got = page.locator(answer).evaluate(SHADING)
    runs, pieces = got["runs"], got["pieces"]
    for forward, text, cls in pieces:
        run_text, run_cls = runs[forward]
        assert text in run_text, (forward, text, run_text)
        assert cls.split()[1:] == run_cls.split()[1:], (forward, cls, run_cls)  # f0 / f1 / lone
    order = [int(f) for f, _, _ in pieces]
    assert order == sorted(order), order
    assert got["shaded"] >= covered * got["visible"], got
    return got


def test_the_page_fits_a_phone_and_a_desktop(serve_app):
    """No horizontal overflow at 390 px (a long code line scrolls inside its block), the prompt box takes the
    page's width, Send and Stop are on screen, the legend explains the shading; a screenshot of each size is kept."""
    url = serve_app(ScriptedClient(MARKDOWN))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for name, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        with chromium_page(viewport) as page:
            ask(page, url, PROMPT)
            width = page.evaluate("() => document.documentElement.scrollWidth")
            assert width <= viewport["width"], f"{name}: the page is {width} px wide in a {viewport['width']} px view"
            body = page.locator("body").bounding_box()
            prompt = page.locator("#prompt").bounding_box()
            assert prompt["width"] >= 0.9 * body["width"] - 40, (name, prompt, body)  # never squeezed
            for button in ("#send", "#stop", "#new"):
                box = page.locator(button).bounding_box()
                assert box and 0 <= box["x"] and box["x"] + box["width"] <= viewport["width"], (name, button, box)
            code = page.locator(".md pre").first
            assert code.evaluate("e => e.scrollWidth > e.clientWidth")  # the long line scrolls in its block
            legend = page.locator("#legend")
            assert legend.is_visible() and legend.locator(".f0").count() and legend.locator(".lone").count()
            assert "decoded alone" in legend.text_content()
            page.screenshot(path=str(ARTIFACTS / f"chat-{name}.png"), full_page=True)
    assert (ARTIFACTS / "chat-phone.png").stat().st_size > 0


def test_markdown_is_rendered_sanitised_and_keeps_the_shading(serve_app):
    url = serve_app(ScriptedClient(MARKDOWN))
    with chromium_page() as page:
        ask(page, url, PROMPT)
        md = page.locator(".answer .md")
        assert md.locator("strong").text_content() == "the sum"
        assert md.locator("li").all_text_contents() == ["one", "two"]
        code = md.locator("pre code")
        assert code.text_content().startswith("def add(a, b):\n    return a + b\n")
        # every character of the code keeps the shading of the forward that committed it
        shaded = code.evaluate("e => [...e.querySelectorAll('span.shade')].map(s => [s.dataset.forward, s.className, "
                               "s.textContent])")
        assert [f for f, _, t in shaded if "def add" in t] == ["3"] and [f for f, _, t in shaded if "79]" in t] == ["4"]
        assert all(re.fullmatch(r"shade (f0|f1)", c) for _, c, _ in shaded)
        assert "".join(t for _, _, t in shaded) == code.text_content()
        got = check_shading(page)
        assert {int(f) for f, _, _ in got["pieces"]} == set(range(1, len(MARKDOWN) + 1))
        # raw HTML is text, a javascript: link is no link, nothing ran
        assert 'A tag as text: <img src=x onerror="window.pwned=1">' in md.text_content()
        assert "<script>window.pwned=3</script>" in md.text_content()
        assert md.locator("img, script, [onerror]").count() == 0
        assert md.locator("a[href^='javascript']").count() == 0
        assert page.evaluate("() => window.pwned") is None
        # the answer as streamed is kept underneath: shown with markdown off
        assert not page.locator(".answer .runs").is_visible()
        page.uncheck("#markdown")
        assert page.locator(".answer .runs").is_visible() and not md.is_visible()
        assert page.locator(".answer .runs").text_content() == "".join("".join(f) for f in MARKDOWN)


def test_an_answer_cut_inside_a_code_block_keeps_its_shading(serve_app):
    """No closing fence, no last line break (an answer that ended on its length): marked closes the block and adds a
    line break; every character the model wrote is still shaded as its forward."""
    url = serve_app(ScriptedClient([["Sure:\n\n```python\n", "def f"], ["(a):\n", "    \"\"\"Twice", " a.\"\"\"\n"],
                                    ["    return 2", " * a"]]))
    with chromium_page() as page:
        ask(page, url, PROMPT)
        assert page.locator(".md pre code").text_content() == 'def f(a):\n    """Twice a."""\n    return 2 * a\n'
        got = check_shading(page, covered=1.0)
        assert [(f, t) for f, t, _ in got["pieces"] if "def" in t or "return" in t] == [("1", "def f"),
                                                                                      ("3", "    return 2 * a")]


def test_one_answer_at_a_time_stop_cancels_it_on_the_server_and_new_chat_forgets(serve_app):
    from playwright.sync_api import expect
    client = FakeClient(delay_s=0.05)  # 20 tokens a second
    url = serve_app(client)
    with chromium_page() as page:
        page.goto(f"{url}/chat")
        page.fill("#key", KEY)
        page.fill("#max", "400")
        page.fill("#prompt", "first")
        page.press("#prompt", "Enter")
        expect(page.locator(".answer .runs span")).to_have_count(1, timeout=10_000)
        assert page.locator("#send").is_disabled() and page.locator("#stop").is_enabled()
        # no double send: Enter, and the form submitted twice more, while the answer streams
        page.fill("#prompt", "second")
        page.press("#prompt", "Enter")
        page.evaluate("() => { const f = document.getElementById('ask'); f.requestSubmit(); f.requestSubmit(); }")
        time.sleep(0.5)
        assert len(client.calls) == 1 and page.locator(".user").count() == 1
        page.click("#stop")
        gen = client.gens[0]
        assert wait_for(lambda: gen.closed, 5), "the server did not cancel the generation"
        assert len(gen.tokens) < 100  # of 400
        expect(page.locator(".stopped")).to_have_count(1)
        assert page.locator("#send").is_enabled() and page.locator("#stop").is_disabled()
        # the stopped answer is part of the conversation, as far as it got
        page.fill("#max", "3")
        page.fill("#prompt", "third")
        page.click("#send")
        expect(page.locator("#stats")).to_contain_text("tau", timeout=60_000)
        sent = client.rendered[-1][0]
        assert [m["role"] for m in sent] == ["user", "assistant", "user"]
        assert sent[0]["content"] == "first" and sent[1]["content"].startswith("x") and sent[2]["content"] == "third"
        # a new chat forgets it
        page.click("#new")
        assert page.locator("#log").text_content() == "" and "tokens 0" in page.locator("#stats").text_content()
        page.fill("#prompt", "fourth")
        page.click("#send")
        expect(page.locator(".answer .runs span")).to_have_count(1, timeout=10_000)
        assert wait_for(lambda: len(client.rendered) == 3)
        assert client.rendered[-1][0] == [{"role": "user", "content": "fourth"}]


def test_the_server_s_error_is_shown_in_its_words(serve_app):
    """Keys set and none typed: the server's 401 message, not a script error; the question is back in the box and
    goes once with the key. A generation that fails: the server's message too."""
    from playwright.sync_api import expect
    client = FakeClient()
    url = serve_app(client)
    with chromium_page() as page:
        ask(page, url, "hello", key=None, wait_for=None)
        error = page.locator(".answer.error")
        expect(error).to_have_count(1, timeout=10_000)
        said = httpx.get(f"{url}/v1/models").json()["error"]["message"]  # "Incorrect or missing API key: ..."
        assert error.text_content() == f"error 401: {said}"
        assert "TypeError" not in page.locator("#log").text_content()
        assert page.input_value("#prompt") == "hello" and page.locator("#send").is_enabled()
        page.fill("#key", KEY)
        page.click("#send")
        expect(page.locator("#stats")).to_contain_text("tau", timeout=30_000)
        assert client.rendered[-1][0] == [{"role": "user", "content": "hello"}]  # sent once
    url = serve_app(FakeClient(fail=True))  # fails before its first token: an HTTP 500
    with chromium_page() as page:
        ask(page, url, "hello", wait_for=None)
        expect(page.locator(".answer.error")).to_contain_text("error 500: internal error (incident", timeout=10_000)
    url = serve_app(ScriptedClient([["par", "tial"], None]))  # fails mid-stream: an error event
    with chromium_page() as page:
        ask(page, url, "hello", wait_for=None)
        expect(page.locator(".answer.error")).to_contain_text("error internal error (incident", timeout=10_000)
        assert page.locator(".answer .runs").text_content() == "partial"  # what came before it stays


def test_the_page_says_why_the_policy_chose_and_how_to_draft_regardless(serve_app):
    policy = {"mode": "plain", "shape": None, "rtt_ms": 12.5,
              "predicted_tokens_per_s": {"plain": 16.2, "rounds": 9.6, "draft": 14.7}}
    url = serve_app(ScriptedClient([["a", "b"], ["c"]], policy=policy))
    with chromium_page() as page:
        ask(page, url, PROMPT)
        why = page.locator("#why").text_content()
    assert "cloud-only decoding, predicted 16.2 tokens/s against lock-step drafting 9.6, streamed drafting 14.7" in why
    assert "round trip 12.5 ms" in why and chat_page.FORCE_DRAFTING in why


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
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "chat-real-pair.png"), full_page=True)
            check_shading(page)  # the markdown keeps each forward's shading on the real answer too
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
