"""The recorded example sessions of docs/protocol/ are what the verifier says today (recorded again against the
scripted verifier and compared), and they obey what docs/protocol.md tells an implementer: the committed hash's
formula, committed lengths, rebasing and LENGTH."""
import pytest

import protocol_examples as ex
from tandem.cloud.server import serve
from tandem.cloud.engines.scripted_engine import ScriptedEngine


@pytest.fixture(scope="module")
def verifier():
    server, port = serve(ScriptedEngine(), "127.0.0.1:0")
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.mark.parametrize("name", sorted(ex.SESSIONS))
def test_the_recorded_sessions_are_todays(verifier, name):
    assert ex.record(name, verifier) == ex.recorded(name), \
        "the protocol changed: run `.venv/bin/python tests/protocol_examples.py --write` and review the diff"


def rolling_hash(tokens):  # docs/protocol.md, "The minimal client", step 3
    h = 0xCBF29CE484222325
    for t in tokens:
        h = (h * 0x100000001B3 + t + 1) % 2**64
    return h


@pytest.mark.parametrize("name", sorted(ex.SESSIONS))
def test_a_client_following_the_document_agrees_with_every_verdict(name):
    """Commit each verdict as the document says (the accepted nodes' tokens, all below the rebased levels, then the
    bonus token unless -1): the length and the hash the verifier sends always equal the client's."""
    lines = ex.recorded(name)
    committed = list(lines[0]["client"]["open"]["promptTokens"])
    tree, finished = None, False
    for line in lines[1:]:
        if "client" in line:
            tree = line["client"].get("draft", {}).get("tree", tree)
            continue
        verdict = line["verifier"].get("verdict")
        if verdict is None:
            continue
        if verdict.get("draftSeq") and not verdict.get("stale"):  # a tree's verdict: its accepted nodes
            committed += [tree["tokens"][i] for i in verdict.get("accepted", [])]
        if verdict["bonusToken"] >= 0:
            committed.append(verdict["bonusToken"])
        assert verdict["committedLen"] == len(committed)
        assert int(verdict["committedHash"]) == rolling_hash(committed)
        finished = finished or verdict.get("finishReason") == "FINISH_REASON_LENGTH"
    assert finished and committed == list(range(1, len(committed) + 1))  # the scripted target counts up


def test_the_command_line_serves_the_scripted_verifier_without_any_model(tmp_path):
    """`tandem serve --engine scripted` starts with an empty model cache (nothing fetched) and answers the recorded
    session as the in-process verifier does."""
    import re
    import subprocess
    import sys

    from tandem.core import lifetime
    proc = lifetime.spawn([sys.executable, "-m", "tandem.orchestrator.cli", "serve", "--engine", "scripted",
                           "--http-port", "0", "--port", "0"], stdout=subprocess.PIPE, text=True,
                          env={"TANDEM_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    try:
        ready = proc.stdout.readline()
        address = re.search(r"verifier ready on (\S+)", ready).group(1)
        assert ex.record("lockstep", address) == ex.recorded("lockstep")
        assert not any(tmp_path.iterdir())  # no model was fetched
    finally:
        proc.terminate()
        proc.wait(timeout=10)
