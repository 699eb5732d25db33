"""clients/web (TypeScript): its Node unit tests, run with the suite. They drive the client's round loop against the
scripted verifier through the gateway's WebSocket relay (tests/scripted_relay.py): token-exact output whatever the
drafter, lock-step and streamed, stop strings, edge tokens, resume, UNAUTHENTICATED, and replays of
docs/protocol/*.jsonl; and tokenizers.js on the default pair's tokenizer.json (converted from its GGUF), against
llama.cpp's ids of the same texts (a fixture this test writes)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_gguf_tokenizer import TEXTS

WEB = Path(__file__).resolve().parent.parent / "clients" / "web"


@pytest.fixture
def tokenizer_fixture(drafter_path, tmp_path):
    from tandem.core.gguf_tokenizer import tokenizer_json
    from tandem.core.llama_runtime import LlamaModel
    llama = LlamaModel(drafter_path, vocab_only=True)
    cases = []
    for text in TEXTS:
        ids = llama.tokenize(text)
        cases.append({"text": text, "ids": ids,
                      "plain": b"".join(llama.piece(t) for t in ids).decode("utf-8", errors="replace")})
    path = tmp_path / "tokenizer-fixture.json"
    path.write_text(json.dumps({"tokenizer": json.loads(tokenizer_json(drafter_path)), "cases": cases}))
    return path


@pytest.mark.models
def test_the_typescript_client_passes_its_node_tests(tokenizer_fixture):
    if shutil.which("npm") is None:
        pytest.fail("npm is not installed (Node 20+ is needed for clients/web)")
    if not (WEB / "node_modules").is_dir():
        pytest.fail("clients/web has no node_modules: `make test` installs them (npm ci in clients/web)")
    r = subprocess.run(["npm", "test"], cwd=WEB, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TANDEM_PYTHON": sys.executable,
                            "TANDEM_TOKENIZER_FIXTURE": str(tokenizer_fixture)})
    summary = [line for line in r.stdout.splitlines() if line.startswith(("# pass", "# fail", "# skipped",
                                                                           "not ok"))]
    assert r.returncode == 0 and "# fail 0" in summary and "# skipped 0" in summary, \
        r.stdout[-4000:] + r.stderr[-2000:]
