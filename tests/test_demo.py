"""`tandem demo`: the side-by-side table and its GPU pricing (tests/test_sessions.py runs the command itself)."""
import pytest

from tandem.cloud.engines.pacing import CostCurve
from tandem.edge.generation_stats import GenerationStats
from tandem.orchestrator import demo

CURVE = CostCurve("flat then linear", (1, 8, 16), (4.0, 4.0, 8.0))


@pytest.mark.parametrize("rounds, nodes, tokens, gpu", [
    (75, 0, 75, 4.0),  # cloud-only: one 1-token forward per token
    (18, 72, 75, 18 * 4.0 / 75),  # chains of 4: 5-token forwards, on the flat part of the curve
    (10, 110, 40, 10 * 6.0 / 40),  # 12-token forwards (1 + 11 nodes): halfway up the slope from 8 to 16
])
def test_the_gpu_column_prices_the_runs_forwards_on_the_curve(rounds, nodes, tokens, gpu):
    stats = GenerationStats(generated_tokens=tokens, rounds=rounds, drafted_nodes=nodes, verify_us=tokens * 50_000)
    row = demo.Row.of("m", stats, CURVE)
    assert row.gpu_ms_per_token == pytest.approx(gpu)
    assert row.verify_ms_per_token == pytest.approx(50.0) and row.verify_forwards == rounds


def test_the_table_is_one_line_per_method_and_says_what_is_simulated():
    rows = [demo.Row("cloud-only", 75, 16.0, 75, 48.6, 3.99),
            demo.Row("lock-step chains of 4", 75, 9.6, 18, 52.9, None)]
    lines = demo.table(rows, "H200").splitlines()
    assert len(lines) == 5 and lines[2].split() == ["cloud-only", "16.0", "75", "48.6", "3.99"]
    assert lines[3].split()[-1] == "-" and "simulated on H200" in lines[4]


LINE = CostCurve("10 ms + 0.1 ms a token", (1, 1001), (10.1, 110.0))


@pytest.mark.parametrize("depth, tau, device_ms, kv_ms, sessions, ms_per_token", [
    (0, 1.0, 0.0, 0.0, 400, 50.0 / 400),  # server-only: 10 + 0.1 n <= 50
    (0, 1.0, 0.0, 0.1, 200, 50.0 / 200),  # each session's KV read costs as much as its token
    # chains of 4 committing 5: a round is two forwards (the wait, its own) <= 250 ms: forward <= 125 at n = 230;
    # the GPU holds 230 x 250 / 125 sessions while the others draft
    (4, 5.0, 0.0, 0.0, 460, 125.0 / (230 * 5)),
    (4, 5.0, 50.0, 0.0, 450, 100.0 / (180 * 5)),  # 50 ms of drafting and link: forward <= 100 at n = 180
    (4, 1.5, 60.0, 0.0, 0, 0.0),  # drafts rejected: even one session misses 75 ms a round
])
def test_sessions_per_gpu_in_closed_form(depth, tau, device_ms, kv_ms, sessions, ms_per_token):
    held, cost = demo.sessions_per_gpu(LINE, 50.0, depth, tau, device_ms, kv_ms)
    assert held == sessions and cost == pytest.approx(ms_per_token, rel=1e-3)


def test_the_gpu_line_says_simulated_and_what_it_was_fed():
    line = demo.gpu_line({"a card": (LINE, 0.0)}, tau=5.0, level_ms=7.5)
    assert line.startswith("on a GPU, simulated (closed form") and "this run's 5.00 tokens per verify forward" in line
    assert "this device 8 ms a drafted level, a laptop 6" in line and "a card: server-only 400 sessions a GPU" in line
    assert "drafting on this device 450 (0.111; 1.12x)" in line and "does not pay" in line
    # a laptop drafts 4 levels in 24 ms: forward <= (250 - 44) / 2 = 103 at n = 186, 186 x 250 / 103 held
    assert "drafting on a laptop 451 (" in line
