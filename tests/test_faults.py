"""Fault injection on a live stack (tiny random-weight model): a flood of silent streams while Health must answer
within a second, the stream limit, a drain on shutdown (new sessions refused, open ones finish), and a link that
drops mid-generation (the edge resumes through the proxy's restart, and loses, repeats or changes no token)."""
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

torch = pytest.importorskip("torch")

from tandem.cloud import reference  # noqa: E402
from tandem.cloud.backend import LocalBackend  # noqa: E402
from tandem.cloud.engines.pacing import CostCurve, PacedEngine  # noqa: E402
from tandem.cloud.server import StreamLimits, serve  # noqa: E402
from tandem.cloud.engines.torch_engine import TorchVerifierEngine  # noqa: E402
from tandem.core import lifetime  # noqa: E402
from tandem.core.messages import Limits  # noqa: E402
from tandem.core.tree import TreeShape  # noqa: E402
from tandem.edge.client import EdgeClient, RemoteError, health  # noqa: E402
from tandem.protos import verifier_pb2_grpc as pb_grpc  # noqa: E402

from tinystack import TinyDrafter, tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [1, 2, 3, 4, 5, 6]


def stack(ms_per_forward: float = 0.0, **serve_kw):
    """A verifier on the tiny model; with ``ms_per_forward``, every forward takes that long (a slow generation)."""
    engine = TorchVerifierEngine(model=tiny_model(), n_ctx=128, device="cpu", max_sessions=4)
    if ms_per_forward:
        engine = PacedEngine(engine, CostCurve("slow", (1,), (ms_per_forward,)))
    backend = LocalBackend(engine, Limits(0, 8, 4), max_sessions=4)
    srv, port = serve(backend=backend, address="127.0.0.1:0", **serve_kw)
    return srv, backend, f"127.0.0.1:{port}", engine


def test_silent_streams_do_not_starve_health_and_expire():
    # the verifier-wide limit, with the per-key one off (all these keyless streams are one key's; test_tenancy
    # holds that cap)
    srv, backend, address, _ = stack(open_timeout_s=1.5, max_streams=40, limits=StreamLimits(key_pending_streams=0))
    channels, calls = [], []
    try:
        for _ in range(60):  # more than the stream limit, none ever sends Open
            ch = grpc.insecure_channel(address)
            channels.append(ch)
            calls.append(pb_grpc.VerifierStub(ch).Session(iter(queue.SimpleQueue().get, None), timeout=30))
        time.sleep(0.5)
        t0 = time.perf_counter()
        h = health(address, timeout_s=1.0)
        assert time.perf_counter() - t0 < 1.0 and h.active_sessions == 0
        codes = []
        for c in calls:
            try:
                next(c)
            except grpc.RpcError as e:
                codes.append(e.code())
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 20  # over the limit: refused at once
        assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) >= 30  # the silent ones expire: no Open in time
        client = EdgeClient(TinyDrafter(tiny_model()), address, TreeShape(1, 3, 3))
        assert len(client.generate(PROMPT, max_new_tokens=8).result().tokens) == 8  # still serving
        client.close()
    finally:
        for ch in channels:
            ch.close()
        srv.stop(None)
        backend.scheduler.stop()


def test_drain_refuses_new_sessions_and_lets_open_ones_finish():
    srv, backend, address, engine = stack(ms_per_forward=40.0)
    try:
        client = EdgeClient(TinyDrafter(tiny_model()), address, shape=None)
        gen = client.generate(PROMPT, max_new_tokens=40)
        it = iter(gen)
        next(it)  # generating
        left: list = []
        drainer = threading.Thread(target=lambda: left.append(srv.drain(30.0)))
        drainer.start()
        time.sleep(0.3)
        assert health(address).draining
        other = EdgeClient(TinyDrafter(tiny_model()), address, shape=None, max_resumes=0)
        with pytest.raises(RemoteError) as e:
            other.generate(PROMPT, max_new_tokens=4).result()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details
        for _ in it:
            pass
        drainer.join(30)
        assert left == [0] and len(gen.tokens) == 40 and gen.stats.resumes == 0
        assert gen.tokens == reference.greedy(engine, PROMPT, 40).tokens
        client.close()
        other.close()
    finally:
        srv.stop(None)
        backend.scheduler.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proxy(listen: int, upstream: str) -> subprocess.Popen:
    p = lifetime.spawn([sys.executable, "-m", "bench.linkproxy", "--listen", f"127.0.0.1:{listen}", "--upstream",
                        upstream], cwd=ROOT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", listen)) == 0:
                return p
        time.sleep(0.05)
    raise RuntimeError("the link proxy did not start")


def test_a_dropped_link_is_resumed_without_losing_or_repeating_a_token():
    srv, backend, address, engine = stack(ms_per_forward=30.0)
    port = _free_port()
    proxy = _proxy(port, address)
    try:
        client = EdgeClient(TinyDrafter(tiny_model()), f"127.0.0.1:{port}", TreeShape(1, 3, 3), backoff_s=0.5,
                            max_resumes=5)
        gen = client.generate(PROMPT, max_new_tokens=40)
        it = iter(gen)
        for _ in range(10):
            next(it)
        proxy.kill()  # the link drops mid-generation
        proxy.wait()
        proxy = _proxy(port, address)  # and comes back
        for _ in it:
            pass
        assert gen.stats.resumes >= 1 and len(gen.tokens) == 40
        assert gen.tokens == reference.greedy(engine, PROMPT, 40).tokens
        deadline = time.monotonic() + 10
        while backend.active_sessions() and time.monotonic() < deadline:  # the dropped session is freed too
            time.sleep(0.1)
        assert backend.active_sessions() == 0
        client.close()
    finally:
        proxy.kill()
        srv.stop(None)
        backend.scheduler.stop()
