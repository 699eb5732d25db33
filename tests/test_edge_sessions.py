"""The session protocol over WebSocket (/v1/edge/session) and the edge tokens that open it: the relayed session says
exactly what the gRPC one says, a token carries its key's partition and its own limits, and every bad credential or
message ends the session with the gRPC status code it would have had (4000 + code) before the verifier is asked."""
import json
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

import protocol_examples as ex
from scripted_gateway import KEY, FakeClient
from tandem.cloud.scripted_engine import ScriptedEngine
from tandem.cloud.server import serve
from tandem.core import tenancy
from tandem.orchestrator.gateway import edge_tokens
from tandem.orchestrator.gateway.serving import VerifierLink
from tandem.protos import verifier_pb2 as pb

SECRET = b"s" * 32


class Partitioned(ScriptedEngine):
    """The scripted target, recording the cache partition of each prefill."""

    def __init__(self):
        super().__init__()
        self.partitions: list[str] = []

    def prefill(self, seq, tokens, generated=0, partition=""):
        self.partitions.append(partition)
        super().prefill(seq, tokens, generated, partition)


@pytest.fixture(scope="module")
def verifier():
    engine = Partitioned()
    server, port = serve(engine, "127.0.0.1:0")
    yield engine, f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture
def gateway(serve_app, verifier):
    url = serve_app(FakeClient(), verifier=VerifierLink(verifier[1]), salt_secret=SECRET)
    return url, url.replace("http://", "ws://") + "/v1/edge/session"


def token(url, key=KEY, **limits):
    r = httpx.post(f"{url}/v1/edge-tokens", headers={"Authorization": f"Bearer {key}"}, json=limits, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def exchange(ws_url, credential, requests):
    """Send each (request, answers) and read the answers; every message as the recordings write it."""
    out, session = [], ""
    with connect(ws_url, subprotocols=["tandem.v1", "bearer." + credential], open_timeout=10) as ws:
        assert ws.subprotocol == "tandem.v1"
        for request, answers in requests:
            for field in ("draft", "close"):
                if request.HasField(field):
                    getattr(request, field).session_id = session
            ws.send(request.SerializeToString())
            out.append({"client": ex._json(request, session)})
            for _ in range(answers):
                response = pb.SessionResponse.FromString(ws.recv(timeout=10))
                session = session or response.opened.session_id
                out.append({"verifier": ex._json(response, session)})
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    return out, closed.value.rcvd


def closed_with(ws_url, credential, message: bytes | None = None):
    """How the gateway closes a session that offers ``credential`` and sends ``message``: (code, reason)."""
    with connect(ws_url, subprotocols=["tandem.v1", "bearer." + credential], open_timeout=10) as ws:
        with pytest.raises(ConnectionClosed) as closed:  # (the gateway may close before the message is sent)
            if message is not None:
                ws.send(message)
            ws.recv(timeout=10)
    return closed.value.rcvd.code, closed.value.rcvd.reason


def fingerprint(verifier):
    return verifier[0].vocab_fingerprint


def test_a_relayed_session_says_what_the_grpc_one_says_and_runs_in_its_keys_partition(gateway, verifier):
    url, ws_url = gateway
    minted = token(url, ttl_s=60)
    assert minted["scope"] == "session" and minted["expires_at"] > time.time() + 50 and minted["max_sessions"] == 1
    before = len(verifier[0].partitions)
    lines, close = exchange(ws_url, minted["token"], ex.lockstep(fingerprint(verifier)))
    assert lines == ex.recorded("lockstep") and close.code == 1000
    # the session ran as the minting key: the partition the gateway gives that key's REST requests
    expected = tenancy.partition(tenancy.gateway_salt(SECRET, KEY), "")
    assert verifier[0].partitions[before:] == [expected]
    lines, _ = exchange(ws_url, token(url, key="k2")["token"], ex.lockstep(fingerprint(verifier))[:1] +
                        [(pb.SessionRequest(close=pb.Close()), 1)])
    assert verifier[0].partitions[-1] != expected  # another key, another partition


def test_only_the_sessions_of_rest_keys_that_opted_in_may_be_kept_for_distillation(serve_app):
    """The gateway's verifier key opted in (TANDEM_TEACH_KEYS) covers every tenant behind the gateway: the gateway
    marks the Open of every REST key outside its ``teach_keys`` withhold_from_teacher, relayed sessions and REST
    requests alike, and the verifier then keeps nothing of them."""
    from tandem.cloud.backend import LocalBackend
    from tandem.cloud.scripted_engine import ScriptedEngine
    from tandem.core.auth import ApiKeys
    kept: list[bool] = []

    class Recording(LocalBackend):
        async def open(self, req):
            kept.append(req.teach)  # what the servicer resolved: the key's opt-in, less the request's withholding
            return await super().open(req)

    engine = ScriptedEngine()
    server, port = serve(backend=Recording(engine), address="127.0.0.1:0", keys=ApiKeys.of(["gw"]),
                         teach=ApiKeys.of(["gw"]))
    try:
        client = FakeClient()
        for teach_keys, want in ((ApiKeys.of(["k2"]), [False, True]), (ApiKeys(), [False, False])):
            url = serve_app(client, verifier=VerifierLink(f"127.0.0.1:{port}", key="gw"), salt_secret=SECRET,
                            teach_keys=teach_keys)
            kept.clear()
            for key, may_keep in zip((KEY, "k2"), want):
                exchange(url.replace("http://", "ws://") + "/v1/edge/session", token(url, key=key)["token"],
                         ex.lockstep(engine.vocab_fingerprint)[:1] + [(pb.SessionRequest(close=pb.Close()), 1)])
                r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
                assert r.status_code == 200 and client.calls[-1]["withhold_from_teacher"] == (not may_keep)
            assert kept == want  # (relayed sessions)
    finally:
        server.stop(grace=None)


def test_a_token_caps_new_tokens_and_sessions(gateway, verifier):
    url, ws_url = gateway
    minted = token(url, max_new_tokens=5, max_sessions=1)
    opening = ex.lockstep(fingerprint(verifier))[0][0]  # asks for 16 new tokens
    with connect(ws_url, subprotocols=["tandem.v1", "bearer." + minted["token"]]) as first:
        first.send(opening.SerializeToString())
        opened = pb.SessionResponse.FromString(first.recv(timeout=10)).opened
        assert opened.limits.max_new_tokens == 5
        code, reason = closed_with(ws_url, minted["token"], opening.SerializeToString())  # a second at once
        assert code == 4008 and "already has its 1 sessions open" in reason
        first.send(pb.SessionRequest(close=pb.Close(session_id=opened.session_id)).SerializeToString())
        assert pb.SessionResponse.FromString(first.recv(timeout=10)).HasField("closed")
    deadline = time.monotonic() + 5
    while True:  # the first has ended: its slot comes free as the gateway finishes with it
        with connect(ws_url, subprotocols=["tandem.v1", "bearer." + minted["token"]]) as again:
            try:
                again.send(opening.SerializeToString())
                assert pb.SessionResponse.FromString(again.recv(timeout=10)).HasField("opened")
                break
            except ConnectionClosed as e:
                assert e.rcvd.code == 4008 and time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("credential, fragment", [  # (tokens are minted when the test runs: they expire)
    (lambda: "", "missing or invalid credential"),
    (lambda: "not-a-key", "missing or invalid credential"),
    (lambda: edge_tokens.mint(b"another secret" * 3, KEY, time.time(), 60, 1, 10)[0], "not valid here"),
    (lambda: edge_tokens.mint(SECRET, KEY, time.time() - 120, 60, 1, 10)[0], "expired"),
    (lambda: edge_tokens.mint(SECRET, "a key this gateway does not serve", time.time(), 60, 1, 10)[0],
     "no longer served"),
], ids=["none", "unknown key", "foreign secret", "expired", "orphaned"])
def test_a_bad_credential_is_refused_before_any_message(gateway, credential, fragment):
    credential = credential()
    code, reason = closed_with(gateway[1], credential)
    assert code == 4016 and fragment in reason


@pytest.mark.parametrize("message, fragment", [
    (b"\xff\xff\xff", "not a serialized tandem.v1.SessionRequest"),
    (pb.SessionRequest(draft=pb.Draft(committed_len=3)).SerializeToString(), "first message of a session must be Open"),
    (b"\x0a" + b"\x00" * (1 << 20), "over 1048576"),
    ("a text frame", "binary messages only"),
])
def test_a_bad_first_message_is_invalid_argument(gateway, message, fragment):
    code, reason = closed_with(gateway[1], KEY, message)  # (an API key opens a session too)
    assert code == 4003 and fragment in reason


def test_the_verifiers_own_refusal_reaches_the_device_as_its_status(gateway):
    opening = pb.SessionRequest(open=pb.Open(vocab_size=256, vocab_fingerprint="wrong", prompt_tokens=[1, 2]))
    code, reason = closed_with(gateway[1], KEY, opening.SerializeToString())
    assert code == 4009 and "fingerprint" in reason  # FAILED_PRECONDITION


def test_tokens_open_sessions_only(gateway):
    url, _ = gateway
    minted = token(url)["token"]
    for path, body in (("/v1/models", None), ("/v1/edge-tokens", {})):
        r = httpx.request("POST" if body is not None else "GET", f"{url}{path}", json=body,
                          headers={"Authorization": f"Bearer {minted}"})
        assert r.status_code == 401
    bad = httpx.post(f"{url}/v1/edge-tokens", headers={"Authorization": f"Bearer {KEY}"}, json={"ttl_s": 10**6})
    assert bad.status_code == 400 and "ttl_s" in json.loads(bad.text)["error"]["message"]


@pytest.mark.parametrize("ttl_s, sessions, new_tokens, fragment", [
    (0, 1, 10, "ttl_s"), (edge_tokens.MAX_TTL_S + 1, 1, 10, "ttl_s"), (60, 0, 10, "max_sessions"),
    (60, edge_tokens.MAX_SESSIONS + 1, 10, "max_sessions"), (60, 1, 0, "max_new_tokens"),
])
def test_mint_refuses_limits_out_of_range(ttl_s, sessions, new_tokens, fragment):
    with pytest.raises(edge_tokens.TokenError, match=fragment):
        edge_tokens.mint(SECRET, KEY, 0.0, ttl_s, sessions, new_tokens)


def test_a_token_round_trips_and_any_change_breaks_it():
    tok, claims = edge_tokens.mint(SECRET, KEY, 1000.0, 60, 2, 30)
    assert edge_tokens.verify(SECRET, tok, 1059.0) == claims and claims.key_digest == edge_tokens.key_digest(KEY)
    with pytest.raises(edge_tokens.TokenError, match="expired"):
        edge_tokens.verify(SECRET, tok, 1060.0)
    prefix, body, mac = tok.split(".")
    forged = json.loads(edge_tokens._unb64(body)) | {"s": 64}
    for bad in (f"{prefix}.{edge_tokens._b64(json.dumps(forged).encode())}.{mac}", tok[:-2], "te1.x", KEY):
        with pytest.raises(edge_tokens.TokenError):
            edge_tokens.verify(SECRET, bad, 1001.0)


def test_a_verifier_that_is_down_is_unavailable_to_the_device(serve_app):
    import socket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    url = serve_app(FakeClient(), verifier=VerifierLink(dead), salt_secret=SECRET)
    opening = pb.SessionRequest(open=pb.Open(vocab_size=256, prompt_tokens=[1, 2]))
    code, _ = closed_with(url.replace("http://", "ws://") + "/v1/edge/session", KEY, opening.SerializeToString())
    assert code == 4014  # UNAVAILABLE: the device may retry, or resume elsewhere


def test_a_device_learns_the_target_with_its_token_and_nothing_of_the_load(gateway, verifier):
    url, _ = gateway
    minted = token(url)["token"]
    got = httpx.get(f"{url}/v1/edge/target", headers={"Authorization": f"Bearer {minted}"}, timeout=10)
    assert got.status_code == 200
    body = got.json()
    assert (body["vocabFingerprint"], body["vocabSize"], body["targetModel"]) == (
        verifier[0].vocab_fingerprint, 256, "scripted-count-up")
    assert not {"activeSessions", "maxSessions", "draining"} & set(body)  # every tenant's traffic: not a device's
    for bad in ("", "Bearer nope", f"Bearer {minted[:-3]}"):
        for path in ("/v1/edge/target", "/v1/edge/tokenizer"):  # (the tokenizer itself: tests/test_gguf_tokenizer)
            assert httpx.get(f"{url}{path}", headers={"Authorization": bad}).status_code == 401
