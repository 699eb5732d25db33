"""Shared fixtures. Real-model fixtures fetch the pinned pair into the cache on first use (minutes, once)."""
import os

import pytest

from orchestrator import models

THREADS = max(1, os.cpu_count() or 1)
N_CTX = 2048


@pytest.fixture(scope="session")
def target_path():
    return models.fetch("target")


@pytest.fixture(scope="session")
def drafter_path():
    return models.fetch("drafter")


@pytest.fixture(scope="session")
def engine(target_path):
    from cloud.llama_engine import LlamaVerifierEngine
    return LlamaVerifierEngine(target_path, n_ctx=N_CTX, n_threads=THREADS, max_sessions=6)


@pytest.fixture(scope="session")
def drafter(drafter_path):
    from edge.llama_drafter import LlamaDrafter
    return LlamaDrafter(drafter_path, n_ctx=N_CTX, n_threads=THREADS)


@pytest.fixture(scope="session")
def make_drafter(drafter_path):
    from edge.llama_drafter import LlamaDrafter
    return lambda: LlamaDrafter(drafter_path, n_ctx=N_CTX, n_threads=THREADS)


@pytest.fixture(scope="session")
def server(engine):
    """An in-process verifier on a free port; yields (address, servicer-visible engine)."""
    from cloud.server import serve
    srv, port = serve(engine, "127.0.0.1:0", max_sessions=4)
    yield f"127.0.0.1:{port}"
    srv.stop(grace=None)


@pytest.fixture(scope="session")
def humaneval_chats():
    from bench.prompts import humaneval, humaneval_messages
    return [humaneval_messages(p) for p in humaneval(8)]
