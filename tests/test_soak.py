"""The soak bench as a CI smoke: a short run on the real pair through the REST gateway and the SDK, with bad
inputs and disconnects mixed in. It must exit 0 (no undocumented answer, nothing open afterwards, bounded
memory), and its report must show each kind of traffic actually happened; its probes ran and learnt nothing (a
second key, devices holding tokens of the first key, callers of the verifier without a verifier key). Its failure
rules fail on each finding of the probes."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import device_leaked, probe_problems

ROOT = Path(__file__).resolve().parent.parent
REFUSABLE = {(rpc, credential) for rpc in ("Tokenizer", "Session", "DrafterAdapter")
             for credential in ("none", "rest_key", "edge_token")}


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
    # devices holding tokens of the first key itself: told nothing of its prompts, nor of each other's
    assert len(probe["device_probes"]) == len(probe["probes"]) and probe["device_leaked"] == 0
    for d in probe["device_probes"]:
        for seen in (d["victim_prompt"], d["victim_guess"], d["second_device"]):
            assert seen == {"cached_tokens": 0, "prefill_us": 0}
        assert d["subject_first"]["cached_tokens"] == 0 < d["subject_again"]["cached_tokens"]  # partition; control
    assert probe["device_control_hits"] == probe["owner_hits_after_devices"] == len(probe["probes"])
    # the verifier without a verifier key: every call refused, of each kind; Health answers and carries no prompt
    keyless = result["keyless_verifier"]
    refused = [c for c in keyless["calls"] if c["rpc"] != "Health"]
    assert {(c["rpc"], c["credential"]) for c in refused} == REFUSABLE
    assert all(c["code"] == "UNAUTHENTICATED" and not c["answered"] for c in refused)
    assert keyless["answered"] == 0 and keyless["refused"] == len(REFUSABLE)
    health = [c for c in keyless["calls"] if c["rpc"] == "Health"]
    assert len(health) == 1 and health[0]["answered"] and not health[0]["reveals_prompt"]
    report = (tmp_path / "soak.md").read_text()
    assert "Devices holding tokens of the first key" in report and "without a verifier key" in report


def clean_probes() -> tuple[dict, dict]:
    """What a run of two probe prompts that learnt nothing records."""
    zero = {"cached_tokens": 0, "prefill_us": 0}
    device = {"prompt_tokens": 90, "victim_prompt": zero, "victim_guess": zero, "second_device": zero,
              "subject_first": {"cached_tokens": 0, "prefill_us": 900}, "subject_again": {"cached_tokens": 89,
                                                                                         "prefill_us": 80}}
    probe = {"probes": [{"first": 0, "other_key_same_prompt": 0, "other_key_guess": 0, "owner_again": 89,
                         "owner_after_devices": 89}] * 2, "leaked": 0, "owner_hits": 2,
             "device_probes": [device] * 2, "device_leaked": 0, "device_control_hits": 2,
             "owner_hits_after_devices": 2}
    calls = [{"rpc": rpc, "credential": credential, "code": "UNAUTHENTICATED", "answered": False}
             for rpc, credential in sorted(REFUSABLE)]
    calls.append({"rpc": "Health", "credential": "none", "code": "OK", "answered": True, "open_by_design": True,
                  "reveals_prompt": False})
    return probe, {"calls": calls, "answered": 0, "refused": len(REFUSABLE), "health_reveals_prompt": False}


@pytest.mark.parametrize("finding", ["other_key", "device", "device_control", "owner_after_devices", "keyless",
                                     "health"])
def test_the_soak_fails_on_each_finding_of_its_probes(finding):
    probe, keyless = clean_probes()
    assert probe_problems(probe, keyless) == [] and probe_problems(None, None) == []
    if finding == "other_key":
        probe["leaked"] = 1
    elif finding == "device":
        probe["device_leaked"] = 1
    elif finding == "device_control":
        probe["device_control_hits"] = 0
    elif finding == "owner_after_devices":
        probe["owner_hits_after_devices"] = 0
    elif finding == "keyless":
        keyless["calls"][0] = {**keyless["calls"][0], "code": "OK", "answered": True}
        keyless["answered"] = 1
    else:
        keyless["health_reveals_prompt"] = True
    problems = probe_problems(probe, keyless)
    assert len(problems) == 1, problems


def test_a_device_leaks_by_anything_its_own_partition_is_told_or_a_hit_in_a_fresh_shared_one():
    device = clean_probes()[0]["device_probes"][0]
    assert not device_leaked(device)  # (the shared subject's prefill time and its second token's hit are its own)
    for seen, field in [("victim_prompt", "cached_tokens"), ("victim_guess", "prefill_us"),
                        ("second_device", "cached_tokens"), ("second_device", "prefill_us"),
                        ("subject_first", "cached_tokens")]:
        assert device_leaked({**device, seen: {**device[seen], field: 1}}), (seen, field)
