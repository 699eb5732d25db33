"""bench.capacity's simulator: its batching mirror against the real engine loop on a scripted trace, its clients
on literal traces, and the capacity search."""
import json
import time

import pytest

from tandem.cloud.pacing import CostCurve
from tandem.cloud.scheduler import Scheduler
from tandem.cloud.session import DraftRequest, Limits, open_session
from tandem.core.sampling import Sampling
from tandem.core.tree import DraftTree

from bench.capacity import capacity_search
from bench.capsim.events import Sim
from bench.capsim.physics import LINKS, Device, Forward
from bench.capsim.replica import Replica, Work
from bench.capsim.traces import Text, Traces
from bench.capsim.world import Config, World
from scripted import ScriptedEngine, succ

CURVE = CostCurve("test", (1, 64), (200.0, 830.0))  # 200 ms + 10 ms a token
WINDOW_MS, MAX_TOKENS = 80, 12
# (ms, session, tokens in its forward): drafts timed against the forwards they land in, >= 40 ms from any edge
SCRIPT = [(0, "A", 3), (40, "B", 3),  # A waits out the window; B joins it: [A, B] from 80 to 340
          (160, "C", 3), (200, "D", 9),  # queued behind it; together they fill the 12 tokens: [C, D] at 340
          (400, "A", 5), (440, "B", 3),  # after their verdicts; queued behind [C, D] (until 660)
          (700, "C", 5),  # A + B wait for more; C would overflow: [A, B] runs at once, C goes first next
          (1040, "D", 3)]  # [A, B] ends at 1000; C waits the window, D joins: [C, D]
EXPECTED = [["A", "B"], ["C", "D"], ["A", "B"], ["C", "D"]]


class TimedEngine(ScriptedEngine):
    max_batch_tokens = 64

    def __init__(self):
        super().__init__(succ)
        self.named: list[list[str]] = []

    def forward_batch(self, jobs):
        self.named.append([j.seq["name"] for j in jobs])
        time.sleep(CURVE(sum(j.n_tokens for j in jobs)) / 1000)
        return super().forward_batch(jobs)


def real_batches() -> list[list[str]]:
    eng = TimedEngine()
    sched = Scheduler(eng, max_batch_tokens=MAX_TOKENS, window_ms=WINDOW_MS)
    sched.open_sessions = lambda: 4
    sessions = {}
    for i, name in enumerate("ABCD"):
        s = open_session(eng, [1 + 10 * i, 2 + 10 * i], Sampling(), Limits(40, 16, 12), Limits(0, 16, 12))
        s.seq["name"] = name
        sessions[name] = s
    pending: dict[str, object] = {}
    seqs: dict[str, int] = {}
    t0 = time.perf_counter()
    for at_ms, name, tokens in SCRIPT:
        time.sleep(max(0.0, t0 + at_ms / 1000 - time.perf_counter()))
        if name in pending:
            pending.pop(name).result(timeout=0)  # the script sends after the verdict; a miss fails the test
        s = sessions[name]
        last = s.committed[-1]
        tree = DraftTree.chain([min(last + 1 + j, 48) for j in range(tokens - 1)])
        seqs[name] = seqs.get(name, 0) + 1
        pending[name] = sched.verify(s, DraftRequest(s.committed_len, tree, seqs[name]))
    for f in pending.values():
        f.result(timeout=5)
    sched.stop()
    return eng.named


def mirror_batches() -> list[list[str]]:
    sim = Sim()
    rep = Replica(sim, Forward(CURVE), window_ms=WINDOW_MS, max_batch_tokens=MAX_TOKENS, open_sessions=4)
    seen: list[list[str]] = []
    real_forward = rep._forward
    rep._forward = lambda batch, calls: (seen.append([w.session for w in batch]), real_forward(batch, calls))
    for at_ms, name, tokens in SCRIPT:
        sim.at(at_ms / 1000, lambda name=name, tokens=tokens: rep.submit(Work(name, tokens, lambda ms, q: None)))
    sim.run()
    return seen


def test_the_mirror_batches_as_the_engine_loop_does():
    assert mirror_batches() == EXPECTED
    assert real_batches() == EXPECTED


def test_work_that_fills_the_batch_runs_in_it_once():
    sim = Sim()
    rep = Replica(sim, Forward(CURVE), window_ms=WINDOW_MS, max_batch_tokens=MAX_TOKENS, open_sessions=2)
    done: list[str] = []
    for name in "AB":  # B completes the batch (every open session in it): it runs at once, B in it, only there
        sim.at(0.01, lambda name=name: rep.submit(Work(name, 3, lambda ms, q, name=name: done.append(name))))
    sim.run()
    assert done == ["A", "B"] and rep.batches == 1 and rep.forward_tokens == 6


def test_a_floor_hides_small_work_and_kv_reads_add_to_large():
    curve = CostCurve("gpu", (1, 1001), (4.0, 34.0))  # 4 ms + 0.03 ms a token
    f = Forward(curve, kv_ms_per_token=1e-5, kv_tokens=1_000_000, floor_ms=20.0)
    assert f.ms(1) == 20.0 and f.ms(1, 100) == 20.0
    assert f.ms(1001, 0) == pytest.approx(34.0) and f.ms(1001, 1_000_000) == pytest.approx(44.0)
    assert f.max_sessions(500) == 2000 and Forward(curve).max_sessions(500) == 1 << 30


def traces(run: int, n: int = 400) -> Traces:
    return Traces([Text("code", 50, (run,) * n)], "literal")


def world(method: str, run: int, clients: int = 2, depth: int = 4, batched_prefill: bool = False) -> dict:
    flat = Forward(CostCurve("flat", (1, 4096), (20.0, 20.0)))
    cfg = Config(method, "code", clients, 1, flat, Device("dev", 5.0, 0.5, "test"), LINKS["lan"],
                 drafter=Forward(CostCurve("d", (1,), (5.0,))), answer_tokens=64, warmup_s=1.0, duration_s=10.0,
                 depth=depth, batched_prefill=batched_prefill)
    return World(cfg, traces(run)).run()


@pytest.mark.parametrize("method,run,tokens_per_verify", [
    ("server_ar", 0, 1.0),  # one token per forward
    ("tandem_lockstep", 100, 5.0),  # every drafted token the target's: depth 4 + the bonus
    ("tandem_lockstep", 0, 1.0),  # none is: the bonus only
    ("server_sd", 100, 4.0),  # a chain of 3 drafted on the GPU, all accepted, + the bonus
])
def test_clients_commit_what_the_trace_says(method, run, tokens_per_verify):
    row = world(method, run, depth=3 if method == "server_sd" else 4)
    assert row["wrong_length"] == 0 and row["requests"] > 0
    assert row["tokens_per_verify"] == pytest.approx(tokens_per_verify, rel=0.05)


def test_server_ar_time_per_token_is_the_forward_and_batches_share_it():
    one, many = world("server_ar", 0, clients=1), world("server_ar", 0, clients=8)
    assert one["itl_p50_ms"] == pytest.approx(20.0, abs=1.0)  # a lone session does not wait the window
    assert many["itl_p50_ms"] == pytest.approx(20.0, abs=3.0)  # a flat curve: 8 share one forward
    assert many["server_tokens_per_s"] == pytest.approx(8 * one["server_tokens_per_s"], rel=0.15)


def test_prompts_each_take_a_forward_unless_batched():
    alone, batched = world("server_ar", 0, clients=32), world("server_ar", 0, clients=32, batched_prefill=True)
    # one forward per prompt, after the batch: a request waits behind the other prompts queued with it
    assert batched["ttft_p99_ms"] < 0.5 * alone["ttft_p99_ms"]
    assert batched["tokens_per_verify"] == pytest.approx(1.0, abs=0.01)  # prompts are not counted as verifies


def test_speculation_pays_where_acceptance_is_high():
    ar, good, bad = world("server_ar", 0), world("tandem_adaptive", 100), world("tandem_adaptive", 0)
    assert good["itl_p50_ms"] < 0.5 * ar["itl_p50_ms"]
    assert bad["itl_p50_ms"] <= 1.2 * ar["itl_p50_ms"]  # the policy stops drafting where nothing is accepted


@pytest.mark.parametrize("ok_up_to,clients,expected", [
    (100, [10, 50, 200], 100),  # bisection between 50 and 200 to within 5 %
    (5, [10, 50], 5),  # the smallest fails: bisection below it
    (1000, [10, 50], 50),  # everything passes: the list's largest
])
def test_capacity_search(ok_up_to, clients, expected):
    def run(n):
        return {"requests": 1, "itl_p99_ms": 10.0 if n <= ok_up_to else 99.0, "ttft_p99_ms": 100.0, "clients": n}
    n, rows, bounded = capacity_search(run, clients, 50.0, 1000.0, refine=10)
    assert 0.95 * expected <= n <= expected
    assert bounded == (ok_up_to < clients[-1])  # everything passed: a lower bound only


def test_traces_load_limit_and_tile(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"datasets": ["a", "a", "b"], "runs": [[3, 2, 1], [0, 0], [5]],
                             "prompt_tokens": [10, 11, 12], "answer_tokens": [7, 8]}))
    t = Traces.load(p, limit=1)
    assert [x.runs for x in t.texts] == [(3, 2, 1), (5,)] and t.answer_tokens == [7, 8]
    import random
    r = Traces.load(p).request("a", 6, random.Random(0))
    assert len(r.runs) == 6 and max(r.runs) <= 3
    # a chain never runs past the end of the text it started in (the next text is another answer)
    assert all(r.runs[i] <= 3 - i for i in range(3)) or all(r.runs[i] == 0 for i in range(2))


def test_the_bench_reports_what_its_interface_promises(tmp_path):
    """The recorded traces and default curve, end to end: the JSON keys other checks read."""
    from bench.capacity import main
    out = tmp_path / "c.json"
    rc = main(["--clients", "4", "--replicas", "1", "--slo-itl-ms", "50", "--methods", "server_ar,tandem_adaptive",
               "--datasets", "humaneval", "--also-device", "", "--warmup-s", "1", "--duration-s", "4", "--refine", "0",
               "--limit", "2", "--answer-tokens", "48", "--json", str(out), "--report", str(tmp_path / "c.md")])
    d = json.loads(out.read_text())
    assert rc == 0 and d["simulated"] and not d["validation"]
    rows = {r["method"]: r for r in d["results"]}
    for r in rows.values():
        keys = {"method", "dataset", "clients", "itl_p50_ms", "itl_p99_ms", "ttft_p99_ms", "gpu_s_per_1k_tokens"}
        assert keys <= set(r)
        assert r["clients"] == 4 and r["wrong_length"] == 0 and r["requests"] > 0
    assert d["capacity"]["server_ar"]["humaneval"]["clients_at_slo"] == 4  # 4 sessions on an H200 meet 50 ms
    assert rows["tandem_adaptive"]["tokens_per_verify"] > 1.5  # code: the traces' chains are accepted
    assert (tmp_path / "c.md").read_text().startswith("# Capacity")


def test_a_paced_pool_run_is_replayed_with_its_sessions_decoding_together(tmp_path):
    """Two replayed edges on one replica, the curve flat at 100 ms x the run's scale 2: text a's chains of 4 all
    hold (16 tokens in rounds of 5, 5, 5, 1: its first token at one forward, its last at four), text b's never do
    (16 forwards of one token). Both prompts' forwards run first and decoding starts together, as the real run's
    barrier makes it; the 'real' figures below are worked by hand, so every error is 0 only if the replay reads
    the run's texts, curve, scale, chain and modes."""
    from bench.capsim.validate import validate_pool
    traces = tmp_path / "traces.json"
    traces.write_text(json.dumps({"datasets": ["a", "b"], "runs": [[100] * 16, [0] * 16], "prompt_tokens": [9, 9]}))
    curve = tmp_path / "flat.json"
    curve.write_text(json.dumps({"tokens": [1, 64], "ms": [100.0, 100.0]}))
    rows = [{"sessions": 1, "mode": "batched", "decode_tokens_per_s": 15 / 0.6, "tpot_ms_p50": 40.0},
            # both: the span from the first tokens (one forward after the barrier) to b's last (16 forwards)
            {"sessions": 2, "mode": "batched", "decode_tokens_per_s": 30 / 3.0, "tpot_ms_p50": (40 + 200) / 2},
            {"sessions": 2, "mode": "ar", "decode_tokens_per_s": 30 / 3.0, "tpot_ms_p50": 200.0}]
    run = tmp_path / "pool.json"
    run.write_text(json.dumps({"verifier_cost": str(curve), "cost_scale": 2.0, "decode_together": True,
                               "lock_step": True, "tree": "1,4,4", "max_new_tokens": 16,
                               "prompts_from": [["a", 0], ["b", 0]], "results": rows}))
    points = validate_pool(run, Traces.load(traces), lambda m: None)
    assert len(points) == 6
    assert [(p["clients"], p["method"]) for p in points[::2]] == [(1, "pool_batched"), (2, "pool_batched"),
                                                                  (2, "pool_ar")]
    assert all(p["error_pct"] == 0 for p in points), points
