"""Shared fixtures. Real-model fixtures fetch the pinned pair into the cache on first use (minutes, once)."""
import os
import re
from pathlib import Path

import pytest

from tandem.orchestrator import models

THREADS = max(1, os.cpu_count() or 1)
N_CTX = 2048


@pytest.fixture(scope="session")
def target_path():
    return models.fetch("target")


@pytest.fixture(scope="session")
def drafter_path():
    """The default drafter, and its ONNX export (the default engine's, ~30 s once, cached): made here, before the
    first test that starts a command with default options, not inside that command's time limits."""
    from tandem.edge.export.onnx_export import export
    path = models.fetch("drafter")
    export(path)
    return path


@pytest.fixture(scope="session")
def engine(target_path):
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    # no prefix cache: the exact tests compare sessions that must compute the same prompt the same way (a cached
    # prefix is a different computation, equal up to rounding); tests/test_prefix_cache.py runs one with it
    # (every forward checks every cell of its sessions: a KV bug fails the test that causes it, loudly)
    return LlamaVerifierEngine(target_path, n_ctx=N_CTX, n_threads=THREADS, max_sessions=6, check_cells="full")


@pytest.fixture(scope="session")
def torch05_base(drafter_path):
    """The real Qwen2.5-Coder-0.5B GGUF through the torch engine's own loader (transformers' GGUF loader,
    dequantised, float32 on CPU): ~45 s, so once; engines with other settings wrap its model (or a copy of it)."""
    pytest.importorskip("transformers")
    from tandem.cloud.engines.torch_engine import TorchVerifierEngine
    return TorchVerifierEngine(drafter_path, n_ctx=1024, device="cpu")


@pytest.fixture(scope="session")
def shared_drafter(drafter_path):
    from tandem.edge.llama_drafter import LlamaDrafter
    return LlamaDrafter(drafter_path, n_ctx=N_CTX, n_threads=THREADS)


@pytest.fixture
def drafter(shared_drafter):
    """The session's drafter, idle: an earlier test's generation may have left its last job running."""
    from tandem.edge.client import wait_idle
    wait_idle(shared_drafter)
    return shared_drafter


@pytest.fixture(scope="session")
def make_drafter(drafter_path):
    from tandem.edge.llama_drafter import LlamaDrafter
    return lambda: LlamaDrafter(drafter_path, n_ctx=N_CTX, n_threads=THREADS)


@pytest.fixture(scope="session")
def verifier(engine):
    """An in-process verifier (engine loop with batching) on a free port: (address, backend)."""
    from tandem.cloud.backend import LocalBackend
    from tandem.cloud.server import serve
    backend = LocalBackend(engine, max_sessions=4)
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    yield f"127.0.0.1:{port}", backend
    srv.stop(grace=None)
    backend.scheduler.stop()


@pytest.fixture(scope="session")
def server(verifier):
    return verifier[0]


@pytest.fixture(scope="session")
def humaneval_chats():
    from tandem.orchestrator.datasets import humaneval, humaneval_messages
    return [humaneval_messages(p) for p in humaneval(8)]


GREEDY_TOKENS = 64  # a target greedy reference is decoded for at least this many tokens, so that shorter asks reuse it


@pytest.fixture(scope="session")
def target_greedy(engine):
    """``reference.greedy`` on the suite's shared target engine, decoded once per prompt: many tests judge answers
    on the same HumanEval prompts, and a 1.5B greedy reference takes seconds here. A reference decoded for more
    tokens is the same decode up to any shorter length (``Reference.head``); decoding it again would differ only by
    batch-shape noise from where other sessions sit in the cache, which every verdict tolerates. Tests of the decode
    itself (its timing, its ownership) call ``reference.greedy``."""
    from tandem.cloud import reference
    made: dict = {}

    def greedy(on, prompt, max_new_tokens: int):
        if on is not engine:
            raise ValueError("target_greedy keeps the shared engine's references; call reference.greedy for others")
        key = tuple(prompt)
        ref, n = made.get(key, (None, 0))
        if ref is None or max_new_tokens > n:
            n = max(max_new_tokens, GREEDY_TOKENS)
            ref = reference.greedy(engine, prompt, n)
            made[key] = (ref, n)
        return ref.head(max_new_tokens)

    return greedy


@pytest.fixture(scope="session")
def noise(engine, humaneval_chats, target_greedy):
    """The engine's batch-shape noise (max |logit delta| between batch shapes, with the swaps it makes) measured on
    two real prompts, on one-token forwards beside other sessions: not through the tree forwards it judges."""
    from tandem.cloud import reference
    measured = []
    for chat in humaneval_chats[:2]:
        prompt = engine.model.tokenize(engine.model.chat_prompt(chat))
        measured.append(reference.batch_shape_noise(engine, prompt, target_greedy(engine, prompt, 8).tokens))
    noise = reference.Noise.of(measured)
    assert 0 < noise < 1.0, f"batch-shape noise {noise} is outside what this engine is known to produce"
    return noise


@pytest.fixture(scope="session")
def cert(tmp_path_factory):
    """A self-signed certificate for localhost / 127.0.0.1: (cert.pem, key.pem)."""
    import subprocess
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


# What `make test-fast` leaves out (``-m "not models and not ray and not browser and not slow"``), marked here from
# what a test uses, so that no test has to remember its own marker: the real pair (these fixtures load or fetch it),
# a Ray cluster, a real browser; and the modules of minutes on tiny models (chi-squared tests of sampled
# distributions through the stack, LoRA distillation).
MODEL_FIXTURES = {"target_path", "drafter_path", "engine", "torch05_base", "shared_drafter", "drafter", "make_drafter",
                  "verifier", "server", "target_greedy", "noise"}
RAY = re.compile(r"^\s*(import ray|from ray\b)|\bray\.init\(|tandem\.cloud\.pool\b", re.M)
BROWSER = re.compile(r"\bplaywright\b|\bchromium\b")
SLOW_MODULES = {"test_distribution", "test_online"}


def _module_marks(path) -> set[str]:
    text = Path(path).read_text()
    return {m for m, rx in (("ray", RAY), ("browser", BROWSER)) if rx.search(text)}


def pytest_collection_modifyitems(session, config, items):
    """Marks (above); and the Ray pool tests run first: a local Ray must start its raylet within Ray's fixed
    window, which a long, loaded test process can miss."""
    by_module: dict = {}
    for item in items:
        path = item.module.__file__
        if path not in by_module:
            by_module[path] = _module_marks(path)
        for mark in sorted(by_module[path]):
            item.add_marker(mark)
        if item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker("slow")
        if MODEL_FIXTURES & set(item.fixturenames):
            item.add_marker("models")
    items.sort(key=lambda item: 0 if item.module.__name__.endswith("test_pool") else 1)


@pytest.fixture
def serve_app():
    """``serve_app(client, **GatewayConfig fields)``: a REST gateway on a scripted client, its URL."""
    from scripted_gateway import app_server
    start, servers = app_server()
    yield start
    for s in servers:
        s.should_exit = True
