"""`tandem demo`: the side-by-side table and its GPU pricing (tests/test_sessions.py runs the command itself)."""
import pytest

from tandem.cloud.pacing import CostCurve
from tandem.edge.rounds import GenerationStats
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
