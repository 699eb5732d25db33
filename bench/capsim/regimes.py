"""The regime map behind ``python -m bench.capacity --map``: where Tandem pays and where it does not.

A grid of cells, each a regime: a target (Qwen2.5 7B, 14B, 32B, 72B: public architectures), a GPU (H200, H100,
A100-80G, L40S-class; the target's replica spans 1, 2 or 4 of them, ``deploy/cost-curves/derive.py``), a per-user
speed (p99 inter-token latency 20, 33 or 50 ms, with p99 TTFT <= 1 s), a context (~1k, 8k or 32k tokens), traffic
(code: HumanEval's acceptance; chat: ShareGPT's, the conversation's earlier turns cached; long: ShareGPT's
acceptance with a new document of the context's size in every request) and a device (laptop, phone, browser tab).
Per cell, clients per GPU at the SLO for server-only decoding, server-side speculation (0.5B drafter; and the
EAGLE-class line), Tandem under its own policy, and the analytic bound for Tandem's acceptance (``bound``). Every
curve is derived (each file says from what), every figure simulated.

How a cell is searched (``capacity.guided_search``): from a guess, up by 1.25x while loads pass and down while they
fail, then bisection to within ``RESOLUTION``; a failure within 15 % of the SLO is checked one step further up before
it bounds the search (results need not be monotonic). Guesses: server-only decoding starts at 0.9x the idealised
figure of ``bound``; server-side speculation at the larger of server-only's capacity and 0.7x Tandem's bound (capped
by the KV memory); Tandem at the geometric mean of the best baseline's capacity and its bound. Server-side methods do
not depend on the device: one search serves every device of a regime.

The window (``window``): a warm-up of the arrivals' ramp and 0.6 of a mean answer at the SLO's pace, then about
``WINDOW_ANSWERS`` answers; a load whose first seed lands within 15 % of the SLO runs ``SEEDS`` seeds, pooled.
"""
from __future__ import annotations

import json
import multiprocessing
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..curves import CURVE_DIR
from ..output import cpu_name
from .bound import bound
from .physics import BROWSER, LAPTOP, LINKS, PHONE, Forward
from .report import passes
from .traces import Traces
from .world import Config, World, summarize

TARGETS = ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b")
GPUS = ("h200", "h100", "a100", "l40s")
SLOS = (20.0, 33.0, 50.0)
CONTEXTS = (1024, 8192, 32768)
TRAFFIC = {"code": ("humaneval", False), "chat": ("sharegpt", False), "long": ("sharegpt", True)}
DEVICES = {"laptop": LAPTOP, "phone": PHONE, "browser-tab": BROWSER}
TTFT_MS = 1000.0
SEEDS = 2
WINDOW_ANSWERS = 400  # answers a seed's window holds (about): with 2 seeds the p99 is the 8th-worst of ~800
RESOLUTION = 0.08
METHODS = ("server_ar", "server_sd", "server_eagle", "tandem_adaptive")

# The default grid: the cells that say where Tandem pays, within ~25 minutes on 2 cores. Each tuple is (target, gpu,
# slo, context, traffic, device); they span the floor's share of the per-token SLO from ~13 % (7B on an H100 at
# 50 ms) to over 100 % (72B on four L40S-class cards at 50 ms), contexts where KV reads and KV memory bind, the three
# kinds of traffic and the three devices. A 7B on an H200 at 50 ms (the README's old headline) holds ~600-800
# sessions a GPU: each Tandem probe there simulates that many real round loops, so it is a cell of --full (or
# --cells qwen2.5-7b/h200/50ms), not of the default.
DEFAULT_CELLS = (
    ("qwen2.5-7b", "h200", 20.0, 1024, "chat", "laptop"),
    ("qwen2.5-14b", "h200", 33.0, 8192, "chat", "laptop"),
    ("qwen2.5-7b", "h100", 50.0, 32768, "chat", "laptop"),
    ("qwen2.5-14b", "h100", 20.0, 1024, "code", "laptop"),
    ("qwen2.5-14b", "h100", 20.0, 1024, "chat", "laptop"),
    ("qwen2.5-32b", "a100", 33.0, 1024, "code", "laptop"),
    ("qwen2.5-32b", "a100", 33.0, 1024, "chat", "laptop"),
    ("qwen2.5-32b", "h200", 20.0, 1024, "code", "laptop"),
    ("qwen2.5-14b", "l40s", 50.0, 1024, "code", "laptop"),
    ("qwen2.5-14b", "l40s", 50.0, 1024, "code", "phone"),
    ("qwen2.5-14b", "l40s", 50.0, 1024, "code", "browser-tab"),
    ("qwen2.5-14b", "l40s", 50.0, 1024, "chat", "laptop"),
    ("qwen2.5-72b", "h100", 20.0, 1024, "code", "laptop"),
    ("qwen2.5-72b", "h100", 20.0, 1024, "chat", "laptop"),
    ("qwen2.5-72b", "h100", 50.0, 8192, "long", "laptop"),
    ("qwen2.5-72b", "l40s", 50.0, 1024, "chat", "phone"),
)


@dataclass(frozen=True)
class Cell:
    target: str
    gpu: str
    slo_itl_ms: float
    context: int
    dataset: str  # traffic: code, chat, long
    device: str

    @property
    def regime(self) -> tuple:
        """Everything but the device: what the server-side methods' figures depend on."""
        return (self.target, self.gpu, self.slo_itl_ms, self.context, self.dataset)

    def key(self) -> str:
        return f"{self.target}/{self.gpu}/{self.slo_itl_ms:g}ms/{self.context}/{self.dataset}/{self.device}"


def full_grid() -> list[Cell]:
    return [Cell(t, g, s, c, d, v) for t in TARGETS for g in GPUS for s in SLOS for c in CONTEXTS for d in TRAFFIC
            for v in DEVICES]


def curve_file(target: str, gpu: str) -> Path:
    found = sorted(p for p in CURVE_DIR.glob(f"derived-{gpu}-{target}*.json") if "eagle" not in p.name)
    if not found:
        raise FileNotFoundError(f"no derived curve for {target} on {gpu}: run deploy/cost-curves/derive.py")
    return found[0]


def window(slo_ms: float, clients: int, answer_tokens: float) -> tuple[float, float]:
    """(warm-up, measured) seconds for ``clients`` at about the SLO's pace: the warm-up holds the arrivals' ramp
    (5 s) and 0.6 of a mean answer (the sessions' ages decorrelate: answer lengths spread widely), at most 20 s; the
    window about ``WINDOW_ANSWERS`` answers, between 8 and 40 s (how the count was chosen:
    bench/results/2026-12-07/capacity-map/NOTES.md)."""
    answer_s = answer_tokens * slo_ms / 1000
    measured = min(40.0, max(8.0, WINDOW_ANSWERS * answer_s / max(1, clients)))
    return min(20.0, 5.0 + 0.6 * answer_s), measured


def run_regime(job: dict) -> list[dict]:
    """Every method of one regime, for each device asked: the cells' rows (run in a worker process)."""
    from ..capacity import guided_search, marginal, non_monotone
    from ..curves import drafters_for

    regime, devices, traces_path, seeds, verbose = (job["regime"], job["devices"], job["traces"], job["seeds"],
                                                    job["verbose"])
    target, gpu, slo, context, traffic = regime
    dataset, fresh = TRAFFIC[traffic]
    traces = Traces.load(traces_path)
    cfile = curve_file(target, gpu)
    drafter_file, eagle_file, _ = drafters_for(cfile)
    forward, drafter, eagle = Forward.load(cfile), Forward.load(drafter_file), Forward.load(eagle_file)
    spec = json.loads(cfile.read_text())
    tp = forward.tp
    answer = sum(traces.answer_tokens) / len(traces.answer_tokens)
    b = bound(forward, traces, dataset, slo, context, fresh)
    host_slots, host_class = job.get("host_slots", 0), job.get("host_class", "laptop")
    base = Config("server_ar", dataset, 1, 1, forward, LAPTOP, LINKS["metro"], drafter, 0, 0.0,
                  context_tokens=context, fresh_context=fresh, eagle_drafter=eagle, max_batch_tokens=4096,
                  host_slots=host_slots, host_device=DEVICES[host_class])
    sims, t_regime = [], time.perf_counter()

    def search(method: str, device: str, guess: float) -> dict:
        cfg = replace(base, method=method, device=DEVICES[device])

        def run(n: int) -> dict:
            warm, dur = window(slo, n, answer)
            c = replace(cfg, clients=n, warmup_s=warm, duration_s=dur)
            t0 = time.perf_counter()
            samples = [World(c, traces).samples()]
            row = summarize(samples, c)
            if seeds > 1 and marginal(row, slo, TTFT_MS):  # close to the SLO: more seeds, pooled
                samples += [World(replace(c, seed=c.seed + i), traces).samples() for i in range(1, seeds)]
                row = summarize(samples, c)
            row = {"method": method, "device": device, "clients": n, "warmup_s": round(warm, 1),
                   "duration_s": round(dur, 1), **row, "sim_s": round(time.perf_counter() - t0, 1)}
            sims.append(row)
            if verbose:
                print(f"[map] {'/'.join(map(str, regime))} {method} {device} x{n} ({row['seeds']} seed(s)): itl p99 "
                      f"{row['itl_p99_ms']} ttft p99 {row['ttft_p99_ms']} -> "
                      f"{'pass' if passes(row, slo, TTFT_MS) else 'fail'} ({row['sim_s']} s)", file=sys.stderr,
                      flush=True)
            return row

        n, rows, bounded = guided_search(run, guess, slo, TTFT_MS, resolution=RESOLUTION)
        at = next((r for r in rows if r["clients"] == n), None)
        return {"clients_per_replica": n, "clients": round(n / tp, 2) if tp > 1 else n, "bounded": bounded,
                "non_monotone": non_monotone(rows, n, slo, TTFT_MS), "probes": len(rows),
                "loads": sorted((r["clients"], passes(r, slo, TTFT_MS)) for r in rows),
                "sim_s": round(sum(r["sim_s"] for r in rows), 1), "at_capacity": _brief(at)}

    found = {"server_ar": search("server_ar", "laptop", 0.9 * b["ar"] * tp)}
    ar = found["server_ar"]["clients_per_replica"]
    top = min(b["bound"], b["kv_cap"]) * tp
    for m in ("server_sd", "server_eagle"):
        found[m] = search(m, "laptop", max(ar, 0.7 * top, 1))
    out = []
    for device in devices:
        best = max(found[m]["clients_per_replica"] for m in found)  # Tandem starts between it and its bound
        t = search("tandem_adaptive", device, max(1.0, (best * top) ** 0.5 if top > best else best))
        clients = {"server_ar": found["server_ar"]["clients"], "server_sd": found["server_sd"]["clients"],
                   "server_eagle": found["server_eagle"]["clients"], "tandem": t["clients"]}
        best = max(("server_ar", "server_sd", "server_eagle"), key=lambda k: clients[k])
        out.append({
            "target": target, "gpu": gpu, "slo_itl_ms": slo, "slo_ttft_ms": TTFT_MS, "context": context,
            "dataset": traffic, "device": device, "clients": clients, "bound": b["bound"],
            "bound_depth": b["depth"], "bound_tau": b["tau"], "ar_ideal": b["ar"], "kv_cap": b["kv_cap"],
            "ratio": round(clients["tandem"] / clients[best], 3) if clients[best] else None,
            "best_baseline": best, "tp": tp, "curve": cfile.name, "curve_label": spec.get("label", ""),
            "drafter_curve": Path(drafter_file).name, "eagle_curve": Path(eagle_file).name,
            "floor_ms": forward.floor_ms, "floor_share": round(forward.floor_ms / slo, 3),
            "traces_dataset": dataset, "fresh_context": fresh,
            "host_drafters": {"slots": host_slots, "class": host_class} if host_slots else None,
            "searches": {**{k: v for k, v in found.items()}, "tandem": t},
            "regime_s": round(time.perf_counter() - t_regime, 1)})
    return out


def _brief(row: dict | None) -> dict:
    keys = ("itl_p50_ms", "itl_p99_ms", "itl_short_p99_ms", "ttft_p99_ms", "gpu_busy", "prefill_gpu_share",
            "drafter_gpu_share", "tokens_per_verify", "forward_tokens_per_token", "depth_mean", "requests",
            "warmup_s", "duration_s", "refused")
    return {k: row[k] for k in keys if row and k in row}


def select(args) -> list[Cell]:
    cells = full_grid() if args.full else [Cell(*c) for c in DEFAULT_CELLS]
    if args.cells:  # comma-separated alternatives
        cells = [c for c in cells if any(part and part in c.key() for part in args.cells.split(","))]
    return cells


def run_map(args) -> int:
    from ..output import finish
    from . import mapreport

    t0 = time.perf_counter()
    cells = select(args)
    regimes: dict[tuple, list[str]] = {}
    for c in cells:
        regimes.setdefault(c.regime, []).append(c.device)
    jobs = [{"regime": r, "devices": d, "traces": str(args.traces), "seeds": args.seeds or SEEDS, "verbose": True,
             "host_slots": args.host_slots, "host_class": args.host_class} for r, d in regimes.items()]
    print(f"[map] {len(cells)} cells in {len(jobs)} regimes, {args.workers} worker(s)", file=sys.stderr, flush=True)
    rows: list[dict] = []
    errors: list[dict] = []
    runner = regime_or_error
    if args.workers > 1 and len(jobs) > 1:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            for out in pool.imap_unordered(runner, sorted(jobs, key=_cost, reverse=True)):
                rows += [r for r in out if "error" not in r]
                errors += [r for r in out if "error" in r]
    else:
        for job in jobs:
            out = runner(job)
            rows += [r for r in out if "error" not in r]
            errors += [r for r in out if "error" in r]
    order = {c.key(): i for i, c in enumerate(cells)}
    rows.sort(key=lambda r: order.get(Cell(r["target"], r["gpu"], r["slo_itl_ms"], r["context"], r["dataset"],
                                           r["device"]).key(), 0))
    from ..capacity import ASSUMPTIONS
    result = {"simulated": True, "date": time.strftime("%Y-%m-%d"), "machine": cpu_name(),
              "grid": "full" if args.full else "default", "cells": rows, "validation": [],
              "slo_ttft_ms": TTFT_MS, "seeds": jobs[0]["seeds"] if jobs else SEEDS,
              "window": {"answers_per_seed": WINDOW_ANSWERS, "min_s": 8.0, "max_s": 40.0},
              "resolution": RESOLUTION, "link": "metro", "link_profile": asdict(LINKS["metro"]),
              "devices": {k: asdict(v) for k, v in DEVICES.items()}, "traces": str(args.traces),
              "assumptions": {m: ASSUMPTIONS[m] for m in METHODS},
              "batched_prefill": True, "host_slots": args.host_slots, "host_class": args.host_class,
              "errors": errors, "map_s": round(time.perf_counter() - t0, 1)}
    report = args.report or Path("bench/out/capacity_map.md")
    report.parent.mkdir(parents=True, exist_ok=True)
    result["plots"] = mapreport.heatmap(result, report.with_suffix(".png"))
    return finish(result, args.json, mapreport.report, report, not errors, f"{len(errors)} regime(s) failed: {errors}",
                  "map")


def regime_or_error(job: dict) -> list[dict]:
    """``run_regime``, its failure reported as a row (one regime's crash does not lose the others')."""
    try:
        return run_regime(job)
    except Exception as e:  # reported in the JSON and the exit status
        import traceback
        return [{"regime": list(job["regime"]), "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc(limit=5)}]


def _cost(job: dict) -> float:
    """A regime's expected work, to start the longest first: capacity in sessions x devices."""
    target, gpu, slo, context, traffic = job["regime"]
    return len(job["devices"]) * slo * (1 + 8 * (target == "qwen2.5-7b")) / (1 + context / 4096)
