"""`tandem chat` as people use terminal chats, on a scripted client (no model; the real pair is in tests/test_sdk.py
and tests/test_sessions.py): Ctrl-C stops the answer and keeps the conversation, Ctrl-C at the prompt or Ctrl-D
ends the chat, an answer cut by --max-tokens says so, and the verifier is asked before the drafter loads, with one
clear line when the address is an HTTP server instead."""
import http.server
import os
import signal
import threading
from types import SimpleNamespace

import pytest

from tandem.edge import client as edge_client
from tandem.orchestrator import cli

CTRL_C, CTRL_D = "<ctrl-c>", "<ctrl-d>"


class Answer:
    """A scripted generation: ``pieces`` one by one, Ctrl-C pressed (SIGINT to this process) as piece ``ctrl_c_at``
    is produced (``twice``: pressed again at once)."""

    def __init__(self, pieces, max_new_tokens, ctrl_c_at=None, twice=False):
        self.pieces, self.max_new, self.ctrl_c_at, self.twice = pieces, max_new_tokens, ctrl_c_at, twice
        self.sent, self.cancelled, self.finish_reason = [], False, None
        self._it = self._run()

    def _run(self):
        for i, piece in enumerate(self.pieces[:self.max_new]):
            if i == self.ctrl_c_at:
                os.kill(os.getpid(), signal.SIGINT)
                if self.twice:
                    os.kill(os.getpid(), signal.SIGINT)
            self.sent.append(piece)
            yield piece
        self.finish_reason = "length" if len(self.pieces) >= self.max_new else "stop"

    def __iter__(self):
        return self._it

    def cancel(self):
        self.cancelled = True
        self._it.close()

    @property
    def text(self):
        return "".join(self.sent)

    @property
    def stats(self):
        return SimpleNamespace(generated_tokens=len(self.sent), prompt_tokens=3, tau=1.0, tokens_per_s=10.0,
                               rounds=len(self.sent))


class Client:
    """Stands for EdgeClient: answers from ``script`` (a list of Answer keyword dicts), records every prompt."""
    script: list = []
    made: list = []

    def __init__(self, drafter, address, shape=None, **kwargs):
        self.address, self.prompts, self.answers, self.closed = address, [], [], False
        Client.made.append(self)

    def pair_with_target(self):
        return "native"

    def prompt_tokens(self, messages):
        self.prompts.append([dict(m) for m in messages])
        return [1, 2, 3]

    def generate(self, prompt, max_new_tokens, stop=(), sampling=None):
        self.answers.append(Answer(max_new_tokens=max_new_tokens, **Client.script.pop(0)))
        return self.answers[-1]

    def close(self):
        self.closed = True


@pytest.fixture
def chat(monkeypatch):
    """``chat(argv, typed, script)``: run `tandem chat` on the scripted client with ``typed`` as the keyboard;
    returns (exit status, the client, whether the drafter was loaded)."""
    loaded = []
    monkeypatch.setattr(edge_client, "health", lambda address, timeout_s=5.0, tls_ca=None: SimpleNamespace())
    monkeypatch.setattr(edge_client, "EdgeClient", Client)
    monkeypatch.setattr(cli, "_load_drafter", lambda args: loaded.append(1) or object())
    Client.made.clear()

    def run(argv, typed=(), script=()):
        keys = list(typed)

        def keyboard(prompt=""):
            key = keys.pop(0)
            if key == CTRL_C:
                raise KeyboardInterrupt
            if key == CTRL_D:
                raise EOFError
            return key

        monkeypatch.setattr("builtins.input", keyboard)
        Client.script = list(script)
        status = cli.main(["chat", *argv])
        return status, (Client.made[-1] if Client.made else None), bool(loaded)

    return run


WORDS = [f"w{i} " for i in range(200)]


def test_ctrl_c_stops_the_answer_and_keeps_the_conversation(chat, capsys, monkeypatch):
    monkeypatch.setattr(cli, "LATE_CTRL_C_S", 0.0)
    status, client, _ = chat(["--max-tokens", "100"], ["first question", "second question", CTRL_C],
                             [dict(pieces=WORDS, ctrl_c_at=3), dict(pieces=["short answer"])])
    assert status == 0 and client.closed
    stopped = client.answers[0]
    assert stopped.cancelled and 3 <= len(stopped.sent) <= 5  # stopped at the next token, not at 100
    out = capsys.readouterr().out
    assert "[stopped: Ctrl-C; the answer so far stays in the conversation" in out
    # the next turn carries the question and the part of the answer that was shown
    assert client.prompts[1] == [{"role": "user", "content": "first question"},
                                 {"role": "assistant", "content": stopped.text},
                                 {"role": "user", "content": "second question"}]
    assert out.count("[stopped") == 1 and "[cut" not in out  # the second answer ended on its own


def test_an_answer_cut_by_max_tokens_says_so(chat, capsys):
    status, client, _ = chat(["one prompt", "--max-tokens", "5"], script=[dict(pieces=WORDS)])
    out = capsys.readouterr().out.splitlines()
    assert status == 0 and len(client.answers[0].sent) == 5
    assert out[-2] == "[cut at --max-tokens 5]" and "finish: length" in out[-1]
    status, client, _ = chat(["one prompt", "--max-tokens", "50"], script=[dict(pieces=WORDS[:3])])
    assert status == 0 and "[cut" not in capsys.readouterr().out  # ended by the model: no marker


@pytest.mark.parametrize("typed, answers", [
    ([CTRL_D], 0),  # Ctrl-D at the prompt
    ([CTRL_C], 0),  # Ctrl-C at an empty prompt
    (["hi", "/quit"], 1),
    (["hi", CTRL_C], 1),  # after an answer, once the late-Ctrl-C grace is over
])
def test_the_prompt_ends_the_chat_on_ctrl_d_ctrl_c_or_quit(chat, monkeypatch, typed, answers):
    monkeypatch.setattr(cli, "LATE_CTRL_C_S", 0.0)
    status, client, _ = chat([], typed, [dict(pieces=["hello"])])
    assert status == 0 and len(client.answers) == answers and client.closed


def test_a_ctrl_c_that_arrives_just_as_the_answer_ended_does_not_end_the_chat(chat, monkeypatch):
    """Pressed to stop an answer that was finishing anyway, it lands at the prompt: the chat goes on."""
    monkeypatch.setattr(cli, "LATE_CTRL_C_S", 60.0)
    status, client, _ = chat([], ["hi", CTRL_C, "and then?", CTRL_D], [dict(pieces=["hello"]), dict(pieces=["ok"])])
    assert status == 0 and len(client.answers) == 2
    assert [m["content"] for m in client.prompts[1]] == ["hi", "hello", "and then?"]


def test_one_prompt_stopped_by_ctrl_c_and_a_second_ctrl_c_interrupting(chat, capsys):
    status, client, _ = chat(["one prompt", "--max-tokens", "100"], script=[dict(pieces=WORDS, ctrl_c_at=2)])
    assert status == 130 and client.answers[0].cancelled and "[stopped" in capsys.readouterr().out
    # a verifier that sends nothing more: the second Ctrl-C does not wait for the next token
    status, client, _ = chat(["one prompt", "--max-tokens", "100"], script=[dict(pieces=WORDS, ctrl_c_at=2,
                                                                                  twice=True)])
    assert status == 130 and client.closed and len(client.answers[0].sent) <= 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the terminal's Ctrl-C is back


class _Http(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("kind", ["the REST gateway", "another HTTP server"])
def test_the_verifier_is_asked_before_the_drafter_loads_and_an_http_port_is_named(chat, capsys, monkeypatch,
                                                                                  serve_app, kind):
    from scripted_gateway import FakeClient
    monkeypatch.setattr(edge_client, "health", _real_health)
    server = None
    if kind == "the REST gateway":
        address = serve_app(FakeClient()).removeprefix("http://")
    else:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Http)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        address = f"127.0.0.1:{server.server_address[1]}"
    status, client, loaded = chat(["hi", "--verifier", address])
    # (the in-process gateway logs the gRPC preface it refused, on its own threads: only chat's lines count)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("tandem")]
    assert status == 1 and not loaded and client is None
    assert len(err) == 1 and f"{address} is an HTTP server (the REST gateway?)" in err[0], err
    assert "--verifier HOST:PORT" in err[0]
    if server is not None:
        server.shutdown()
        server.server_close()
        status, client, loaded = chat(["hi", "--verifier", address])  # nothing listens there now
        err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("tandem")]
        assert status == 1 and not loaded and len(err) == 1 and f"cannot reach the verifier at {address}" in err[0]


_real_health = edge_client.health
