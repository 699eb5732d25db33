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
from tandem.orchestrator import cli, drafting, terminal_chat

CTRL_C, CTRL_D = "<ctrl-c>", "<ctrl-d>"  # a key typed at the prompt, or (a tuple) ("half a line", CTRL_C)


class Answer:
    """A scripted generation: ``pieces`` one by one, Ctrl-C pressed (SIGINT to this process) as piece ``ctrl_c_at``
    is produced (``twice``: pressed again at once)."""

    def __init__(self, pieces, max_new_tokens, ctrl_c_at=None, twice=False, policy=None):
        self.pieces, self.max_new, self.ctrl_c_at, self.twice = pieces, max_new_tokens, ctrl_c_at, twice
        self.policy = policy or {}  # the draft policy's last decision (stats.policy); empty: no policy ran
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
                               rounds=len(self.sent), policy=self.policy)


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
    monkeypatch.setattr(drafting, "load_drafter", lambda args: loaded.append(1) or object())
    Client.made.clear()

    def run(argv, typed=(), script=()):
        keys, line = list(typed), [""]
        monkeypatch.setattr(terminal_chat, "_line_buffer", lambda: line[0])  # what the terminal's line editor holds

        def keyboard(prompt=""):
            key = keys.pop(0)
            line[0], key = key if isinstance(key, tuple) else ("", key)
            if key == CTRL_C:  # the terminal sends SIGINT; whatever handler chat has set takes it
                os.kill(os.getpid(), signal.SIGINT)
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
    monkeypatch.setattr(terminal_chat, "LATE_CTRL_C_S", 0.0)
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
    policy = {"mode": "plain", "rtt_ms": 0.3, "predicted_tokens_per_s": {"plain": 12.5, "rounds": 12.8}}
    status, client, _ = chat(["one prompt", "--max-tokens", "50"], script=[dict(pieces=WORDS[:3], policy=policy)])
    out = capsys.readouterr().out
    assert status == 0 and "[cut" not in out  # ended by the model: no marker
    assert out.splitlines()[-1].startswith("-- policy: cloud-only decoding, predicted 12.5 tokens/s")


@pytest.mark.parametrize("typed, answers", [
    ([CTRL_D], 0),  # Ctrl-D at the prompt
    ([CTRL_C], 0),  # Ctrl-C at an empty prompt
    (["hi", "/quit"], 1),
    (["hi", CTRL_C], 1),  # after an answer, once the late-Ctrl-C grace is over
    ([("half a thou", CTRL_C), "hi", CTRL_D], 1),  # Ctrl-C on a line being typed drops the line, not the chat
])
def test_the_prompt_ends_the_chat_on_ctrl_d_ctrl_c_or_quit(chat, monkeypatch, typed, answers):
    monkeypatch.setattr(terminal_chat, "LATE_CTRL_C_S", 0.0)
    before = signal.getsignal(signal.SIGINT)  # (Python's default; ignored when the suite runs in the background)
    status, client, _ = chat([], typed, [dict(pieces=["hello"])])
    assert status == 0 and len(client.answers) == answers and client.closed
    assert all(m["content"] in ("hi", "hello") for p in client.prompts for m in p)  # a dropped line is not sent
    assert signal.getsignal(signal.SIGINT) is before


def test_a_ctrl_c_that_arrives_just_as_the_answer_ended_does_not_end_the_chat(chat, monkeypatch):
    """Pressed to stop an answer that was finishing anyway, it lands at the prompt: the chat goes on."""
    monkeypatch.setattr(terminal_chat, "LATE_CTRL_C_S", 60.0)
    status, client, _ = chat([], ["hi", CTRL_C, "and then?", CTRL_D], [dict(pieces=["hello"]), dict(pieces=["ok"])])
    assert status == 0 and len(client.answers) == 2
    assert [m["content"] for m in client.prompts[1]] == ["hi", "hello", "and then?"]


def test_one_prompt_stopped_by_ctrl_c_and_a_second_ctrl_c_interrupting(chat, capsys):
    before = signal.getsignal(signal.SIGINT)
    status, client, _ = chat(["one prompt", "--max-tokens", "100"], script=[dict(pieces=WORDS, ctrl_c_at=2)])
    assert status == 130 and client.answers[0].cancelled and "[stopped" in capsys.readouterr().out
    # a verifier that sends nothing more: the second Ctrl-C does not wait for the next token
    status, client, _ = chat(["one prompt", "--max-tokens", "100"], script=[dict(pieces=WORDS, ctrl_c_at=2,
                                                                                  twice=True)])
    assert status == 130 and client.closed and len(client.answers[0].sent) <= 3
    assert signal.getsignal(signal.SIGINT) is before  # the terminal's Ctrl-C is back


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


def test_on_a_real_terminal(tmp_path):
    """`tandem chat` on a pseudo-terminal, with its line editor (readline): ^C on a half-typed line drops the line,
    the chat answers the next one, ^C at the empty prompt ends it with status 0."""
    import pty
    import select
    import sys
    import time
    from pathlib import Path
    script = tmp_path / "chat.py"
    script.write_text(f"""import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from types import SimpleNamespace
import test_chat_terminal as t
from tandem.edge import client as edge_client
from tandem.orchestrator import cli, drafting, terminal_chat
edge_client.health = lambda *a, **k: SimpleNamespace()
edge_client.EdgeClient = t.Client
drafting.load_drafter = lambda args: object()
terminal_chat.LATE_CTRL_C_S = 0.0
t.Client.script = [dict(pieces=["hello ", "there"])]
status = cli.main(["chat"])
print("prompts:", t.Client.made[-1].prompts)
sys.exit(status)
""")
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session of its own on the terminal (pty.fork), so ^C is its SIGINT
        os.execv(sys.executable, [sys.executable, str(script)])
    out = b""

    def until(marker: bytes, times: int = 1, timeout_s: float = 60) -> None:
        nonlocal out
        deadline = time.monotonic() + timeout_s
        while out.count(marker) < times:
            assert time.monotonic() < deadline, out.decode(errors="replace")
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    out += os.read(fd, 4096)
                except OSError:  # the child has gone
                    break

    try:
        until(b"\n> ")
        os.write(fd, b"half a thou")
        until(b"half a thou")
        time.sleep(0.3)  # readline back in its wait (a ^C that lands while it echoes is seen at the next key)
        os.write(fd, b"\x03")
        until(b"\n> ", 2)  # a fresh prompt, the chat still there
        os.write(fd, b"hi\r")
        until(b"hello there")
        until(b"\n> ", 3)
        time.sleep(0.3)
        os.write(fd, b"\x03")
        until(b"]]")
    finally:
        deadline = time.monotonic() + 30
        while not (ended := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        if not ended[0]:  # (a failed step above left it waiting at its prompt)
            os.kill(pid, signal.SIGKILL)
            ended = os.waitpid(pid, 0)
        status = ended[1]
        os.close(fd)
    text = out.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "prompts: [[{'role': 'user', 'content': 'hi'}]]" in text  # the dropped line was never sent


@pytest.mark.parametrize("policy,says,not_says", [
    ({"mode": "plain", "rtt_ms": 0.3, "predicted_tokens_per_s": {"plain": 12.577, "rounds": 12.867}},
     ["cloud-only decoding, predicted 12.577 tokens/s against lock-step drafting 12.867", "5% faster",
      "To draft regardless: tandem chat --tree 4,16,6"], []),
    ({"mode": "plain", "rtt_ms": 40, "predicted_tokens_per_s": {"plain": 12.0, "rounds": 9.5}},
     ["against lock-step drafting 9.5", "round trip 40 ms", "--tree"], ["faster)"]),
    ({"mode": "rounds", "shape": "1,4,4", "rtt_ms": 10, "predicted_tokens_per_s": {"plain": 8.0, "rounds": 12.8}},
     ["lock-step drafting (tree 1,4,4), predicted 12.8 tokens/s against cloud-only decoding 8"],
     ["regardless", "faster)"]),
])
def test_the_policy_line_says_why_and_how_to_draft_regardless(policy, says, not_says):
    from tandem.orchestrator.terminal_chat import explain
    line = explain(policy)
    assert all(s in line for s in says) and not any(s in line for s in not_says), line
