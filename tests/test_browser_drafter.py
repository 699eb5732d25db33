"""Drafting in a browser tab: the chat page's "draft in this browser" in headless Chromium loads the drafter's
self-contained export into onnxruntime-web (WASM), drafts chains (then trees, ``?tree=k,n,d``) in the page and has
the real verifier check them over a WebSocket session. The answer must be the target's own: token-exact against
target-only decoding with the same engine at temperature 0 (up to the engine's measured batch-shape near-ties). The
page's figures (draft ms per token, tau, tokens/s) are written where ``bench.browser`` reads them."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from scripted_gateway import KEY
from test_web_client import onnx_drafter_fixture  # noqa: F401  (the random-weight export and its reference)

WEB = Path(__file__).resolve().parent.parent / "clients" / "web"
PROMPT = "Write a Python function that returns the larger of two numbers."
NEW = 40


@pytest.fixture(scope="module")
def web_build():
    if not (WEB / "node_modules" / "onnxruntime-web").is_dir():
        pytest.fail("clients/web has no node_modules: `make test` installs them (npm ci in clients/web)")
    r = subprocess.run(["npm", "run", "build"], cwd=WEB, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return WEB


def test_the_drafter_routes_say_what_is_missing(serve_app, tmp_path):
    from scripted_gateway import FakeClient
    url = serve_app(FakeClient(), web_client=tmp_path)  # no build there, no drafter export given
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(f"{url}/v1/edge/drafter/model.onnx", headers=auth)
    assert r.status_code == 404 and "--browser-drafter" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/edge/drafter/model.onnx").status_code == 401  # a device credential first
    assert httpx.get(f"{url}/v1/edge/drafter/secrets.txt", headers=auth).status_code == 404
    assert "npm run build" in httpx.get(f"{url}/edge/client/edge.js").json()["error"]["message"]
    assert httpx.get(f"{url}/edge/ort/package.json").status_code == 404  # the package's binaries and modules only


@pytest.mark.models
def test_a_browser_tab_drafts_and_the_answer_is_the_targets(serve_app, server, drafter, engine, drafter_path,
                                                            noise, web_build, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    from tandem.cloud import reference
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.export.onnx_export import export
    from tandem.orchestrator.gateway.config import VerifierLink
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("Debian's chromium is not installed (`make test` installs it as root: apt-get install chromium)")
    exported = export(drafter_path, "dynamic-int8", self_contained=True)  # (cached after the first run: ~30 s)
    client = EdgeClient(drafter, server, TreeShape(1, 4, 4), stream=False)  # the gateway's own (REST, /tokenize)
    url = serve_app(client, verifier=VerifierLink(server), browser_drafter=exported, web_client=web_build)
    auth = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"]
    prompt = httpx.post(f"{url}/tokenize", headers=auth, timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": PROMPT}]}).json()["tokens"]
    ref = reference.greedy(engine, prompt, NEW)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{url}/chat")
            page.fill("#key", KEY)
            page.fill("#max", str(NEW))
            page.check("#local")
            page.fill("#prompt", PROMPT)
            page.click("#send")
            done = page.locator("#stats:has-text('tokens/s'), .answer:has-text('error')")
            expect(done).to_have_count(1, timeout=600_000)
            assert "error" not in page.locator("#log").text_content(), page.locator("#log").text_content()
            answer = page.locator(".answer").last
            tokens = json.loads(answer.get_attribute("data-tokens") or "[]")
            figures = page.eval_on_selector("#stats", "e => ({...e.dataset})")
            runs = page.eval_on_selector_all(".answer span.run", "els => els.map(e => Number(e.dataset.n))")
            # the same question as a new chat, drafting trees of 6 nodes (2 children a node, 4 levels)
            page.evaluate("() => { messages.length = 0; history.replaceState(null, '', '?tree=2,6,4'); }")
            page.fill("#prompt", PROMPT)
            page.click("#send")
            expect(page.locator(".answer[data-tokens], .answer:has-text('error')")).to_have_count(2, timeout=600_000)
            assert "error" not in page.locator("#log").text_content(), page.locator("#log").text_content()
            tree_tokens = json.loads(page.locator(".answer").last.get_attribute("data-tokens") or "[]")
            tree_figures = page.eval_on_selector("#stats", "e => ({...e.dataset})")
        finally:
            browser.close()
    client.close()
    assert not errors, errors
    verdict = reference.classify(tokens, ref, noise)
    assert verdict.ok, (str(verdict), tokens, ref.tokens)
    assert len(tokens) == len(ref.tokens)
    drafted, accepted, forwards = (int(figures[k]) for k in ("drafted", "accepted", "forwards"))
    assert 0 < accepted <= drafted and forwards == len(runs) < len(tokens)  # chains were drafted and accepted here
    assert sum(runs) == len(tokens) and float(figures["draftMsPerToken"]) > 0
    tree_verdict = reference.classify(tree_tokens, ref, noise)
    assert tree_verdict.ok and len(tree_tokens) == len(ref.tokens), (str(tree_verdict), tree_tokens)
    drafted, accepted, forwards = (int(tree_figures[k]) for k in ("drafted", "accepted", "forwards"))
    assert drafted == 6 * forwards and 0 < accepted and forwards < len(tokens)  # every round a whole tree
    out = os.environ.get("TANDEM_BROWSER_FIGURES")
    if out:
        Path(out).write_text(json.dumps({"prompt_tokens": len(prompt), "tokens": len(tokens), "kind": verdict.kind,
                                         **figures}))


WEBGPU_FLAGS = ("--enable-unsafe-webgpu", "--enable-features=Vulkan", "--use-angle=swiftshader",
                "--use-webgpu-adapter=swiftshader", "--disable-vulkan-surface")  # Chromium's software GPU


def test_the_page_drafts_on_webgpu_as_the_reference_does(serve_app, onnx_drafter_fixture, web_build):  # noqa: F811
    """``?ep=webgpu``: the page loads onnxruntime-web's WebGPU build and the drafter runs on its WebGPU provider
    (here SwiftShader, Chromium's software GPU: exactness, not speed); its chains and trees on a random-weight
    export equal the cache-free Python reference's (tests/test_web_client.py's fixture). A later visit loads the
    drafter from the browser's Cache Storage (no download); meta.json names the export, not the server's path."""
    from playwright.sync_api import sync_playwright

    from scripted_gateway import FakeClient
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("Debian's chromium is not installed (`make test` installs it as root: apt-get install chromium)")
    fixture = json.loads(onnx_drafter_fixture.read_text())
    url = serve_app(FakeClient(), browser_drafter=Path(fixture["model"]).parent, web_client=web_build)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", *WEBGPU_FLAGS])
        try:
            context = browser.new_context()  # (one profile: the second page finds the drafter in Cache Storage)
            downloads = []
            context.on("request", lambda r: downloads.append(r.url) if "/drafter/model.onnx" in r.url else None)
            page = context.new_page()
            page.goto(f"{url}/chat?ep=webgpu")
            got = page.evaluate("""async ([key, fx]) => {
                const {drafter, ep} = await loadLocal({Authorization: "Bearer " + key}, stats);
                const chains = [], trees = [];
                for (const c of fx.calls) chains.push(await drafter.draft(c.committed, c.depth));
                for (const t of fx.trees) trees.push(await drafter.draftTree(t.committed, t.shape));
                return {ep, chains, trees};
            }""", [KEY, fixture])
            again = context.new_page()  # a later visit: the drafter from the cache, not the network
            again.goto(f"{url}/chat")
            chain = again.evaluate("""async ([key, c]) => {
                const {drafter} = await loadLocal({Authorization: "Bearer " + key}, stats);
                return [stats.textContent, await drafter.draft(c.committed, c.depth)];
            }""", [KEY, fixture["calls"][0]])
            again.goto(f"{url}/chat?ep=cuda")
            refused = again.evaluate("() => loadLocal({}, stats).then(() => '', (e) => e.message)")
        finally:
            browser.close()
    assert got["ep"] == "webgpu"
    assert got["chains"] == [c["chain"] for c in fixture["calls"]]
    assert got["trees"] == [{"tokens": t["tokens"], "parents": t["parents"]} for t in fixture["trees"]]
    assert len(downloads) == 1 and chain == ["starting the drafter", fixture["calls"][0]["chain"]], (downloads, chain)
    assert "?ep=cuda: wasm or webgpu" in refused
    meta = httpx.get(f"{url}/v1/edge/drafter/meta.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert "source" not in meta and meta["export_id"].startswith(Path(fixture["model"]).parent.name)
