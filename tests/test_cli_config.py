"""The commands' options through one settings model each (orchestrator/settings.py, pydantic-settings): flags,
TANDEM_* variables, a --config TOML file (top level or per subcommand), booleans that can be turned off, --version and
`models list`. Precedence: flag > environment > file > default. Errors name their source and value."""
import subprocess
import sys

import pytest

from tandem.orchestrator import cli, cli_args, compose, settings, terminal_chat


@pytest.fixture
def configured(tmp_path, monkeypatch):
    def make(text: str):
        path = tmp_path / "tandem.toml"
        path.write_text(text)
        monkeypatch.setattr(settings.CommandParser, "config", settings.load_config(path))
        ap = cli.parser()
        settings.check_keys(settings.CommandParser.config, ap.known_options())
        return ap
    yield make


def test_precedence_flag_env_file_default(configured, monkeypatch):
    ap = configured('n_ctx = 2048\nhttp-port = 7000\n[serve]\nhttp-port = 9000\nngram = true\n')
    a = ap.parse_args(["serve"])
    assert (a.n_ctx, a.http_port, a.ngram, a.max_sessions) == (2048, 9000, True, 4)  # the table beats top level
    a = ap.parse_args(["serve", "--no-ngram", "--n-ctx", "1024"])
    assert (a.n_ctx, a.ngram) == (1024, False)
    monkeypatch.setenv("TANDEM_N_CTX", "3000")
    monkeypatch.setenv("TANDEM_NGRAM", "off")
    a = configured('n_ctx = 2048\nngram = true\n').parse_args(["serve"])
    assert (a.n_ctx, a.ngram) == (3000, False)


@pytest.mark.parametrize("text, fragment", [
    ("bogus = 1\n", "unknown config keys: bogus"),
    ("[chat]\nhttp-port = 1\n", "unknown config keys: chat.http-port"),  # serve's option, not chat's
    ("[serve]\nn_ctx = 'lots'\n", "config key 'n-ctx'='lots': Input should be a valid integer"),
    ("[serve]\nngram = 'maybe'\n", "config key 'ngram'='maybe': Input should be a valid boolean"),
    ("n_ctx = \n", "config"),  # not TOML
])
def test_bad_config_is_an_error_naming_the_key(configured, text, fragment):
    try:
        errors = configured(text).parse_args(["serve"]).config_errors  # a bad value: the command that has it fails
    except settings.ConfigError as e:  # a file that cannot be read, or a key no command has: every command fails
        errors = [str(e)]
    assert any(fragment in e for e in errors), errors


@pytest.mark.parametrize("key, value", [("TANDEM_NGRAM", "perhaps"), ("TANDEM_N_CTX", "big"), ("TANDEM_PORT", "abc")])
def test_a_bad_variable_fails_the_commands_that_read_it_and_no_other(monkeypatch, capsys, key, value):
    monkeypatch.setenv(key, value)
    assert cli.main(["serve"]) == 2 and f"${key}={value!r}: Input should be" in capsys.readouterr().err
    for other in (["--help"], ["serve", "--help"], ["health", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(other)
        assert e.value.code == 0


def test_the_gateway_only_address_is_not_chats(monkeypatch):
    """TANDEM_VERIFIER is the verifier chat talks to; serve becomes a gateway only with TANDEM_GATEWAY_VERIFIER."""
    monkeypatch.setenv("TANDEM_VERIFIER", "far:50051")
    assert cli.parser().parse_args(["chat"]).verifier == "far:50051"
    assert cli.parser().parse_args(["serve"]).verifier == ""
    monkeypatch.setenv("TANDEM_GATEWAY_VERIFIER", "pool:50051")
    assert cli.parser().parse_args(["serve"]).verifier == "pool:50051"


def test_version_models_list_and_config_errors_from_the_command(tmp_path):
    run = [sys.executable, "-m", "tandem.orchestrator.cli"]
    out = subprocess.run(run + ["--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("tandem ")
    ls = subprocess.run(run + ["models", "list"], capture_output=True, text=True, timeout=60,
                        env={"TANDEM_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert ls.returncode == 0 and "not fetched" in ls.stdout and "target" in ls.stdout and "drafter" in ls.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("bogus = 1\n")
    r = subprocess.run(run + ["--config", str(bad), "models", "list"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bogus" in r.stderr
    # a setting the server cannot honour is refused before any model loads
    r = subprocess.run(run + ["serve", "--verify-budget-ms", "-5"], capture_output=True, text=True,
                       timeout=60, env={"TANDEM_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "--verify-budget-ms must be >= 0" in r.stderr


def test_one_name_for_one_thing():
    """The verifier's address is --verifier everywhere (chat keeps --server as an alias); a fixed tree is --tree."""
    assert cli.parser().parse_args(["chat", "--server", "h:1"]).verifier == "h:1"
    assert cli.parser().parse_args(["chat", "--verifier", "h:2"]).verifier == "h:2"
    assert cli.parser().parse_args(["serve", "--tree", "1,4,4"]).gateway_tree == "1,4,4"


def test_chat_options_come_from_the_environment_and_the_file_too(configured, monkeypatch):
    monkeypatch.setenv("TANDEM_TEMPERATURE", "0.7")
    a = configured('[chat]\ntree = "1,4,4"\nadaptive = true\nobjective = "cloud_cost"\n').parse_args(["chat"])
    assert (a.temperature, a.tree, a.adaptive, a.objective) == (0.7, "1,4,4", True, "cloud_cost")
    errors = configured('[chat]\nobjective = "fastest"\n').parse_args(["chat"]).config_errors
    assert any("objective" in e for e in errors)


@pytest.mark.parametrize("argv, adaptive", [
    (["chat"], True),  # the draft policy by default: never much slower than cloud-only decoding
    (["chat", "--tree", "1,4,4"], False),  # a fixed tree asked for is drafted every round
    (["chat", "--tree", "1,4,4", "--adaptive"], True),  # (the policy, asked for, wins)
    (["chat", "--no-adaptive"], False),  # the fixed default tree
    (["demo"], True),
])
def test_chat_drafts_under_the_policy_unless_a_fixed_tree_is_asked_for(argv, adaptive):
    assert terminal_chat.adaptive(cli.parser().parse_args(argv)) is adaptive


def test_shadow_chains_are_on_for_a_client_and_off_for_the_co_located_gateway(monkeypatch):
    """An edge client's idle drafter shadows by default (--no-shadow for battery); the gateway's drafters share the
    server's cores, so they do not unless asked."""
    assert cli.parser().parse_args(["chat"]).shadow is True
    assert cli.parser().parse_args(["chat", "--no-shadow"]).shadow is False
    assert cli.parser().parse_args(["serve"]).gateway_shadow is False
    monkeypatch.setenv("TANDEM_GATEWAY_SHADOW", "1")
    assert cli.parser().parse_args(["serve"]).gateway_shadow is True


def test_a_gateway_shared_by_keys_learns_no_vocabulary_across_them(monkeypatch, capsys):
    """A drafter head re-ranked from served traffic is a state every API key would shape for the others: refused
    (before any model loads) when the gateway serves more than one key."""
    monkeypatch.setenv("TANDEM_API_KEYS", "key-a,key-b")
    assert cli.main(["serve", "--drafter-vocab", "/nowhere/head.npy", "--drafter-engine", "onnx"]) == 2
    assert "--drafter-learn-vocab" in capsys.readouterr().err


@pytest.mark.parametrize("env, rest, argv, fragment", [
    ("key-a", "", ["serve"], "--teacher-mb is 0"),  # tenants named as opted in, and collection off
    ("", "", ["serve", "--teacher-mb", "8", "--replicas", "2"], "not with --verifier or --replicas"),
    ("", "", ["serve", "--distill-drafter", "default"], "trains on the positions --teacher-mb keeps"),
    ("", "", ["serve", "--distill-dir", "/tmp/a"], "set --distill-drafter"),
    ("", "rest-a", ["serve", "--http-port", "0"], "serves no gateway"),  # REST tenants, and no gateway
    ("", "rest-a", ["serve"], "REST tenants but --teacher-mb is 0"),
])
def test_teacher_collection_is_refused_before_any_model_loads_where_it_cannot_be_kept(monkeypatch, capsys, env,
                                                                                      rest, argv, fragment):
    monkeypatch.setenv("TANDEM_TEACH_KEYS", env)
    monkeypatch.setenv("TANDEM_REST_TEACH_KEYS", rest)
    assert cli.main(argv) == 2 and fragment in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["serve", "--n-ctx", "big"], "--n-ctx='big': Input should be a valid integer"),
    (["chat", "--objective", "fastest"], "--objective='fastest': Input should be 'latency' or 'cloud_cost'"),
    (["chat", "--temperature", "warm"], "--temperature='warm': Input should be a valid number"),
])
def test_a_bad_flag_names_itself_and_its_value(capsys, argv, fragment):
    assert cli.main(argv) == 2 and fragment in capsys.readouterr().err


def test_a_flag_beats_a_bad_variable_and_each_command_reads_its_own_table(configured, monkeypatch):
    """A flag given overrides the variable, so the variable's bad value is never read; [chat] does not set serve's."""
    monkeypatch.setenv("TANDEM_N_CTX", "big")
    assert configured("").parse_args(["serve", "--n-ctx", "1024"]).n_ctx == 1024
    monkeypatch.delenv("TANDEM_N_CTX")
    ap = configured("n-ctx = 1000\n[chat]\nn-ctx = 2000\n")
    assert (ap.parse_args(["chat"]).n_ctx, ap.parse_args(["serve"]).n_ctx) == (2000, 1000)


# -- the flags users type -------------------------------------------------------------------------------------------
def _parsers(p):
    import argparse
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_option_is_ever_abbreviated(capsys):
    """`--model` is the target, never a prefix of --model-name; a prefix of any option is an error, not a guess."""
    parsers = list(_parsers(cli.parser()))
    assert len(parsers) > 8 and not [p.prog for p in parsers if p.allow_abbrev]
    a = cli.parser().parse_args(["serve", "--model", "/x.gguf"])
    assert (a.target, a.model_name, a.served_model_name) == ("/x.gguf", "", "")
    for argv in (["serve", "--model-n", "x"], ["serve", "--gateway-draft", "2"], ["chat", "--max-tok", "5"],
                 ["--conf", "x.toml", "models", "list"], ["models", "check", "--draft", "x"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert "unrecognized arguments" in capsys.readouterr().err or argv[0] == "--conf"


@pytest.mark.parametrize("argv, env, want, deprecated", [
    # (grpc host, grpc port, http host, http port); vLLM's spelling: --host/--port are HTTP
    ([], {}, ("127.0.0.1", 50051, "127.0.0.1", 8000), False),
    (["--host", "0.0.0.0", "--port", "9000", "--grpc-host", "::1", "--grpc-port", "7000"], {},
     ("::1", 7000, "0.0.0.0", 9000), False),
    (["--port", "0"], {}, ("127.0.0.1", 50051, "127.0.0.1", 0), False),  # 0: no gateway
    (["--no-gateway", "--port", "9000"], {}, ("127.0.0.1", 50051, "127.0.0.1", 0), False),
    ([], {"TANDEM_PORT": "9100", "TANDEM_GRPC_PORT": "9101"}, ("127.0.0.1", 9101, "127.0.0.1", 9100), False),
    # the old spelling: given --http-host/--http-port (or their variables), --host/--port are the verifier's
    (["--host", "0.0.0.0", "--port", "6000", "--http-port", "8080"], {}, ("0.0.0.0", 6000, "127.0.0.1", 8080), True),
    (["--port", "6000", "--http-port", "0"], {}, ("127.0.0.1", 6000, "127.0.0.1", 0), True),
    ([], {"TANDEM_PORT": "6123", "TANDEM_HTTP_HOST": "0.0.0.0"}, ("127.0.0.1", 6123, "0.0.0.0", 8000), True),
    (["--http-host", "0.0.0.0", "--grpc-port", "7000"], {}, ("127.0.0.1", 7000, "0.0.0.0", 8000), True),
])
def test_where_serve_listens(monkeypatch, argv, env, want, deprecated):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    a = cli.parser().parse_args(["serve", *argv])
    assert not a.config_errors
    assert (a.grpc_host, a.grpc_port, a.http_host, a.http_port) == want
    assert bool(a.deprecated) is deprecated
    if deprecated:
        assert "--grpc-host/--grpc-port" in a.deprecated and "--host/--port" in a.deprecated
        assert ("$TANDEM_HTTP_HOST" if env else "--http-") in a.deprecated  # names where the old spelling came from


@pytest.mark.parametrize("argv, fragment", [
    (["--http-port", "8001", "--port", "6000", "--grpc-port", "7000"], "--port and --grpc-port both name the verifier"),
    (["--verifier", "far:50051", "--no-gateway"], "nothing would be served"),
    (["--verifier", "far:50051", "--port", "0"], "nothing would be served"),
    (["--port", "70000"], "the REST port 70000 is not in 0..65535"),
    (["--gateway-queue-depth", "-1"], "--gateway-queue-depth must be >= 0"),
    (["--host-drafters", "-1"], "--host-drafters -1: give 0 (none) or more"),
    (["--verifier", "far:50051", "--host-drafters", "1"], "--host-drafters drafts beside this process's verifier"),
])
def test_addresses_that_cannot_be_served_are_refused(capsys, argv, fragment):
    assert cli.main(["serve", *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_old_and_new_spelling_serve_the_same_and_the_old_one_says_it_is_deprecated(tmp_path):
    """`tandem serve` with the scripted engine (no model): the verifier on a free gRPC port either way; only the old
    spelling prints one deprecation line."""
    import re
    from tandem.core import lifetime
    for argv, lines in ((["--grpc-port", "0", "--no-gateway"], 0), (["--port", "0", "--http-port", "0"], 1)):
        proc = lifetime.spawn([sys.executable, "-m", "tandem.orchestrator.cli", "serve", "--engine", "scripted",
                               *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={"TANDEM_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
        try:
            assert re.match(r"verifier ready on 127\.0\.0\.1:\d+ ", proc.stdout.readline())
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        err = proc.stderr.read().strip().splitlines()
        assert len(err) == lines and all("deprecated" in e and "--grpc-port" in e for e in err), err


def test_api_keys_from_the_flag_join_the_variables_and_rest_listens_on_port(monkeypatch):
    """`tandem serve --api-key k --port P --grpc-port G`: REST on P needs k (or the variable's keys); the verifier
    on G then checks keys too. The gateway itself is the model-loading part: replaced here by what it was given."""
    import socket
    for name in ("API_KEYS", "API_KEYS_FILE", "VERIFIER_KEYS", "VERIFIER_KEYS_FILE"):
        monkeypatch.delenv(f"TANDEM_{name}", raising=False)
    monkeypatch.setenv("TANDEM_API_KEYS", "from-env")
    given = {}

    def gateway(cfg, address, verifier_key, tls, http_socket):
        given.update(keys=cfg.security.keys.rest, port=http_socket.getsockname()[1], address=address,
                     verifier_key=verifier_key)
        return 0

    monkeypatch.setattr(compose, "run_gateway", gateway)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["serve", "--engine", "scripted", "--api-key", "k", "--api-key", "a, b", "--port", str(port),
                     "--grpc-port", "0", "--drain-s", "0"]) == 0
    assert sorted(k.decode() for k in given["keys"].keys) == ["a", "b", "from-env", "k"]
    assert given["port"] == port and given["verifier_key"]  # the verifier is keyed: the gateway has its own key
    assert all(given["keys"].check(f"Bearer {k}") for k in ("k", "a", "from-env")) and not given["keys"].check("x")


def test_stop_strings_understand_escapes():
    a = cli.parser().parse_args(["chat", "--stop", "\\n\\n", "--stop", "a\\tb", "--stop", "\\\\n", "--stop", "C:\\q"])
    assert a.stop == ["\n\n", "a\tb", "\\n", "C:\\q"]  # \\ is a backslash; an unknown escape stays as typed
    assert terminal_chat.unescape("\\x41\\u00e9 \\\"x\\\"") == 'Aé "x"'


def test_a_model_that_is_not_one_is_one_line_naming_it(tmp_path):
    """Missing, not a GGUF, a directory for llama.cpp, or a GGUF llama.cpp cannot load: one line naming the file,
    exit 2, before anything listens (so the default ports need not be free)."""
    run = [sys.executable, "-m", "tandem.orchestrator.cli", "serve"]
    env = {"TANDEM_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    not_gguf = tmp_path / "model.safetensors"
    not_gguf.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}" + bytes(64))
    corrupt = tmp_path / "cut.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(40))
    cases = [(["--model", str(tmp_path / "missing.gguf")], "does not exist"),
             (["--model", str(not_gguf)], "is not a GGUF file"),
             (["--model", str(tmp_path)], "is a directory"),
             (["--model", str(tmp_path), "--engine", "torch"], "not a Hugging Face model directory"),
             (["--drafter", str(not_gguf)], "is not a GGUF file"),
             (["--model", str(corrupt), "--grpc-port", "0", "--no-gateway"], "cannot load")]
    for argv, fragment in cases:
        r = subprocess.run(run + argv, capture_output=True, text=True, timeout=120, env=env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (argv, r.stderr)
        assert lines[0].startswith("tandem serve: ") and fragment in lines[0], lines
        assert str(argv[1]) in lines[0]


def test_the_default_gateway_drafters_follow_the_machine(monkeypatch):
    assert [cli_args.auto_gateway_drafters(n) for n in (1, 2, 4, 8, 16, 64, 256)] == [1, 1, 1, 2, 4, 8, 8]
    monkeypatch.setattr(cli_args.os, "cpu_count", lambda: 16)
    assert cli.parser().parse_args(["serve"]).gateway_drafters == 4
    assert cli.parser().parse_args(["serve", "--gateway-drafters", "3"]).gateway_drafters == 3
    serve_help = " ".join(cli.parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert "one per 4 cores, 1 to 8: 4 on this machine" in serve_help and "TANDEM_API_KEYS" in serve_help
