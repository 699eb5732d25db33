"""The soak bench as a CI smoke: a short run on the real pair through the REST gateway and the SDK, with bad
inputs and disconnects mixed in. It must exit 0 (no undocumented answer, nothing open afterwards, bounded
memory), and its report must show each kind of traffic actually happened."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.models
def test_soak_smoke(tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, "-m", "bench.soak", "--duration", "30", "--sessions", "4", "--sdk", "1",
                        "--limit", "2", "--max-tokens", "8", "--gateway-drafters", "2", "--bad-fraction", "0.35",
                        "--disconnect-fraction", "0.2", "--sample-s", "2", "--json", str(out), "--report",
                        str(tmp_path / "soak.md")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["good_ok"] > 0 and result["bad_inputs"] > 0 and result["disconnects"] > 0
    assert result["undocumented"] == 0
    assert result["open_at_end"] and not any(result["open_at_end"].values())
    assert {k.split(" ")[0] for k in result["outcomes"]} == {"rest", "sdk"}
    assert len(result["rss_mb"]) >= 5
    probe = result["cross_tenant"]  # a second key learnt nothing of the first key's prompts; the first hit its own
    assert probe["leaked"] == 0 and probe["owner_hits"] == len(probe["probes"]) > 0
