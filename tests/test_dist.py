"""Tandem installs as packages, outside the checkout. `make dist` builds the wheel and the sdist (the wheel from the
sdist); the wheel with the `edge` extra goes into a fresh virtual environment (the versions of uv.lock, llama.cpp
from the wheel `make` built once into the cache, never compiled here), where `tandem chat --help` runs and the SDK
imports, with none of the server's packages. The TypeScript client's `npm pack` holds its built code and the proto,
and its tarball, installed into a fresh project outside the repository, runs a session against the scripted
verifier."""
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "clients" / "web"
BIN = Path(sys.executable).parent
SERVER_SIDE = ("torch", "ray", "fastapi", "llguidance", "playwright", "mypy", "onnxruntime")


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd}: {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def llama_wheels() -> Path:
    """The folder holding the llama-cpp-python wheel `make` built (the cache's wheels/<key>/)."""
    cache = Path(os.environ.get("TANDEM_CACHE") or Path.home() / ".cache" / "tandem")
    found = sorted((cache / "wheels").glob("*/llama_cpp_python-0.3.36-*.whl"), key=lambda p: p.stat().st_mtime)
    if not found:
        pytest.fail(f"no llama-cpp-python wheel under {cache / 'wheels'}: `make` builds it once (make install)")
    return found[-1].parent


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run(["make", "-s", "dist", f"DIST={out}"], cwd=ROOT, timeout=600)
    return out


def test_make_dist_builds_a_wheel_and_an_sdist_that_hold_the_package(dist):
    wheels, sdists = list(dist.glob("tandem-*.whl")), list(dist.glob("tandem-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(dist.iterdir())
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    for need in ("tandem/edge/client.py", "tandem/edge/policy/planner.py", "tandem/cloud/server.py",
                 "tandem/orchestrator/cli.py", "tandem/orchestrator/gateway/chat_markdown.js",
                 "tandem/protos/verifier.proto", "tandem/protos/verifier_pb2.py", "tandem/core/py.typed"):
        assert need in names, need
    assert not any(n.startswith(("tests/", "bench/", "clients/")) for n in names)
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "tandem = tandem.orchestrator.cli:main" in zipfile.ZipFile(wheels[0]).read(entry).decode()
    with tarfile.open(sdists[0]) as t:
        members = {m.split("/", 1)[1] for m in t.getnames() if "/" in m}
    assert {"pyproject.toml", "README.md", "protos/verifier.proto", "orchestrator/gateway/chat_markdown.js"} <= members


def test_the_wheel_with_the_edge_extra_installs_into_a_clean_venv(dist, tmp_path):
    uv = shutil.which("uv", path=str(BIN)) or shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not installed (`make` installs it into .venv)")
    wheel = next(dist.glob("tandem-*.whl"))
    constraints = tmp_path / "constraints.txt"  # the SDK extra's versions, as uv.lock pins them
    run([uv, "export", "-q", "--frozen", "--no-hashes", "--no-emit-project", "--extra", "edge", "-o", str(constraints)],
        cwd=ROOT, timeout=120)
    venv = tmp_path / "venv"
    run([uv, "venv", "-q", "--python", sys.executable, str(venv)], timeout=120)
    python = venv / "bin" / "python"
    # llama.cpp from the cached wheel: --no-build makes compiling anything an error rather than 25 minutes
    run([uv, "pip", "install", "-q", "--python", str(python), "-c", str(constraints), "--find-links",
         str(llama_wheels()), "--no-build", f"{wheel}[edge]"], timeout=600,
        env={**os.environ, "VIRTUAL_ENV": str(venv)})
    outside = tmp_path / "elsewhere"  # (not the checkout: nothing can be imported from its folders)
    outside.mkdir()
    r = run([str(venv / "bin" / "tandem"), "chat", "--help"], cwd=outside, timeout=120)
    assert "--verifier" in r.stdout and "--max-tokens" in r.stdout
    probe = ("import importlib.util as u, json, tandem.edge.client as c\n"
             "from tandem.edge.client import EdgeClient, AsyncEdgeClient\n"
             "from tandem.edge.drafter import load_drafter\n"
             "from tandem.orchestrator.models import fetch\n"
             "from tandem.orchestrator.gateway import chat_page\n"
             "from tandem.orchestrator.cli import parser\n"
             "args = parser().parse_args(['chat', 'hi'])  # options through the settings (TANDEM_MAX_TOKENS)\n"
             "print(json.dumps({'client': c.__file__, 'page': 'DOMPurify' in chat_page.PAGE,\n"
             "    'max_tokens': args.max_tokens, 'errors': [str(e) for e in getattr(args, 'config_errors', [])],\n"
             f"    'absent': [m for m in {SERVER_SIDE!r} if u.find_spec(m) is None]}}))\n")
    got = json.loads(run([str(python), "-c", probe], cwd=outside, timeout=120,
                         env={**os.environ, "TANDEM_MAX_TOKENS": "7"}).stdout)
    assert got["client"].startswith(str(venv)), got  # the wheel's code, not the checkout's
    assert got["page"] and got["max_tokens"] == 7 and not got["errors"], got
    assert got["absent"] == list(SERVER_SIDE), got  # the SDK alone: none of the server's or the suite's packages


@pytest.fixture
def relay():
    """tests/scripted_relay.py: the scripted verifier behind a gateway's WebSocket relay."""
    proc = subprocess.Popen([sys.executable, "scripted_relay.py"], cwd=ROOT / "tests", stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield json.loads(proc.stdout.readline())
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


SESSION = """
import WebSocket from "ws";
import { connect, generate, target } from "@tandem/edge";

const [url, key] = process.argv.slice(2);
const { vocabSize, vocabFingerprint } = await target(url, key);
const transport = await connect(url.replace(/^http/, "ws") + "/v1/edge/session", key, WebSocket);
const countUp = { draft: (committed, depth) => Array.from({ length: depth }, (_, i) => committed.at(-1) + 1 + i) };
const run = generate(transport, countUp, [1, 2, 3], { maxNewTokens: 12, vocabSize, vocabFingerprint,
  decode: (tokens) => tokens.map((t) => `${t} `).join("") });
const tokens = [];
let text = "", stats;
for (;;) {
  const next = await run.next();
  if (next.done) { stats = next.value; break; }
  tokens.push(...next.value.tokens);
  text += next.value.text;
}
console.log(JSON.stringify({ tokens, text, stats }));
"""

TYPES = """
import { ChainPolicy, generate, type Drafter, type Stats, type Transport } from "@tandem/edge";
const drafter: Drafter = { draft: (committed: readonly number[], depth: number) => Array(depth).fill(0) };
export async function answer(transport: Transport): Promise<Stats> {
  const run = generate(transport, drafter, [1], { maxNewTokens: 4, vocabSize: 256, vocabFingerprint: "",
                                                  depth: new ChainPolicy() });
  for (;;) { const next = await run.next(); if (next.done) return next.value; }
}
"""


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> Path:
    """clients/web packed (`npm pack`: prepack builds it) and its tarball installed, with `ws`, into a fresh project
    outside the repository; the tarball's file list is in app/packed.json."""
    if shutil.which("npm") is None:
        pytest.fail("npm is not installed (Node 20+ is needed for clients/web)")
    if not (WEB / "node_modules" / ".bin" / "buf").exists():
        pytest.fail("clients/web has no node_modules: `make web` installs them (npm ci in clients/web)")
    packed = tmp_path_factory.mktemp("packed")
    started = time.time()
    r = run(["npm", "pack", "--json", "--pack-destination", str(packed)], cwd=WEB, timeout=600)
    for built in ("dist/src/index.js", "dist/browser/edge.js", "dist/protos/verifier.proto"):
        assert (WEB / built).stat().st_mtime >= started - 1, f"{built}: packed without building it first"
    info = json.loads(r.stdout[r.stdout.index("["):])[0]
    app = tmp_path_factory.mktemp("app")  # a fresh project, outside the repository
    assert not app.resolve().is_relative_to(ROOT)
    (app / "package.json").write_text(json.dumps({"name": "app", "private": True, "type": "module"}))
    (app / "packed.json").write_text(json.dumps(info))
    lock = json.loads((WEB / "package-lock.json").read_text())["packages"]
    ws = lock["node_modules/ws"]["version"]  # Node 20 has no WebSocket of its own: `ws`, passed to connect
    # (--prefer-offline: the packages `make web` put in npm's cache, the registry only for what is missing)
    run(["npm", "install", "--prefer-offline", "--no-audit", "--no-fund", "--loglevel=error",
         str(packed / info["filename"]), f"ws@{ws}"], cwd=app, timeout=300,
        env={**os.environ, "ONNXRUNTIME_NODE_INSTALL": "skip"})
    return app


def test_npm_pack_ships_the_built_client_its_types_and_the_proto(app):
    info = json.loads((app / "packed.json").read_text())
    assert info["filename"] == "tandem-edge-0.1.0.tgz"  # the name clients/web/README.md installs
    files = {f["path"] for f in info["files"]}
    for need in ("package.json", "README.md", "dist/src/index.js", "dist/src/index.d.ts", "dist/src/session.js",
                 "dist/src/verifier_proto.js", "dist/browser/edge.js", "dist/protos/verifier.proto"):
        assert need in files, (need, sorted(files))
    assert not any(f.startswith(("dist/test/", "src/", "test/", "node_modules/")) for f in files), sorted(files)
    installed = app / "node_modules" / "@tandem" / "edge"
    assert (installed / "dist" / "protos" / "verifier.proto").read_bytes() == \
        (ROOT / "protos" / "verifier.proto").read_bytes()


def test_the_installed_tarball_runs_a_session_against_the_scripted_verifier(app, relay):
    (app / "session.mjs").write_text(SESSION)
    out = json.loads(run(["node", "session.mjs", relay["url"], relay["key"]], cwd=app, timeout=120).stdout)
    assert out["tokens"] == list(range(4, 16))  # the scripted target counts up
    assert out["text"] == "".join(f"{t} " for t in range(4, 16))
    assert out["stats"]["finishReason"] == "length" and out["stats"]["acceptedTokens"] > 0
    # its types: an app's TypeScript compiles against the installed package's declarations
    (app / "check.ts").write_text(TYPES)
    run([str(WEB / "node_modules" / ".bin" / "tsc"), "--noEmit", "--strict", "--target", "es2022", "--module",
         "nodenext", "--moduleResolution", "nodenext", "--lib", "es2022,dom", "check.ts"], cwd=app, timeout=120)


def readme_example() -> str:
    """clients/web/README.md's Node example (the code block that begins `// answer.mjs`), verbatim."""
    text = (WEB / "README.md").read_text()
    blocks = [b.split("\n", 1)[1] for b in text.split("```js")[1:]]
    found = [b[:b.index("```")] for b in blocks if b.startswith("// answer.mjs")]
    assert len(found) == 1, "clients/web/README.md has no `// answer.mjs` example"
    return found[0]


def test_the_readme_example_answers_from_the_installed_tarball(app, tmp_path):
    """clients/web/README.md's example, as written, in the fresh project: the prompt from /tokenize, an edge token,
    the target's vocabulary and tokenizer, the drafter's export from the gateway run by onnxruntime-node, a session
    with `ws`. The gateway relays to the scripted verifier (the target counts up; its tokenizer.json reads token t as
    "t "), and serves a random-weight drafter's export with the target's 256 ids: whatever it drafts, the answer is
    the target's."""
    from types import SimpleNamespace

    from scripted_gateway import KEY, FakeClient, app_server
    from tandem.cloud.engines.scripted_engine import ScriptedEngine
    from tandem.cloud.server import serve
    from tandem.edge.export.onnx_export import export
    from tandem.orchestrator.gateway.config import VerifierLink
    from test_web_client import random_qwen2_gguf

    engine = ScriptedEngine()
    vocab = {("</s>" if t == 255 else f"{t} "): t for t in range(engine.vocab_size)}
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "pre_tokenizer": None,
        "post_processor": None, "decoder": {"type": "Fuse"}, "model": {"type": "WordLevel", "vocab": vocab,
                                                                     "unk_token": "0 "},
        "added_tokens": [{"id": 255, "content": "</s>", "special": True, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False}]}))

    class Gateway(FakeClient):  # the REST side: /tokenize renders [1, 2, 3]; the target's tokenizer.json
        def health(self, timeout_s=5.0):
            return SimpleNamespace(**vars(super().health(timeout_s)), vocab_fingerprint=engine.vocab_fingerprint)

        def target_tokenizer_file(self):
            return tokenizer, SimpleNamespace(vocab_fingerprint=engine.vocab_fingerprint)

    drafter = export(random_qwen2_gguf(tmp_path / "drafter.gguf", vocab=engine.vocab_size), "fp32",
                     cache_root=tmp_path / "onnx", self_contained=True)
    verifier, port = serve(engine, "127.0.0.1:0")
    start, servers = app_server()
    try:
        url = start(Gateway(), verifier=VerifierLink(f"127.0.0.1:{port}"), browser_drafter=drafter)
        (app / "answer.mjs").write_text(readme_example())
        # onnxruntime-node (300 MB, the app's own choice of runtime) from clients/web's install, not a second copy
        runtime = app / "node_modules" / "onnxruntime-node"
        if not runtime.exists():
            runtime.symlink_to(WEB / "node_modules" / "onnxruntime-node", target_is_directory=True)
        r = run(["node", "answer.mjs", "Count up"], cwd=app, timeout=300,
                env={**os.environ, "GATEWAY": url, "TANDEM_API_KEY": KEY})
    finally:
        for server in servers:
            server.should_exit = True
        verifier.stop(grace=None)
    assert r.stdout == "".join(f"{t} " for t in range(4, 255))  # 1 2 3, then the target counts up to its end
    assert "252 tokens" in r.stderr and "(stop)" in r.stderr, r.stderr
