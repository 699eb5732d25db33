"""The simulator against real runs, on the same prompts and verifier curve, whose texts the traces hold with
exactly the tokens and acceptance the real run had (greedy output is the target's either way; ``bench.ceiling``
records the first texts of each dataset, as the benches draw them):

- one client (``validate``): a paced ``bench.network`` run, its link and this CPU's drafter; decode tokens/s and
  the median time per output token, per method and dataset;
- many clients on one replica (``validate_pool``): a paced ``bench.pool --decode-together`` run, whose replayed
  edges draft in no time over loopback and all start decoding at once; per session count and mode, the replica's
  decode tokens/s and the median session's time per output token.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from tandem.core.tree import TreeShape
from tandem.edge.planner import FixedPlanner
from tandem.edge.policy import DraftPolicy, PolicyConfig

from ..linkproxy import LinkProfile
from .physics import Device, Forward
from .traces import Traces
from .world import Config, World

# bench.network's methods the simulator can replay: chains only (the traces hold no other candidates)
PLANNERS: dict[str, Callable[[], object]] = {
    "cloud_ar": lambda: FixedPlanner(None),
    "cloud_ar_control": lambda: FixedPlanner(None),
    "chain4": lambda: FixedPlanner(TreeShape(1, 4, 4)),
    "lockstep3": lambda: FixedPlanner(TreeShape(1, 3, 3), stream=False),
    "adaptive": lambda: DraftPolicy(PolicyConfig(widths=(1,))),
    "adaptive_cost": lambda: DraftPolicy(PolicyConfig(widths=(1,)), objective="cloud_cost"),
}


def decode_rates(spans: list[tuple[int, float, float]]) -> dict:
    """From each session's (tokens, first token, last token) in seconds: the tokens committed after each
    session's first per second of the run's decoding span (first token of any session to last of any), and the
    median time per output token a session saw; one definition for the real and the simulated runs."""
    decoded = [(n - 1, t1 - t0) for n, t0, t1 in spans if n > 1]
    if not decoded:
        return {"decode_tokens_per_s": None, "tpot_ms_p50": None}
    span_s = max(t1 for _, _, t1 in spans) - min(t0 for _, t0, _ in spans)
    return {"decode_tokens_per_s": round(sum(n for n, _ in decoded) / span_s, 2) if span_s > 0 else None,
            "tpot_ms_p50": round(statistics.median(1000 * s / n for n, s in decoded), 1)}


def _point(base: dict, metric: str, real: float, simulated: float) -> dict:
    return {**base, "metric": metric, "real": real, "simulated": simulated,
            "error_pct": round(100 * (simulated - real) / real, 1)}


def replay_link(row: dict) -> LinkProfile:
    """The replayed edges' own loopback, as the real run measured it (``client_overhead_ms_p*``: a round's time
    beyond the verifier's queue and forward): half the median each way, and jitter whose two-way sum spans the
    measured 10th to 90th percentile (two uniform +-j draws sum to a triangle whose p10..p90 is 2.21 j). It decides
    whether drafts sent on one batch's verdicts all reach the next within the engine loop's collection window."""
    if "client_overhead_ms_p50" not in row:
        return LinkProfile()
    p10, p50, p90 = (max(0.0, row[f"client_overhead_ms_p{q}"]) for q in (10, 50, 90))
    return LinkProfile(one_way_ms=p50 / 2, jitter_ms=(p90 - p10) / 2.21)


def validate_pool(path: Path, traces: Traces, progress: Callable[[str], None]) -> list[dict]:
    d = json.loads(Path(path).read_text())
    if not (d.get("verifier_cost") and d.get("decode_together") and d.get("lock_step") and d.get("prompts_from")):
        progress(f"{path}: not a paced bench.pool --lock-step --decode-together run; skipped")
        return []
    shape = TreeShape.parse(d["tree"])
    if shape.k != 1:
        progress(f"{path}: recorded trees {d['tree']}, the traces replay chains only; skipped")
        return []
    texts = []
    for ds, i in d["prompts_from"]:
        held = [t for t in traces.texts if t.dataset == ds]
        if i >= len(held):
            progress(f"{path}: the traces hold {len(held)} {ds} texts, the run used text {i}; skipped")
            return []
        texts.append(held[i])
    # the run's scheduler computed each prompt whole between batches, its paced forwards at any size
    forward = Forward.load(d["verifier_cost"], d["cost_scale"], past_end="extrapolate")
    replay = Device("replay", 0.0, 0.0, "measured", "bench.pool's replayed edges: recorded drafts, sent at once")
    out = []
    for row in d["results"]:
        if row["mode"] not in ("batched", "ar") or row.get("decode_tokens_per_s") is None:
            continue
        n = row["sessions"]
        cfg = Config("tandem_replay", "mixed", n, 1, forward, replay, replay_link(row),
                     answer_tokens=d["max_new_tokens"], window_ms=d.get("window_ms", 2.0),
                     max_batch_tokens=d.get("max_batch_tokens", 512), batched_prefill=False, widths=(1,))
        world = World(cfg, traces)
        for user in world.devices:
            user.planner = FixedPlanner(shape, stream=False) if row["mode"] == "batched" else FixedPlanner(None)
        sim = decode_rates([(r["tokens"], r["first_s"], r["last_s"]) for r in world.replay_together(texts[:n])])
        base = {"source": Path(path).name, "method": "pool_" + row["mode"], "dataset": "mixed", "clients": n,
                "curve": d["verifier_cost"], "cost_scale": d["cost_scale"], "link": asdict(cfg.link)}
        out += [_point(base, "decode_tokens_per_s", row["decode_tokens_per_s"], sim["decode_tokens_per_s"]),
                _point(base, "tpot_p50_ms", row["tpot_ms_p50"], sim["tpot_ms_p50"])]
        progress(f"validate pool {row['mode']} x{n}: {out[-2]['real']} vs {out[-2]['simulated']} tok/s "
                 f"({out[-2]['error_pct']:+} %), p50 {out[-1]['real']} vs {out[-1]['simulated']} ms "
                 f"({out[-1]['error_pct']:+} %)")
    return out


def real_tpot_ms(requests: list[dict]) -> list[float]:
    return [(1000 * r["wall_s"] - r["ttft_ms"]) / (r["tokens"] - 1) for r in requests if r["tokens"] > 1]


def validate(path: Path, traces: Traces, device: Device, progress: Callable[[str], None]) -> list[dict]:
    d = json.loads(Path(path).read_text())
    sim = d.get("simulation") or {}
    if not sim.get("curve") or sim.get("time_scale", 1.0) != 1.0:
        progress(f"{path}: not a paced run at time scale 1; skipped")
        return []
    forward = Forward.load(sim["curve"], past_end="extrapolate")  # its prompts were computed whole, unpaced
    limit, max_new = d["limit"], d["max_new_tokens"]
    out = []
    for row in d["results"]:
        if row["method"] not in PLANNERS:
            continue
        link = LinkProfile(**d["links"][row["profile"]])
        for ds, real in row["by_dataset"].items():
            texts = [t for t in traces.texts if t.dataset == ds][:limit]
            if len(texts) < limit:
                progress(f"{path}: the traces hold {len(texts)} {ds} texts, the run had {limit}; skipped")
                continue
            cfg = Config("tandem_replay", ds, 1, 1, forward, device, link, answer_tokens=max_new,
                         max_batch_tokens=512, batched_prefill=False, widths=(1,))
            world = World(cfg, traces)
            world.devices[0].planner = PLANNERS[row["method"]]()
            sim_rows = world.replay(texts)
            sim_tps = sum(r["tokens"] - 1 for r in sim_rows) / sum(r["tpot_ms"] * (r["tokens"] - 1) / 1000
                                                                   for r in sim_rows)
            real_rows = [r for r in row["requests"] if r["dataset"] == ds]
            real_p50, sim_p50 = statistics.median(real_tpot_ms(real_rows)), statistics.median(
                r["tpot_ms"] for r in sim_rows)
            base = {"source": Path(path).name, "profile": row["profile"], "method": row["method"], "dataset": ds,
                    "curve": sim["curve"], "clients": 1}
            out += [_point(base, "decode_tokens_per_s", real["decode_tokens_per_s"], round(sim_tps, 2)),
                    _point(base, "tpot_p50_ms", round(real_p50, 1), round(sim_p50, 1))]
            progress(f"validate {row['profile']} {row['method']} {ds}: {out[-2]['real']} vs {out[-2]['simulated']} "
                     f"tok/s ({out[-2]['error_pct']:+} %), p50 {out[-1]['real']} vs {out[-1]['simulated']} ms")
    return out
