"""One trace per generation across every hop: an HTTP client's traceparent -> the gateway's request span -> the edge
client's generation -> (gRPC metadata) -> the verifier's session -> its verify rounds. Tiny random-weight stack,
real gateway, real gRPC, OpenTelemetry's SDK with an in-memory exporter."""
import threading
import time

import httpx
import pytest

torch = pytest.importorskip("torch")
otel_sdk = pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from tandem.cloud.backend import LocalBackend  # noqa: E402
from tandem.cloud.server import serve  # noqa: E402
from tandem.cloud.engines.torch_engine import TorchVerifierEngine  # noqa: E402
from tandem.core.auth import ApiKeys  # noqa: E402
from tandem.core.tree import TreeShape  # noqa: E402
from tandem.edge.client import EdgeClient  # noqa: E402
from tandem.orchestrator.gateway.app import create_app  # noqa: E402
from tandem.orchestrator.gateway.config import GatewayConfig  # noqa: E402
from tandem.orchestrator.gateway.drafter_pool import DrafterPool  # noqa: E402

from tinystack import TinyDrafter, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def spans():
    """An in-memory exporter on the process's SDK provider (set here unless something set one already)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, otel_sdk.TracerProvider):
        provider = otel_sdk.TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="module")
def stack():
    import uvicorn
    model = tiny_model()
    backend = LocalBackend(TorchVerifierEngine(model=model, n_ctx=64, device="cpu", max_sessions=2), max_sessions=2)
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    client = EdgeClient(TinyDrafter(model), f"127.0.0.1:{port}", TreeShape(2, 6, 3), stream=False)
    pool = DrafterPool([client])
    app = create_app(pool, GatewayConfig(keys=ApiKeys.of(["k"]), model_name="tiny"))
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=http.run, daemon=True).start()
    while not http.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{http.servers[0].sockets[0].getsockname()[1]}"
    http.should_exit = True
    srv.stop(None)
    backend.scheduler.stop()
    pool.close()


@pytest.mark.parametrize("stream", [False, True])
def test_one_trace_from_the_http_client_to_the_verifier_rounds(spans, stack, stream):
    spans.clear()
    parent = trace.get_tracer("test").start_span("http client")
    ctx = parent.get_span_context()
    traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"
    r = httpx.post(stack + "/v1/completions", headers={"Authorization": "Bearer k", "traceparent": traceparent},
                   json={"model": "tiny", "prompt": [1, 2, 3, 4, 1, 2, 3], "max_tokens": 8, "temperature": 0,
                         "stream": stream}, timeout=60)
    assert r.status_code == 200
    parent.end()
    deadline = time.monotonic() + 10  # the verifier's session span ends when its stream closes
    while time.monotonic() < deadline and not any(s.name == "tandem.verifier.session"
                                                   for s in spans.get_finished_spans()):
        time.sleep(0.05)
    by_name: dict = {}
    for s in spans.get_finished_spans():
        by_name.setdefault(s.name, []).append(s)
    (request,) = by_name["tandem.gateway.request"]
    (generation,) = by_name["tandem.generate"]
    (session,) = by_name["tandem.verifier.session"]
    rounds = by_name["tandem.verifier.verify"]
    # the HTTP client's trace continues (directly, or below the span FastAPI itself opens for the route)
    ours = {s.context.span_id: s for s in spans.get_finished_spans()}
    up = request.parent.span_id
    assert up == ctx.span_id or ours[up].parent.span_id == ctx.span_id
    assert generation.parent.span_id == request.context.span_id
    assert session.parent.span_id == generation.context.span_id  # across gRPC, by metadata
    assert rounds and all(v.parent.span_id == session.context.span_id for v in rounds)
    assert {s.context.trace_id for s in (request, generation, session, *rounds)} == {ctx.trace_id}
    assert generation.attributes["tandem.generated_tokens"] == 8
    assert sum(v.attributes["tandem.accepted"] for v in rounds) + len(rounds) >= 8  # every token has a round
    assert session.kind == trace.SpanKind.SERVER and generation.kind == trace.SpanKind.CLIENT
