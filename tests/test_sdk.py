"""The client SDK on the real pair: sync and async chat, streaming deltas then stats, early exits closing the
verifier session, one generation per client at a time, and `tandem chat` as an interactive multi-turn terminal."""
import asyncio
import re
import subprocess
import sys
import time

import pytest

from tandem.edge.client import AsyncEdgeClient, EdgeClient, GenerationStats
from tandem.core.tree import TreeShape

pytestmark = pytest.mark.models

MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a string."}]


@pytest.fixture(scope="module")
def client(verifier, make_drafter):
    c = EdgeClient(make_drafter(), verifier[0], TreeShape(1, 4, 4))
    yield c
    c.close()


def wait_idle(backend, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while backend.active_sessions() and time.monotonic() < deadline:
        time.sleep(0.05)
    return backend.active_sessions() == 0


def test_sync_stream_yields_deltas_then_stats(client):
    done = client.chat(MESSAGES, max_new_tokens=16)
    items = list(client.chat(MESSAGES, stream=True, max_new_tokens=16))
    assert isinstance(items[-1], GenerationStats) and all(isinstance(i, str) for i in items[:-1])
    assert "".join(items[:-1]) == done.text and items[-1].generated_tokens == len(done.tokens) == 16


def test_async_chat_matches_sync_and_early_exit_closes_the_session(client, verifier):
    backend = verifier[1]
    expected = client.chat(MESSAGES, max_new_tokens=16).text
    aclient = AsyncEdgeClient(client)

    async def run():
        items = [i async for i in aclient.chat(MESSAGES, stream=True, max_new_tokens=16)]
        result = await aclient.chat(MESSAGES, max_new_tokens=16)
        stream = aclient.chat(MESSAGES, stream=True, max_new_tokens=200)
        async for _ in stream:  # take one delta, then walk away
            break
        await stream.aclose()
        return items, result

    items, result = asyncio.run(run())
    assert "".join(i for i in items if isinstance(i, str)) == expected == result.text
    assert isinstance(items[-1], GenerationStats)
    assert wait_idle(backend), "the abandoned stream's verifier session is still open"


def test_one_generation_per_client(client, verifier):
    prompt = client.prompt_tokens(MESSAGES)
    first = client.generate(prompt, max_new_tokens=64)
    next(iter(first))
    with pytest.raises(RuntimeError, match="already generating"):
        next(iter(client.generate(prompt, max_new_tokens=4)))
    first.cancel()
    assert wait_idle(verifier[1])
    assert len(client.generate(prompt, max_new_tokens=4).result().tokens) == 4  # usable again


def test_interactive_terminal_chat_keeps_the_conversation(verifier, drafter_path):
    out = subprocess.run([sys.executable, "-m", "tandem.orchestrator.cli", "chat", "--server", verifier[0], "--drafter",
                          str(drafter_path), "--max-tokens", "6", "--tree", "1,3,3", "--stats", "--n-ctx", "2048"],
                         input="Say hello.\n/reset\nSay hello.\nAnd again?\n/quit\n", capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    prompts = [int(p) for p in re.findall(r"-- 6 tokens \(prompt (\d+)\)", out.stdout)]
    assert len(prompts) == 3, out.stdout
    assert prompts[0] == prompts[1]  # /reset forgot the first exchange
    assert prompts[2] > prompts[1] + 6  # the third turn carries the second question and its answer


def test_ctrl_c_stops_the_answer_and_the_conversation_goes_on(verifier, drafter_path):
    """A real Ctrl-C (SIGINT) in the middle of a long answer: it stops there, the marker says so, the next turn
    carries the part shown, and the chat ends on Ctrl-D (end of input) with status 0."""
    import os
    import select
    import signal
    from tandem.core import lifetime
    proc = lifetime.spawn([sys.executable, "-m", "tandem.orchestrator.cli", "chat", "--verifier", verifier[0],
                           "--drafter", str(drafter_path), "--max-tokens", "400", "--tree", "1,3,3", "--stats",
                           "--n-ctx", "2048"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
    out = b""

    def read_until(marker: bytes, timeout_s: float = 240) -> None:
        nonlocal out
        deadline = time.monotonic() + timeout_s
        while marker not in out:
            assert time.monotonic() < deadline and proc.poll() is None, out.decode(errors="replace")
            if select.select([proc.stdout], [], [], 0.5)[0]:
                out += os.read(proc.stdout.fileno(), 4096)

    try:
        proc.stdin.write(b"Write a long Python module with ten functions, each with a docstring.\n")
        proc.stdin.flush()
        read_until(b"def ")  # answering now
        proc.send_signal(signal.SIGINT)
        read_until(b"[stopped: Ctrl-C", timeout_s=60)  # at the next token: well before 400
        proc.stdin.write(b"Say hello.\n")
        proc.stdin.close()  # Ctrl-D after it
        assert proc.wait(timeout=240) == 0, proc.stderr.read().decode()
        out += proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.decode()
    stopped = re.search(r"-- (\d+) tokens \(prompt (\d+)\).*finish: stopped", text)
    assert stopped and int(stopped.group(1)) < 400, text  # stopped long before --max-tokens
    second = [int(p) for p in re.findall(r"-- \d+ tokens \(prompt (\d+)\)", text)]
    assert len(second) == 2 and second[1] > int(stopped.group(2)) + int(stopped.group(1)) // 2, text  # kept


def test_the_client_drafts_under_the_policy_unless_given_a_shape():
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.planner import FixedPlanner
    from tandem.edge.policy import DraftPolicy
    assert isinstance(EdgeClient(object(), "127.0.0.1:1").planner, DraftPolicy)  # the benches' best, not a tree
    fixed = EdgeClient(object(), "127.0.0.1:1", TreeShape(1, 4, 4), stream=False).planner
    assert isinstance(fixed, FixedPlanner)
    assert isinstance(EdgeClient(object(), "127.0.0.1:1", None).planner, FixedPlanner)
    with pytest.raises(ValueError, match="policy"):
        EdgeClient(object(), "127.0.0.1:1", "adaptive")


def test_the_device_side_openai_endpoint_needs_only_the_gateway_extra():
    """`tandem serve --verifier HOST:PORT` on a device: the gateway, the edge client and the policy import without
    what only a verifier needs (the `gateway` extra leaves those packages out)."""
    import subprocess
    import sys
    code = ("import sys\n"
            "for m in ('llguidance', 'gguf', 'grpc_health', 'torch', 'transformers', 'ray', 'onnxruntime'):\n"
            "    sys.modules[m] = None\n"
            "import tandem.orchestrator.cli, tandem.cloud.server, tandem.orchestrator.gateway.serving\n"
            "import tandem.edge.client, tandem.edge.llama_drafter, tandem.edge.policy\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_cancelling_a_non_streaming_async_chat_closes_its_session(client, verifier):
    backend = verifier[1]

    async def run():
        async with AsyncEdgeClient(client) as aclient:
            task = asyncio.create_task(aclient.chat(MESSAGES, max_new_tokens=400))
            while not backend.active_sessions():  # the loop stays free while the answer is generated
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(asyncio.wait_for(run(), 120))
    assert wait_idle(backend), "the cancelled answer's verifier session is still open"


def test_connect_builds_a_paired_client_with_defaults_and_closes_with_with(verifier, drafter_path):
    from tandem.orchestrator.sdk import connect
    from tandem.edge.policy import DraftPolicy
    with connect(verifier[0], drafter_path) as c:
        assert isinstance(c.planner, DraftPolicy)
        assert len(c.chat(MESSAGES, max_new_tokens=8).tokens) == 8
    with pytest.raises(ValueError):  # the channel is closed
        c.health()


@pytest.mark.parametrize("name, standard", [
    ("tandem.edge.client:RemoteError", RuntimeError), ("tandem.edge.rounds:ProtocolError", RuntimeError),
    ("tandem.core.chat_template:TemplateError", ValueError), ("tandem.core.sampling:SamplingError", ValueError),
    ("tandem.core.llama_cpu:LlamaError", RuntimeError), ("tandem.orchestrator.models:ModelError", RuntimeError),
    ("tandem.orchestrator.settings:ConfigError", ValueError), ("tandem.cloud.session:VerifierError", Exception),
])
def test_every_error_shares_one_base_and_keeps_its_standard_one(name, standard):
    import importlib

    from tandem.core.errors import TandemError
    module, cls = name.split(":")
    error = getattr(importlib.import_module(module), cls)
    assert issubclass(error, TandemError) and issubclass(error, standard)
