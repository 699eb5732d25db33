"""Capacity where the product lives: many devices sharing GPU verifiers, simulated on a virtual clock.

    python -m bench.capacity --curve h200-eager-qwen2.5-7b.json --clients 64,256,1024 --replicas 1 \\
        --slo-itl-ms 50 --json out.json

A discrete-event simulation (``bench/capsim``) of ``clients`` devices x ``replicas`` verifiers. What decides is
the product's own code: each Tandem device runs the real round loop (``edge.rounds.RoundLoop``) with the real
draft policy (or a fixed chain), verify forwards are pruned by ``cloud.budget`` when a budget is set, sessions go
where ``orchestrator.pool.placement`` puts them. The engine loop's batching rule is mirrored
(``bench/capsim/replica.py``; ``tests/test_capacity.py`` holds it to ``cloud.scheduler``). What is not code comes
from files a user can swap: acceptance traces recorded on the real pair (``--traces``, from ``bench.ceiling``),
the verifier's cost curve (``--curve``), the drafter's speed per device class (this CPU measured; laptop and
phone derived from published llama.cpp figures), link profiles.

Methods: ``server_ar`` (server-only serving, continuous batching), ``server_sd`` (server-side speculation, the
drafter on the GPU on its own curve), ``tandem_streamed`` / ``tandem_lockstep`` (a fixed chain, streamed or
lock-step) and ``tandem_adaptive`` (the draft policy).

Capacity: the most concurrent clients per GPU whose p99 time per output token is within ``--slo-itl-ms`` and p99
time to first token within ``--slo-ttft-ms``: the largest passing client count of ``--clients``, refined by
bisection up to the first failing one. ``--scale-replicas`` repeats the search for 1..16 replicas.
``--validate`` replays real paced ``bench.network`` runs (one client: same prompts, curve, link, this CPU's
drafter), ``--validate-pool`` real paced ``bench.pool --decode-together`` runs (1 to N replayed clients on one
replica), and reports the simulator's error on decode tokens/s and p50 time per output token; the report labels
every other figure simulated, and a curve's points past its last measured one extrapolation.

Everything here is simulated (the machine only runs the simulator); exits 1 when a validated point is off by
more than ``--max-error-pct`` or a simulated session produced a token count other than asked.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from .capsim import report as capreport
from .capsim.report import passes
from .capsim.physics import LAPTOP, LINKS, PHONE, Forward, device_from_ceiling
from .capsim.traces import Traces
from .capsim.validate import validate, validate_pool
from .capsim.world import METHODS, Config, World
from .curves import curve_path
from .output import finish

DEFAULT_TRACES = Path(__file__).resolve().parent / "results" / "2026-12-05" / "capacity" / "traces.json"
DEFAULT_DEPTH = {"server_sd": 3, "tandem_streamed": 8, "tandem_lockstep": 4}


def _progress(msg: str) -> None:
    print(f"[capacity] {msg}", file=sys.stderr, flush=True)


def capacity_search(run, clients: list[int], slo_itl_ms: float, slo_ttft_ms: float, refine: int) -> tuple[int, list]:
    """The most clients that pass, from ``clients`` (ascending) then by bisection toward the first that fails;
    ``run(n)`` simulates n clients. Returns (clients_at_slo, every row run, whether a failing load bounds it: if
    not, the capacity is at least that)."""
    rows, best, fail = [], 0, None
    for n in clients:
        row = run(n)
        rows.append(row)
        if passes(row, slo_itl_ms, slo_ttft_ms):
            best = n
        else:
            fail = n
            break
    lo, hi = best, fail
    for _ in range(refine):
        if hi is None or hi - lo <= max(1, lo // 20):  # within 5 %
            break
        mid = (lo + hi) // 2
        row = run(mid)
        rows.append(row)
        lo, hi = (mid, hi) if passes(row, slo_itl_ms, slo_ttft_ms) else (lo, mid)
    return lo, rows, fail is not None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--curve", default="h200-eager-qwen2.5-7b.json",
                    help="the verifier's cost curve: a file, or a name in deploy/cost-curves")
    ap.add_argument("--drafter-curve", default="h200-torch-qwen2.5-1.5b.json",
                    help="server_sd's drafter on the GPU (default: the measured eager 1.5B curve, an upper bound "
                         "for the 0.5B drafter: both are launch-bound)")
    ap.add_argument("--clients", default="16,64,256,1024", help="client counts, ascending")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--slo-itl-ms", type=float, default=50.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--datasets", default="humaneval,sharegpt")
    ap.add_argument("--device", default="laptop", help="laptop, phone, or this-cpu (measured by the traces' run)")
    ap.add_argument("--also-device", default="phone", help="a second device class reported beside ('' for none)")
    ap.add_argument("--link", default="metro", choices=sorted(LINKS))
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES,
                    help="acceptance traces: a bench.ceiling JSON (--drafter-engine llama.cpp --answer-lengths N)")
    ap.add_argument("--limit", type=int, default=0, help="the first N traced texts per dataset (0: all)")
    ap.add_argument("--answer-tokens", type=int, default=0,
                    help="tokens per answer (default 0: drawn from the traces' recorded ShareGPT answer lengths; a "
                         "fixed length keeps a closed loop's devices in step, their prompts arriving in bursts)")
    ap.add_argument("--think-s", type=float, default=0.0, help="mean think time between a device's requests")
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument("--verify-budget-tokens", type=int, default=0)
    ap.add_argument("--batched-prefill", action="store_true",
                    help="prompts join the decode batch as tokens (chunked prefill, as vLLM does), for every method; "
                         "default: one forward per prompt after the batch, as Tandem's scheduler does")
    ap.add_argument("--refine", type=int, default=4, help="bisection steps past the client list")
    ap.add_argument("--scale-replicas", default="", help="e.g. 1,2,4,8,16: capacity per replica count")
    ap.add_argument("--scale-methods", default="server_ar,tandem_adaptive")
    ap.add_argument("--validate", type=Path, nargs="*", default=[],
                    help="paced bench.network JSONs to replay and compare")
    ap.add_argument("--validate-pool", type=Path, nargs="*", default=[],
                    help="paced bench.pool --lock-step --decode-together runs to replay: many clients on a replica")
    ap.add_argument("--max-error-pct", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/capacity.md"))
    args = ap.parse_args(argv)

    methods = [m for m in args.methods.split(",") if m]
    if bad := [m for m in methods if m not in METHODS]:
        ap.error(f"unknown method {bad}; known: {list(METHODS)}")
    try:
        clients = sorted({int(x) for x in args.clients.split(",") if x})
        scale = sorted({int(x) for x in args.scale_replicas.split(",") if x})
    except ValueError as e:
        ap.error(f"client and replica counts are integers: {e}")
    if not clients or clients[0] < 1 or args.replicas < 1 or any(r < 1 for r in scale):
        ap.error("client and replica counts must be >= 1")
    if not args.traces.exists():
        ap.error(f"no traces at {args.traces}: record them with python -m bench.ceiling --drafter-engine llama.cpp "
                 "--chain-depth 16 --answer-lengths 2000 --json PATH")
    t_start = time.perf_counter()
    traces = Traces.load(args.traces, limit=args.limit)
    datasets = [d for d in args.datasets.split(",") if d]
    if bad := [d for d in datasets if d not in traces.datasets()]:
        ap.error(f"the traces have no {bad}; they have {traces.datasets()}")
    if not args.answer_tokens and not traces.answer_tokens:
        ap.error("--answer-tokens 0 needs traces recorded with --answer-lengths")
    devices = {"laptop": LAPTOP, "phone": PHONE, "this-cpu": device_from_ceiling(args.traces)}
    for name in (args.device, args.also_device):
        if name and name not in devices:
            ap.error(f"unknown device {name}; known: {list(devices)}")
    forward, drafter = Forward.load(args.curve), Forward.load(args.drafter_curve)
    base = Config("server_ar", datasets[0], 1, args.replicas, forward, devices[args.device], LINKS[args.link],
                  drafter, args.answer_tokens, args.think_s, args.warmup_s, args.duration_s,
                  max_batch_tokens=args.max_batch_tokens, budget_tokens=args.verify_budget_tokens,
                  batched_prefill=args.batched_prefill, seed=args.seed)

    def simulate(cfg: Config) -> dict:
        t0 = time.perf_counter()
        row = World(cfg, traces).run()
        row = {"method": cfg.method, "dataset": cfg.dataset, "clients": cfg.clients, "replicas": cfg.replicas,
               "device": cfg.device.name, "depth": cfg.depth or None, **row,
               "sim_s": round(time.perf_counter() - t0, 1)}
        _progress(f"{cfg.method} {cfg.dataset} {cfg.device.name} x{cfg.clients} on {cfg.replicas}: "
                  f"itl p50/p99 {row['itl_p50_ms']}/{row['itl_p99_ms']} ms, ttft p99 {row['ttft_p99_ms']} ms, "
                  f"{row['server_tokens_per_s']} tok/s, gpu busy {row['gpu_busy']} ({row['sim_s']} s)")
        return row

    results, capacity = [], {}
    for device in [d for d in (args.device, args.also_device) if d]:
        for method in methods:
            if device != args.device and method in ("server_ar", "server_sd"):
                continue  # the device does not matter to server-only methods
            for ds in datasets:
                cfg = replace(base, method=method, dataset=ds, device=devices[device],
                              depth=DEFAULT_DEPTH.get(method, 0))
                n, rows, bounded = capacity_search(
                    lambda c, cfg=cfg: simulate(replace(cfg, clients=c * cfg.replicas)), clients, args.slo_itl_ms,
                    args.slo_ttft_ms, args.refine)
                results += rows
                key = method if device == args.device else f"{method}@{device}"
                capacity.setdefault(key, {})[ds] = {"clients_at_slo": n * args.replicas, "clients_per_gpu": n,
                                                    "device": device, "bounded": bounded}

    # the goals compare Tandem with server-only serving at the load where server-only reaches its capacity
    for ds in datasets:
        n = capacity.get("server_ar", {}).get(ds, {}).get("clients_at_slo")
        have = {(r["method"], r["dataset"], r["clients"], r["device"]) for r in results}
        if n and "tandem_adaptive" in methods and ("tandem_adaptive", ds, n, args.device) not in have:
            results.append(simulate(replace(base, method="tandem_adaptive", dataset=ds, clients=n)))

    scaling = []
    for r in scale:
        for method in [m for m in args.scale_methods.split(",") if m in methods]:
            per_gpu = capacity.get(method, {}).get(datasets[0], {}).get("clients_per_gpu", clients[0])
            cfg = replace(base, method=method, dataset=datasets[0], replicas=r, depth=DEFAULT_DEPTH.get(method, 0))
            probe = sorted({max(1, int(per_gpu * f)) for f in (0.8, 0.9, 1.0, 1.1, 1.25)})
            n, rows, bounded = capacity_search(lambda c, cfg=cfg: simulate(replace(cfg, clients=c * cfg.replicas)),
                                               probe, args.slo_itl_ms, args.slo_ttft_ms, args.refine)
            scaling.append({"method": method, "dataset": datasets[0], "replicas": r, "clients_at_slo": n * r,
                            "clients_per_gpu": n, "bounded": bounded,
                            "sim_s": round(sum(x["sim_s"] for x in rows), 1)})

    validation = []
    for path in args.validate:
        validation += validate(path, traces, devices["this-cpu"], _progress)
    for path in args.validate_pool:
        validation += validate_pool(path, traces, _progress)
    errors = [abs(v["error_pct"]) for v in validation]
    wrong = sum(r["wrong_length"] for r in results)
    ok = all(e <= args.max_error_pct for e in errors) and not wrong
    result = {"ok": ok, "simulated": True, "curve": Path(curve_path(args.curve)).name,
              "curve_label": forward.curve.label,
              "drafter_curve": Path(curve_path(args.drafter_curve)).name, "link": args.link,
              "link_profile": asdict(LINKS[args.link]), "device": args.device,
              "devices": {k: asdict(v) for k, v in devices.items()}, "traces": str(args.traces),
              "acceptance": {d: round(traces.acceptance(d), 3) for d in datasets},
              "slo_itl_ms": args.slo_itl_ms, "slo_ttft_ms": args.slo_ttft_ms, "replicas": args.replicas,
              "answer_tokens": args.answer_tokens, "think_s": args.think_s, "duration_s": args.duration_s,
              "warmup_s": args.warmup_s, "max_batch_tokens": args.max_batch_tokens,
              "batched_prefill": args.batched_prefill,
              "kv_ms_per_token": forward.kv_ms_per_token, "kv_tokens": forward.kv_tokens,
              "results": results, "capacity": capacity, "scaling": scaling, "validation": validation,
              "limit": args.limit, "bench_s": round(time.perf_counter() - t_start, 1)}
    result["goals"] = capreport.goals(result)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    result["plots"] = capreport.plot(result, args.report)
    return finish(result, args.json, capreport.report, args.report, ok,
                  f"a validated point is off by more than {args.max_error_pct} % or {wrong} simulated answers had "
                  "the wrong length", "capacity")


if __name__ == "__main__":
    sys.exit(main())
