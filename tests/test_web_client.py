"""clients/web (TypeScript): its Node unit tests, run with the suite. They drive the client's lock-step round loop
against the scripted verifier through the gateway's WebSocket relay (tests/scripted_relay.py): token-exact output
whatever the drafter, stop strings, edge tokens, UNAUTHENTICATED, and a replay of docs/protocol/lockstep.jsonl."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WEB = Path(__file__).resolve().parent.parent / "clients" / "web"


def test_the_typescript_client_passes_its_node_tests():
    if shutil.which("npm") is None:
        pytest.fail("npm is not installed (Node 20+ is needed for clients/web)")
    if not (WEB / "node_modules").is_dir():
        pytest.fail("clients/web has no node_modules: `make test` installs them (npm ci in clients/web)")
    r = subprocess.run(["npm", "test"], cwd=WEB, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TANDEM_PYTHON": sys.executable})
    summary = [line for line in r.stdout.splitlines() if line.startswith(("# pass", "# fail", "not ok"))]
    assert r.returncode == 0 and "# fail 0" in summary, r.stdout[-4000:] + r.stderr[-2000:]
