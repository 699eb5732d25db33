"""Fuzzing both boundaries (Hypothesis). gRPC: random and mutated SessionRequest streams against a live verifier
(tiny random-weight model); REST: random JSON against the gateway. Properties: every input gets a documented
status within a deadline (never INTERNAL/UNKNOWN, never a 500), the verifier's session count returns to zero, and
a well-behaved session running through all of it commits exactly the target's greedy tokens."""
import itertools
import json
import queue
import threading
import time

import grpc
import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tandem.cloud import reference  # noqa: E402
from tandem.cloud.backend import LocalBackend  # noqa: E402
from tandem.cloud.server import serve  # noqa: E402
from tandem.cloud.engines.torch_engine import TorchVerifierEngine  # noqa: E402
from tandem.core.messages import Limits  # noqa: E402
from tandem.protos import verifier_pb2 as pb  # noqa: E402
from tandem.protos import verifier_pb2_grpc as pb_grpc  # noqa: E402

from tinystack import V, tiny_model  # noqa: E402

DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
              grpc.StatusCode.DEADLINE_EXCEEDED}
PROMPT = [1, 2, 3, 4, 5, 6]


@pytest.fixture(scope="module")
def verifier():
    engine = TorchVerifierEngine(model=tiny_model(), n_ctx=64, device="cpu", max_sessions=4)
    backend = LocalBackend(engine, Limits(0, 8, 4), max_sessions=4)
    srv, port = serve(backend=backend, address="127.0.0.1:0", idle_timeout_s=5.0)
    yield f"127.0.0.1:{port}", backend, engine
    srv.stop(None)
    backend.scheduler.stop()


tokens = st.integers(-3, V + 3)
trees = st.builds(lambda t, p: pb.DraftTree(tokens=t, parents=p),
                  st.lists(tokens, max_size=10), st.lists(st.integers(-2, 10), max_size=10))
opens = st.builds(
    lambda prompt, t, top_p, top_k, seed, new, nodes, depth, steps, vs: pb.Open(
        prompt_tokens=prompt, sampling=pb.SamplingParams(temperature=t, top_p=top_p, top_k=top_k, seed=seed),
        limits=pb.Limits(max_new_tokens=new, max_tree_nodes=nodes, max_tree_depth=depth), decode_steps=steps,
        vocab_size=vs),
    st.lists(tokens, max_size=70), st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.floats(allow_nan=True, width=32), st.integers(0, 100), st.integers(0, 2 ** 64 - 1), st.integers(0, 40),
    st.integers(0, 70), st.integers(0, 20), st.integers(0, 30), st.sampled_from([0, V, V + 1]))
drafts = st.builds(
    lambda sid, cl, tree, steps, seq, assumed, logp: pb.Draft(session_id=sid, committed_len=cl, tree=tree,
                                                              decode_steps=steps, seq=seq, assumed_tokens=assumed,
                                                              node_logprobs=logp),
    st.sampled_from(["SID", "", "nope"]), st.integers(0, 80), trees, st.integers(0, 10), st.integers(0, 5),
    st.lists(tokens, max_size=6),
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=10))  # verify budget scores
messages = st.lists(st.one_of(
    opens.map(lambda m: pb.SessionRequest(open=m)),
    drafts.map(lambda m: pb.SessionRequest(draft=m)),
    st.sampled_from(["SID", "other"]).map(lambda s: pb.SessionRequest(close=pb.Close(session_id=s))),
    st.just(pb.SessionRequest())), min_size=1, max_size=6)


def run_stream(address, msgs, deadline_s=20.0):
    """Send the messages (the real session id substituted for "SID" once known), then half-close; returns the
    status code the stream ended with."""
    with grpc.insecure_channel(address) as ch:
        reqs: queue.SimpleQueue = queue.SimpleQueue()
        responses = pb_grpc.VerifierStub(ch).Session(iter(reqs.get, None), timeout=deadline_s)
        sid = {"id": "SID"}

        def reader():
            try:
                for r in responses:
                    if r.WhichOneof("kind") == "opened":
                        sid["id"] = r.opened.session_id
            except grpc.RpcError:
                pass

        t = threading.Thread(target=reader)
        t.start()
        for m in msgs:
            m = pb.SessionRequest.FromString(m.SerializeToString())
            kind = m.WhichOneof("kind")
            if kind in ("draft", "close") and getattr(m, kind).session_id == "SID":
                time.sleep(0.02)  # let the Opened arrive
                getattr(m, kind).session_id = sid["id"]
            reqs.put(m)
        reqs.put(None)
        t.join(deadline_s + 5)
        assert not t.is_alive(), "the stream did not end within its deadline"
        return responses.code()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=messages)
def test_grpc_streams_get_documented_statuses_and_free_everything(verifier, msgs):
    address, backend, _ = verifier
    code = run_stream(address, msgs)
    assert code in DOCUMENTED, code
    deadline = time.monotonic() + 5
    while backend.active_sessions() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.active_sessions() == 0


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_a_well_behaved_session_is_untouched_by_the_fuzz(verifier):
    """A greedy session generating while random streams hit the same verifier (and batch with it)."""
    from tinystack import TinyDrafter
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    address, backend, engine = verifier
    expected = reference.greedy(engine, PROMPT, 24).tokens
    stop = threading.Event()

    # drawn here, before any thread runs: drawn in the threads, hypothesis sees the client's use of ``random``
    # beside its draws and warns of a strategy using the random module
    streams = [messages.example() for _ in range(40)]

    def noise(offset):
        for i in itertools.count(offset):
            if stop.is_set():
                return
            try:
                run_stream(address, streams[i % len(streams)])
            except Exception:
                pass

    threads = [threading.Thread(target=noise, args=(20 * i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        client = EdgeClient(TinyDrafter(tiny_model()), address, TreeShape(2, 6, 3), stream=False)
        outs = [client.generate(PROMPT, max_new_tokens=24).result().tokens for _ in range(3)]
        client.close()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert all(o == expected for o in outs)


# -- REST -------------------------------------------------------------------------------------------------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=12)
chat_like = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "x", 3]), "messages": json_values | st.just([{"role": "user", "content": "hi"}])},
    optional={"max_tokens": json_values, "temperature": json_values, "top_p": json_values, "stop": json_values,
              "stream": json_values, "n": json_values, "seed": json_values, "tools": json_values,
              "stream_options": json_values})


@pytest.fixture(scope="module")
def gateway_url():
    import uvicorn

    from tandem.core.auth import ApiKeys
    from tandem.orchestrator.gateway.app import create_app
    from tandem.orchestrator.gateway.config import GatewayConfig
    from tandem.orchestrator.gateway.drafter_pool import DrafterPool
    from test_gateway_guard import FakeClient
    app = create_app(DrafterPool([FakeClient()]), GatewayConfig(keys=ApiKeys.of(["k"]), max_body_bytes=4096))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=json_values | chat_like, key=st.sampled_from(["Bearer k", "Bearer nope", "", "k"]))
def test_rest_gets_documented_statuses(gateway_url, body, key):
    headers = {"Authorization": key} if key else {}
    r = httpx.post(gateway_url + "/v1/chat/completions", content=json.dumps(body), headers=headers, timeout=20)
    assert r.status_code in (200, 400, 401, 404, 413, 429), (r.status_code, r.text[:300])
    if r.status_code != 200:
        assert set(r.json()["error"]) >= {"message", "type", "code"}
    if key not in ("Bearer k", "k"):
        assert r.status_code == 401
