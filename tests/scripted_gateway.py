"""A scripted drafter client for the REST gateway's boundary tests (no model): generations of "x" tokens, a byte
tokenizer, and a verifier that can go down; ``serve_app`` (tests/conftest.py) runs a gateway on it."""
import threading
import time
from types import SimpleNamespace

import grpc
import uvicorn

from tandem.core.auth import ApiKeys
from tandem.edge.client import RemoteError
from tandem.core.messages import TokenLogprobs
from tandem.edge.generation_stats import GenerationStats
from tandem.orchestrator.gateway.app import create_app, server_options
from tandem.orchestrator.gateway.config import GatewayConfig
from tandem.orchestrator.gateway.drafter_pool import DrafterPool

KEY = "k1"
H = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class FakeGeneration:
    """``n`` tokens "x", or the pieces of ``script`` (then finishing with "stop")."""

    def __init__(self, n, delay_s, fail, script=None):
        self.n, self.delay_s, self.fail, self.script = n, delay_s, fail, script
        self.tokens, self.text, self.finish_reason, self.logprobs = [], "", None, []
        self.stats = GenerationStats(prompt_tokens=3)
        self.closed = False
        self._it = self._run()

    def _run(self):
        if self.script is not None:
            for piece in self.script:
                self.tokens.append(120)
                self.text += piece
                yield piece
            self.finish_reason = "stop"
            return
        try:
            for _ in range(self.n):
                time.sleep(self.delay_s)
                if self.fail:
                    raise RuntimeError("secret internals: /etc/passwd")
                self.tokens.append(120)  # "x"
                self.logprobs.append(TokenLogprobs(120, -0.5, ((120, -0.5), (121, -1.5))))
                self.text += "x"
                self.stats.generated_tokens = len(self.tokens)
                yield "x"
            self.finish_reason = "length"
        finally:
            self.closed = True

    def __iter__(self):
        return self._it

    def close(self):
        self._it.close()

    def cancel(self):
        self._it.close()

    def piece(self, token):
        return FakeTokenizer().piece(token)


class FakeTokenizer:
    """One token per byte (ids 0..255)."""
    n_vocab = 256

    def tokenize(self, text, special=True):
        return list(text.encode())

    def piece(self, token):
        return bytes([token])


class FakeClient:
    address = "nowhere"
    drafter = SimpleNamespace(tokenizer=FakeTokenizer())

    def __init__(self, delay_s=0.0, fail=False, script=None):
        self.delay_s, self.fail, self.up, self.gens, self.script = delay_s, fail, True, [], script
        self.calls: list[dict] = []
        self.rendered: list[tuple] = []  # (messages, tools) of every prompt

    def health(self, timeout_s=5.0):
        if not self.up:
            raise RemoteError(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return SimpleNamespace(target_model="m", n_ctx=4096, draining=False, active_sessions=0, max_sessions=4)

    def prompt_tokens(self, messages, tools=None):
        self.rendered.append((messages, tools))
        return [1, 2, 3]

    def generate(self, prompt, max_new_tokens=4, sampling=None, stop=(), top_logprobs=None, constraint=None,
                 cache_salt="", withhold_from_teacher=False):
        self.calls.append(dict(prompt=list(prompt), max_new_tokens=max_new_tokens, sampling=sampling,
                               top_logprobs=top_logprobs, constraint=constraint, cache_salt=cache_salt,
                               withhold_from_teacher=withhold_from_teacher))
        self.gens.append(FakeGeneration(max_new_tokens, self.delay_s, self.fail, self.script))
        return self.gens[-1]

    def close(self):
        pass


def app_server():
    servers = []

    def start(client, **config):
        gateway_config = GatewayConfig(keys=ApiKeys.of([KEY, "k2"]), **config)
        app = create_app(DrafterPool([client]), gateway_config)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                               **server_options(gateway_config)))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.02)
        servers.append(server)
        return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    return start, servers
