"""The simulator against real runs: replay a paced ``bench.network`` run (the same prompts, verifier curve, link
and this CPU's drafter) and compare decode tokens/s and the median time per output token, per method and
dataset. A real run's prompts are the first ``limit`` of each dataset, as ``bench.ceiling`` records them, so the
traces hold exactly the tokens and acceptance the real run had (greedy output is the target's either way).
"""
from __future__ import annotations

import json
import statistics
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


def real_tpot_ms(requests: list[dict]) -> list[float]:
    return [(1000 * r["wall_s"] - r["ttft_ms"]) / (r["tokens"] - 1) for r in requests if r["tokens"] > 1]


def validate(path: Path, traces: Traces, device: Device, progress: Callable[[str], None]) -> list[dict]:
    d = json.loads(Path(path).read_text())
    sim = d.get("simulation") or {}
    if not sim.get("curve") or sim.get("time_scale", 1.0) != 1.0:
        progress(f"{path}: not a paced run at time scale 1; skipped")
        return []
    forward = Forward.load(sim["curve"])
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
                         max_batch_tokens=512)
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
            out.append({**base, "metric": "decode_tokens_per_s", "real": real["decode_tokens_per_s"],
                        "simulated": round(sim_tps, 2),
                        "error_pct": round(100 * (sim_tps - real["decode_tokens_per_s"]) /
                                           real["decode_tokens_per_s"], 1)})
            out.append({**base, "metric": "tpot_p50_ms", "real": round(real_p50, 1), "simulated": round(sim_p50, 1),
                        "error_pct": round(100 * (sim_p50 - real_p50) / real_p50, 1)})
            progress(f"validate {row['profile']} {row['method']} {ds}: {out[-2]['real']} vs {out[-2]['simulated']} "
                     f"tok/s ({out[-2]['error_pct']:+} %), p50 {out[-1]['real']} vs {out[-1]['simulated']} ms")
    return out
