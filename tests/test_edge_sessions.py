"""The session protocol over WebSocket (/v1/edge/session) and the edge tokens that open it: the relayed session says
exactly what the gRPC one says, a token runs in a cache partition of its own (or its subject's devices') with its
own limits, and every bad credential or message ends the session with the gRPC status code it would have had
(4000 + code) before the verifier is asked."""
import json
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

import protocol_examples as ex
from scripted_gateway import KEY, FakeClient
from tandem.cloud.engines.scripted_engine import ScriptedEngine
from tandem.cloud.server import serve
from tandem.core import tenancy
from tandem.orchestrator.gateway import edge_tokens
from tandem.orchestrator.gateway.config import VerifierLink
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


def open_and_close(ws_url, credential, fp, prompt=(1, 2, 3), salt=""):
    """One session that opens on ``prompt`` and closes at once: its Opened."""
    opening = pb.SessionRequest(open=pb.Open(vocab_size=256, vocab_fingerprint=fp, prompt_tokens=list(prompt),
                                             cache_salt=salt))
    with connect(ws_url, subprotocols=["tandem.v1", "bearer." + credential], open_timeout=10) as ws:
        ws.send(opening.SerializeToString())
        opened = pb.SessionResponse.FromString(ws.recv(timeout=10)).opened
        ws.send(pb.SessionRequest(close=pb.Close(session_id=opened.session_id)).SerializeToString())
        while not pb.SessionResponse.FromString(ws.recv(timeout=10)).HasField("closed"):
            pass
    return opened


def test_a_relayed_session_says_what_the_grpc_one_says_and_each_token_has_its_own_partition(gateway, verifier):
    url, ws_url = gateway
    minted = token(url, ttl_s=60)
    assert minted["scope"] == "session" and minted["expires_at"] > time.time() + 50 and minted["max_sessions"] == 1
    assert not minted["share_cache"]
    before = len(verifier[0].partitions)
    lines, close = exchange(ws_url, minted["token"], ex.lockstep(fingerprint(verifier)))
    assert lines == ex.recorded("lockstep") and close.code == 1000
    fp = fingerprint(verifier)
    rest = tenancy.partition(tenancy.gateway_salt(SECRET, KEY), "")  # the key's own REST partition
    open_and_close(ws_url, KEY, fp)  # the key itself, over the socket: its REST partition
    second = token(url)["token"]
    open_and_close(ws_url, second, fp, salt="a salt the device chose")  # (not the device's to choose)
    open_and_close(ws_url, token(url, key="k2")["token"], fp)
    first_p, key_p, second_p, other_p = verifier[0].partitions[before:]
    assert key_p == rest and len({first_p, key_p, second_p, other_p}) == 4  # every token its own, never the key's
    # devices of one user share when the minting call says so, and only then
    shared = [token(url, subject="user-7", share_cache=True) for _ in range(2)]
    assert all(s["share_cache"] for s in shared)
    for s in [*shared, token(url, subject="user-7"), token(url, subject="user-8", share_cache=True)]:
        open_and_close(ws_url, s["token"], fp)
    a, b, unshared, other_user = verifier[0].partitions[-4:]
    assert a == b and len({a, unshared, other_user, first_p, key_p}) == 5
    bad = httpx.post(f"{url}/v1/edge-tokens", headers={"Authorization": f"Bearer {KEY}"}, json={"share_cache": True})
    assert bad.status_code == 400 and "subject" in bad.json()["error"]["message"]


class Remembering(Partitioned):
    """The scripted target with a prefix cache's answer: each prefill reports the prompt tokens an earlier prefill
    of the same partition shared (what cached_tokens says)."""

    def __init__(self):
        super().__init__()
        self.last: dict[str, list[int]] = {}

    def prefill(self, seq, tokens, generated=0, partition=""):
        super().prefill(seq, tokens, generated, partition)
        before, self.last[partition] = self.last.get(partition, []), list(tokens)
        return next((i for i, (a, b) in enumerate(zip(before, tokens)) if a != b), min(len(before), len(tokens)))


def test_a_device_learns_nothing_of_another_devices_prompt(serve_app):
    """The probe of the trust review: device 2 of the same key guesses device 1's prompt token by token and reads
    ``cached_tokens``. It reads 0 for every guess, and so does device 1 about its own history (a token of its own
    partition is told nothing of the cache); an API key, and a subject's devices granted a shared cache, are told."""
    engine = Remembering()
    server, port = serve(engine, "127.0.0.1:0")
    try:
        url = serve_app(FakeClient(), verifier=VerifierLink(f"127.0.0.1:{port}"), salt_secret=SECRET)
        ws_url, fp = url.replace("http://", "ws://") + "/v1/edge/session", engine.vocab_fingerprint
        secret_prompt = [7, 3, 9, 9, 4, 2]
        one, two = token(url)["token"], token(url)["token"]
        assert open_and_close(ws_url, one, fp, secret_prompt).cached_tokens == 0
        for guess in range(8):  # the right guess (4) reads the same as every wrong one
            o = open_and_close(ws_url, two, fp, secret_prompt[:4] + [guess])
            assert (o.cached_tokens, o.prefill_us) == (0, 0)
        assert open_and_close(ws_url, one, fp, secret_prompt).cached_tokens == 0  # (its own: zeroed all the same)
        assert engine.last  # (the verifier did cache: what the device is told is what changed)
        open_and_close(ws_url, KEY, fp, secret_prompt)
        assert open_and_close(ws_url, KEY, fp, secret_prompt).cached_tokens == len(secret_prompt) - 1
        shared = [token(url, subject="u", share_cache=True)["token"] for _ in range(2)]
        open_and_close(ws_url, shared[0], fp, secret_prompt)
        assert open_and_close(ws_url, shared[1], fp, secret_prompt).cached_tokens == len(secret_prompt) - 1
    finally:
        server.stop(grace=None)


def test_a_tokens_slot_is_taken_before_its_open_and_an_open_must_come_soon(serve_app, verifier):
    """Three sockets of a one-session token held silent: the second and third are refused at once, not after
    their Opens; a silent socket is closed DEADLINE_EXCEEDED; and a key's sockets are capped, its tokens' too."""
    url = serve_app(FakeClient(), verifier=VerifierLink(verifier[1]), salt_secret=SECRET, open_timeout_s=1.0,
                    max_websockets_per_key=3)
    ws_url = url.replace("http://", "ws://") + "/v1/edge/session"
    minted = token(url, max_sessions=1)["token"]
    with connect(ws_url, subprotocols=["tandem.v1", "bearer." + minted], open_timeout=10):
        t0 = time.monotonic()
        for _ in range(2):
            code, reason = closed_with(ws_url, minted)
            assert code == 4008 and "already has its 1 sessions open" in reason
        assert time.monotonic() - t0 < 1.0  # refused before any Open was awaited
    t0 = time.monotonic()
    code, reason = closed_with(ws_url, KEY)  # says nothing at all
    assert code == 4004 and "no Open within 1 s" in reason and 0.9 < time.monotonic() - t0 < 5
    held = [connect(ws_url, subprotocols=["tandem.v1", "bearer." + token(url, max_sessions=1)["token"]])
            for _ in range(3)]
    try:
        code, reason = closed_with(ws_url, KEY)
        assert code == 4008 and "3 WebSocket sessions open" in reason
        opened = open_and_close(ws_url, "k2", fingerprint(verifier))  # another key is not held back
        assert opened.session_id
    finally:
        for ws in held:
            ws.close()


def test_a_frame_over_the_body_limit_is_refused_before_it_is_buffered(serve_app, verifier):
    url = serve_app(FakeClient(), verifier=VerifierLink(verifier[1]), salt_secret=SECRET, max_body_bytes=4096)
    ws_url = url.replace("http://", "ws://") + "/v1/edge/session"
    code, _ = closed_with(ws_url, KEY, b"\x0a" + b"\x00" * 4096)
    assert code == 1009  # the server's own "message too big": nothing was read into the application
    opened = open_and_close(ws_url, KEY, fingerprint(verifier))  # a message under the limit still opens
    assert opened.session_id


def test_device_downloads_are_charged_to_the_key(serve_app, tmp_path):
    from tandem.core.quota import KeyLimits
    from tandem.orchestrator.gateway.edge_sessions import DOWNLOAD_COST_TOKENS
    (tmp_path / "model.onnx").write_bytes(b"onnx")
    (tmp_path / "meta.json").write_text("{}")
    url = serve_app(FakeClient(), salt_secret=SECRET, browser_drafter=tmp_path,
                    limits=KeyLimits(tokens_per_minute=DOWNLOAD_COST_TOKENS + 100))
    minted = token(url)["token"]
    got = [httpx.get(f"{url}/v1/edge/drafter/model.onnx", headers={"Authorization": f"Bearer {minted}"}, timeout=10)
           for _ in range(2)]
    assert got[0].status_code == 200 and got[1].status_code == 429 and "Retry-After" in got[1].headers
    other = httpx.get(f"{url}/v1/edge/drafter/model.onnx", headers={"Authorization": "Bearer k2"}, timeout=10)
    assert other.status_code == 200  # another key's budget


def test_only_the_sessions_of_rest_keys_that_opted_in_may_be_kept_for_distillation(serve_app):
    """The gateway's verifier key opted in (TANDEM_TEACH_KEYS) covers every tenant behind the gateway: the gateway
    marks the Open of every REST key outside its ``teach_keys`` withhold_from_teacher, relayed sessions and REST
    requests alike, and the verifier then keeps nothing of them."""
    from tandem.cloud.backend import LocalBackend
    from tandem.cloud.engines.scripted_engine import ScriptedEngine
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
    assert edge_tokens.verify(SECRET, tok, 1059.0) == claims
    assert claims.key_digest == edge_tokens.key_digest(SECRET, KEY)
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


def test_a_token_names_its_key_and_subject_only_under_the_gateways_secret():
    """A device reads its token's claims (base64 JSON): the key and the subject appear as HMACs under the
    gateway's secret, so a guess of either cannot be checked against a token offline."""
    import hashlib
    tok, claims = edge_tokens.mint(SECRET, "a", 0.0, 60, 1, 10, subject="alice@example.com", share_cache=True)
    body = edge_tokens._unb64(tok.split(".")[1]).decode()
    assert "alice" not in body and claims.key_digest in body
    assert claims.key_digest != hashlib.sha256(b"edge-token-key\0a").hexdigest()[:32]
    assert claims.key_digest != edge_tokens.key_digest(b"another secret", "a")
    assert claims.shared == edge_tokens.subject_digest(SECRET, "a", "alice@example.com") != \
        edge_tokens.subject_digest(SECRET, "b", "alice@example.com")  # the same user of another app: not shared
