"""API keys (constant-time, env/file), the auth-off-loopback rule, gRPC auth + TLS on a scripted verifier, and
configuration through TANDEM_* environment variables."""
import queue

import grpc
import pytest

from tandem.cloud.server import serve
from tandem.orchestrator import cli
from tandem.core.auth import ApiKeys, AuthConfigError, Tls, channel, is_loopback, require_auth_off_loopback
from tandem.protos import verifier_pb2 as pb
from tandem.protos import verifier_pb2_grpc as pb_grpc

from scripted import ScriptedEngine, succ


@pytest.mark.parametrize("presented,ok", [
    ("Bearer k-one", True), ("bearer k-two", True), ("k-one", True),
    ("Bearer k-on", False), ("Bearer k-one ", True), ("", False), (None, False), ("Bearer ", False),
])
def test_key_check(presented, ok):
    assert ApiKeys.of(["k-one", "k-two"]).check(presented) is ok


def test_keys_from_env_and_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# operators\nk-file  # laptop\n\n")
    keys = ApiKeys.from_env({"TANDEM_API_KEYS": "k-a, k-b,", "TANDEM_API_KEYS_FILE": str(f)})
    assert keys.keys == (b"k-a", b"k-b", b"k-file")
    assert not ApiKeys.from_env({}).enabled and ApiKeys.from_env({}).check(None)  # off: everything passes
    with pytest.raises(AuthConfigError, match="cannot read TANDEM_API_KEYS_FILE"):
        ApiKeys.from_env({"TANDEM_API_KEYS_FILE": str(tmp_path / "missing")})


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                           ("0.0.0.0", False), ("", False), ("10.0.0.5", False),
                                           ("verifier", False)])
def test_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_auth_may_be_off_only_on_loopback():
    require_auth_off_loopback("127.0.0.1", ApiKeys())
    require_auth_off_loopback("0.0.0.0", ApiKeys.of(["k"]))
    require_auth_off_loopback("0.0.0.0", ApiKeys(), allow_unauthenticated=True)
    with pytest.raises(AuthConfigError, match="refusing to serve on 0.0.0.0 without API keys"):
        require_auth_off_loopback("0.0.0.0", ApiKeys())


def test_serve_refuses_to_start_off_loopback_without_keys(capsys, monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEYS", raising=False)
    monkeypatch.delenv("TANDEM_API_KEYS_FILE", raising=False)
    assert cli.main(["serve", "--host", "0.0.0.0"]) == 2
    assert "without API keys" in capsys.readouterr().err


@pytest.fixture
def no_keys(monkeypatch):
    for name in ("API_KEYS", "VERIFIER_KEYS", "GATEWAY_KEYS", "TEACH_KEYS", "REST_TEACH_KEYS", "SALT_SECRET"):
        monkeypatch.delenv(f"TANDEM_{name}", raising=False)
        monkeypatch.delenv(f"TANDEM_{name}_FILE", raising=False)
    return monkeypatch


def test_a_tenant_opts_in_only_by_a_key_the_verifier_checks(capsys, no_keys):
    """TANDEM_TEACH_KEYS without TANDEM_VERIFIER_KEYS left the verifier keyless: anyone presenting the teach key
    would have landed in its partition and adapter."""
    no_keys.setenv("TANDEM_TEACH_KEYS", "k1")
    assert cli.main(["serve", "--engine", "scripted", "--teacher-mb", "1", "--http-port", "0"]) == 2
    assert "TANDEM_TEACH_KEYS names keys that are not verifier keys" in capsys.readouterr().err


def test_a_verifier_with_tenants_but_no_way_in_is_a_configuration_error(capsys, no_keys):
    no_keys.setenv("TANDEM_API_KEYS", "a,b")
    assert cli.main(["serve", "--engine", "scripted", "--http-port", "0"]) == 2
    assert "would accept nobody" in capsys.readouterr().err


@pytest.mark.parametrize("plane", ["grpc", "http"])
def test_serve_on_a_port_in_use_fails_at_once_naming_it(plane, capsys, no_keys):
    import socket
    import time
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        used = held.getsockname()[1]
        ports = ["--port", str(used), "--http-port", "0"] if plane == "grpc" else ["--port", "0", "--http-port",
                                                                                   str(used)]
        t0 = time.monotonic()
        assert cli.main(["serve", "--engine", "scripted", *ports]) == 2
        assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"127.0.0.1:{used}" in err[0] and "in use" in err[0], err


def test_env_configures_the_cli(monkeypatch):
    monkeypatch.setenv("TANDEM_PORT", "6123")
    monkeypatch.setenv("TANDEM_HTTP_HOST", "0.0.0.0")
    monkeypatch.setenv("TANDEM_ALLOW_UNAUTHENTICATED", "true")
    args = cli.parser().parse_args(["serve"])
    assert (args.port, args.http_host, args.allow_unauthenticated) == (6123, "0.0.0.0", True)
    assert args.http_port == 8000  # untouched default
    assert "TANDEM_GATEWAY_DRAFTERS" in cli.env_keys()


def open_session(ch, metadata=()):
    reqs = queue.SimpleQueue()
    responses = pb_grpc.VerifierStub(ch).Session(iter(reqs.get, None), timeout=10, metadata=metadata)
    reqs.put(pb.SessionRequest(open=pb.Open(prompt_tokens=[1, 2], limits=pb.Limits(max_new_tokens=4))))
    try:
        return next(responses).opened
    finally:
        reqs.put(None)
        responses.cancel()


def test_grpc_needs_the_key_and_speaks_tls(cert):
    server, port = serve(ScriptedEngine(succ), "127.0.0.1:0", keys=ApiKeys.of(["sekrit"]),
                         tls=Tls(cert[0], cert[1]))
    try:
        with channel(f"127.0.0.1:{port}", cert[0]) as ch:
            assert open_session(ch, (("authorization", "Bearer sekrit"),)).session_id
            with pytest.raises(grpc.RpcError) as e:
                open_session(ch, (("authorization", "Bearer wrong"),))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                open_session(ch)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Health stays open for liveness probes, its load figures for key holders only
            keyless = pb_grpc.VerifierStub(ch).Health(pb.HealthRequest(), timeout=5)
            keyed = pb_grpc.VerifierStub(ch).Health(pb.HealthRequest(), timeout=5,
                                                     metadata=(("authorization", "Bearer sekrit"),))
            assert keyless.target_model == keyed.target_model == "m"
            assert (keyless.active_sessions, keyless.max_sessions) == (0, 0) and keyed.max_sessions == 8
        with channel(f"127.0.0.1:{port}") as plain:  # plaintext against a TLS port never gets through
            with pytest.raises(grpc.RpcError) as e:
                open_session(plain, (("authorization", "Bearer sekrit"),))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # the publicly trusted roots (no CA file): TLS is spoken, and this self-signed certificate is not trusted
        with channel(f"127.0.0.1:{port}", "system", server_name="localhost") as public:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.VerifierStub(public).Health(pb.HealthRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace=None)


def test_the_standard_grpc_health_service_is_open_and_follows_draining():
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    server, port = serve(ScriptedEngine(succ), "127.0.0.1:0", keys=ApiKeys.of(["sekrit"]))
    try:
        with channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for service in ("", "tandem.v1.Verifier"):  # no key needed: load balancers and probes have none
                got = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert got.status == health_pb2.HealthCheckResponse.SERVING
            assert server.drain(0.0) == 0
            got = stub.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Verifier"), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize("address, ca, how", [
    ("127.0.0.1:50051", None, "none"),  # this machine: plaintext unless asked
    ("[::1]:50051", "", "none"),
    ("localhost:50051", None, "none"),
    ("verifier.example:50051", None, "system"),  # anywhere else: TLS with the trusted roots by default
    ("dns:///verifier.example:443", None, "system"),
    ("10.0.0.7:50051", None, "system"),
    ("10.0.0.7:50051", "none", "none"),  # plaintext only when asked for
    ("127.0.0.1:50051", "ca.pem", "ca.pem"),
])
def test_remote_verifiers_get_tls_by_default(address, ca, how):
    from tandem.core.auth import transport
    assert transport(address, ca) == how


K = ApiKeys.of


@pytest.mark.parametrize("verifier, gateways, teach, rest_teach, guarded, given, gateway, want", [
    # nothing configured: the loopback verifier checks nothing, the gateway presents nothing
    ((), (), (), (), False, "", True, ((), (), (), "")),
    # REST keys only: the verifier checks keys all the same and accepts the gateway's internal key alone
    ((), (), (), (), True, "", True, (("new",), ("new",), (), "new")),
    # verifier keys: the internal key besides, exempt from the per-key limits
    (("v",), (), (), (), False, "", True, (("v", "new"), ("new",), (), "new")),
    # a key given to present (TANDEM_VERIFIER_KEY) is accepted, not made
    (("v",), (), (), (), True, "given", True, (("v", "given"), ("given",), (), "given")),
    (("v", "given"), (), (), (), True, "given", True, (("v", "given"), ("given",), (), "given")),
    # gateway keys are verifier keys too; without a gateway here nothing is added to the exempt ones
    ((), ("g",), (), (), False, "", False, (("g", "new"), ("g",), (), "new")),
    # REST tenants opted in: the gateway's sessions may teach (it withholds the others')
    (("v",), (), ("v",), ("r",), True, "", True, (("v", "new"), ("new",), ("v", "new"), "new")),
])
def test_which_keys_a_local_verifier_accepts(verifier, gateways, teach, rest_teach, guarded, given, gateway, want):
    from tandem.orchestrator.serve_keys import local_keys
    got = local_keys(K(verifier), K(gateways), K(teach), K(rest_teach), guarded, given, gateway, lambda: "new")
    as_str = lambda keys: tuple(k.decode() for k in keys.keys)  # noqa: E731
    assert (as_str(got.verifier), as_str(got.exempt), as_str(got.teach), got.gateway_key) == want
    assert got.verifier.enabled or not (guarded or verifier or gateways)  # never keyless once anything is set


def test_has_is_membership_even_when_auth_is_off():
    assert ApiKeys().check("x") and not ApiKeys().has("x")
    assert K(["a"]).has("a") and not K(["a"]).has("b")
