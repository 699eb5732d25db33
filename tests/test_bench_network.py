"""bench.network's request-by-request ratios and the noise floor of its ``cloud_ar_control`` arm (pure: rows in,
ratios out), and how the report states them."""
import pytest

from bench.network import report, request_ratios


def row(method, per_s, wall, datasets=("humaneval", "sharegpt"), profile="local"):
    """A result row whose requests (one per dataset, in prompt order) ran 96 tokens in ``wall`` seconds each."""
    requests = [{"dataset": d, "tokens": 96, "wall_s": w} for d, w in zip(datasets, wall)]
    by = {d: {"edge_tokens_per_s": 96 / w} for d, w in zip(datasets, wall)}
    return {"profile": profile, "method": method, "edge_tokens_per_s": per_s, "requests": requests, "by_dataset": by}


def test_request_ratios_pair_requests_by_prompt_and_give_the_control_as_the_noise_floor():
    rows = [row("cloud_ar", 20.0, [4.0, 5.0]), row("cloud_ar_control", 19.0, [5.0, 5.0]),
            row("adaptive", 18.0, [4.0, 6.0]), row("adaptive", 30.0, [2.0, 2.5], profile="metro")]
    got = request_ratios(rows)
    assert got["local"]["cloud_ar_control"] == {"requests": [0.8, 1.0], "run": 0.95,
                                                "by_dataset": {"humaneval": 0.8, "sharegpt": 1.0}}
    assert got["local"]["adaptive"] == {"requests": [1.0, pytest.approx(0.833, abs=1e-3)]}
    assert "metro" not in got  # no cloud_ar there to hold it against
    assert "cloud_ar" not in got["local"]


def test_the_report_states_the_spread_and_the_noise_floor(tmp_path):
    rows = [row("cloud_ar", 20.0, [4.0, 5.0]), row("cloud_ar_control", 19.0, [5.0, 5.0]),
            row("adaptive", 18.0, [4.0, 6.0])]
    for r in rows:
        r.update(ttft_ms=500.0, verifier_ms_per_token=30.0, tau=1.0, wire_bytes_per_token=40.0)
        for v in r["by_dataset"].values():
            v["verifier_ms_per_token"] = 30.0
    result = {"results": rows, "prompts": 2, "limit": 1, "max_new_tokens": 96, "target": "t", "drafter": "d",
              "lossless_ok": True, "divergences": [], "request_ratios": request_ratios(rows)}
    path = tmp_path / "network.md"
    report(result, path)
    text = path.read_text()
    assert ("- local: cloud_ar_control 0.80-1.00x, adaptive 0.83-1.00x; noise floor (`cloud_ar_control`): 0.95x "
            "over the run (humaneval 0.80x, sharegpt 1.00x)") in text
