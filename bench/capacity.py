"""Capacity where the product lives: many devices sharing GPU verifiers, simulated on a virtual clock.

    python -m bench.capacity --curve h200-eager-qwen2.5-7b.json --clients 64,256,1024 --replicas 1 \\
        --slo-itl-ms 50 --json out.json
    python -m bench.capacity --map --json map.json          # the regime map (``capsim.regimes``); --full: all cells

A discrete-event simulation (``bench/capsim``) of ``clients`` devices x ``replicas`` verifiers. What decides is
the product's own code: each Tandem device runs the real round loop (``edge.rounds.RoundLoop``) with the real
draft policy (or a fixed chain), verify forwards are pruned by ``cloud.budget`` when a budget is set, sessions go
where ``orchestrator.pool.placement`` puts them. The engine loop's batching rule is mirrored
(``bench/capsim/replica.py``; ``tests/test_capacity.py`` holds it to ``cloud.scheduler``): prompts are computed in
chunks inside the verify forwards, as the product's scheduler does (``--serial-prefill``: one forward per prompt
between batches, the old rule). What is not code comes from files a user can swap: acceptance traces recorded on the
real pair (``--traces``, from ``bench.ceiling``), the verifier's cost curve (``--curve``: it must carry its KV bytes
per token, bandwidth and KV memory, or it is refused), the drafter's speed per device class (laptop and phone
derived from published llama.cpp figures, the browser tab and this CPU measured here), link profiles.

Methods (each one's assumptions are printed beside its result, ``ASSUMPTIONS``): ``server_ar`` (server-only
serving, continuous batching), ``server_sd`` (server-side speculation in lock-step rounds, the 0.5B drafter on a
curve of its own size on the same GPU, its depth chosen per step from 0), ``server_eagle`` (the same with an
EAGLE-3-class head and published acceptance lengths), ``tandem_streamed`` / ``tandem_lockstep`` (a fixed chain,
streamed or lock-step) and ``tandem_adaptive`` (the draft policy, chains and trees).

Capacity: the most concurrent clients per GPU whose p99 time per output token (answers of at least 4 tokens; the
short answers' tail is reported apart) is within ``--slo-itl-ms`` and p99 time to first token within
``--slo-ttft-ms``, the requests of ``--seeds`` runs pooled: every count of ``--clients`` is run (a failure below a
pass does not end the search), then bisection between the largest pass and the next failure above it.
``--scale-replicas`` repeats the search for 1..16 replicas. ``--validate`` replays real paced ``bench.network``
runs (one client: same prompts, curve, link, this CPU's drafter), ``--validate-pool`` real paced ``bench.pool
--decode-together`` runs (1 to N replayed clients on one replica), and reports the simulator's error on decode
tokens/s and p50 time per output token; the report labels every other figure simulated.

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
from .capsim.physics import BROWSER, LAPTOP, LINKS, PHONE, CurveError, Forward, device_from_ceiling
from .capsim.report import passes
from .capsim.traces import Traces
from .capsim.validate import validate, validate_pool
from .capsim.world import EAGLE_ALPHA, METHODS, Config, World, summarize
from .curves import curve_path, drafters_for
from .output import finish

DEFAULT_TRACES = Path(__file__).resolve().parent / "results" / "2026-12-05" / "capacity" / "traces.json"
DEFAULT_DEPTH = {"tandem_streamed": 8, "tandem_lockstep": 4}
DEVICES = ("laptop", "phone", "browser-tab", "this-cpu")
ASSUMPTIONS = {
    "server_ar": "server-only decoding, continuous batching on the product's own scheduler (mirrored): every "
                 "session's token in each forward, prompts in chunks in the room left",
    "server_sd": "server-side speculation as vLLM/SGLang run it: lock-step rounds of every session, the 0.5B drafter "
                 "of the same family on a curve of its own size on the same GPU (its forwards and KV on the GPU's "
                 "clock and memory; past a measured drafter curve a depth is refused, never extrapolated), depth "
                 "chosen per step from 0 (plain decoding) to 8 by the least predicted time per token on acceptance "
                 "learnt from its own verdicts; the drafter's catch-up at depth 0 is free (in its favour)",
    "server_eagle": "as server_sd with an EAGLE-3-class head (one decoder layer + fusion + a 32k head, derived curve) "
                    "and published acceptance, not ours: the public EAGLE-3 Llama-3.1-8B checkpoint's tau with chains "
                    "of 7 (2.77 MT-bench, 3.49 HumanEval, temperature 1; nebius/EAGLE3-Llama-3.3-70B-Instruct model "
                    f"card) as a flat acceptance by depth ({', '.join(f'{k} {v}' for k, v in EAGLE_ALPHA.items())})",
    "tandem_adaptive": "Tandem under its own policy: every device runs the real round loop and draft policy (chains "
                       "and trees of width 2), drafting on the device's clock, acceptance from traces recorded on "
                       "the real pair (trees: a fitted model of the drafter's second choices, capsim/trees.py)",
    "tandem_streamed": "a fixed streamed chain (depth 8) on the device",
    "tandem_lockstep": "a fixed lock-step chain (depth 4) on the device",
}


def _progress(msg: str) -> None:
    print(f"[capacity] {msg}", file=sys.stderr, flush=True)


def simulate_seeds(cfg: Config, traces: Traces, seeds: int) -> dict:
    """``seeds`` runs of ``cfg`` (seeds cfg.seed, cfg.seed + 1, ...), their requests pooled into one row."""
    return summarize([World(replace(cfg, seed=cfg.seed + i), traces).samples() for i in range(max(1, seeds))], cfg)


def capacity_search(run, clients: list[int], slo_itl_ms: float, slo_ttft_ms: float, refine: int,
                    stop_after: int = 2, resolution: float = 0.05) -> tuple[int, list, bool]:
    """The most clients that pass, without assuming that results are monotonic in the load: every count of
    ``clients`` (ascending) is run until ``stop_after`` in a row fail (a failing load below a passing one does not end
    the search), then bisection between the largest passing count and the smallest failing one above it, to within
    ``resolution``; ``run(n)`` simulates n clients. Returns (clients_at_slo, every row run, whether a failing load
    bounds it: if not, the capacity is at least that). A failing load below the capacity is kept in the rows
    (``non_monotone`` says which)."""
    rows, verdict = [], {}

    def probe(n: int) -> None:
        row = run(n)
        rows.append(row)
        verdict[n] = passes(row, slo_itl_ms, slo_ttft_ms)

    def bracket() -> tuple[int, int | None]:
        best = max((n for n, ok in verdict.items() if ok), default=0)
        return best, min((n for n, ok in verdict.items() if not ok and n > best), default=None)

    streak = 0
    for n in clients:
        probe(n)
        streak = 0 if verdict[n] else streak + 1
        if streak >= stop_after:
            break
    lo, hi = bracket()
    for _ in range(refine):
        if hi is None or hi - lo <= max(1, int(lo * resolution)):
            break
        probe((lo + hi) // 2)
        lo, hi = bracket()
    return lo, rows, hi is not None


def guided_search(run, guess: float, slo_itl_ms: float, slo_ttft_ms: float, step: float = 1.25,
                  resolution: float = 0.08, margin: float = 0.15, max_probes: int = 14) -> tuple[int, list, bool]:
    """``capacity_search`` from a guess instead of a list (the regime map's: fewer probes where each is dear): up by
    ``step`` while loads pass, down while they fail, then bisection to within ``resolution``. A failure within
    ``margin`` of the SLO is not trusted to bound the search alone: the load one step above is run too, and the
    search goes on from it if it passes (results need not be monotonic). Same returns as ``capacity_search``."""
    rows, verdict = [], {}

    def test(n: int) -> bool:
        if n not in verdict and len(rows) < max_probes:
            row = run(n)
            rows.append(row)
            verdict[n] = (passes(row, slo_itl_ms, slo_ttft_ms), marginal(row, slo_itl_ms, slo_ttft_ms, margin))
        return verdict.get(n, (False, False))[0]

    def above(n: int) -> int:
        return max(n + 1, int(round(n * step)))

    n = max(1, int(round(guess)))
    if not test(n) and verdict[n][1] and test(above(n)):
        n = above(n)
    if verdict[n][0]:
        while len(rows) < max_probes:
            up = above(n)
            if test(up) or (verdict.get(up, (0, 0))[1] and test(above(up))):
                n = max(m for m, (ok, _) in verdict.items() if ok)
                continue
            break
    else:
        while n > 1 and len(rows) < max_probes:
            n = max(1, min(n - 1, int(n / step)))
            if test(n):
                break
    best = max((m for m, (ok, _) in verdict.items() if ok), default=0)
    hi = min((m for m, (ok, _) in verdict.items() if not ok and m > best), default=None)
    while hi is not None and hi - best > max(1, int(best * resolution)) and len(rows) < max_probes:
        test((best + hi) // 2)
        best = max((m for m, (ok, _) in verdict.items() if ok), default=0)
        hi = min((m for m, (ok, _) in verdict.items() if not ok and m > best), default=None)
    return best, rows, hi is not None


def marginal(row: dict, slo_itl_ms: float, slo_ttft_ms: float, margin: float = 0.15) -> bool:
    """A result close enough to the SLO that one run does not settle it."""
    if row.get("refused") or not row["requests"] or row["itl_p99_ms"] is None or row["ttft_p99_ms"] is None:
        return False
    itl, ttft = row["itl_p99_ms"] / slo_itl_ms, row["ttft_p99_ms"] / slo_ttft_ms
    return abs(itl - 1) <= margin or (itl <= 1 + margin and abs(ttft - 1) <= margin)


def non_monotone(rows: list, capacity: int, slo_itl_ms: float, slo_ttft_ms: float) -> list[int]:
    """Client counts below the capacity that failed (noise, or a real dip): reported, never hidden."""
    return sorted({r["clients"] for r in rows if r["clients"] < capacity and not passes(r, slo_itl_ms, slo_ttft_ms)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--curve", default="h200-eager-qwen2.5-7b.json",
                    help="the verifier's cost curve: a file, or a name in deploy/cost-curves (it must give "
                         "kv_bytes_per_token, hbm_gb_s and kv_gb)")
    ap.add_argument("--drafter-curve", default="auto",
                    help="server_sd's 0.5B drafter on the same GPU (auto: the one the curve names, else "
                         "h200-roofline-qwen2.5-0.5b.json)")
    ap.add_argument("--eagle-curve", default="auto",
                    help="server_eagle's draft head (auto: the one the curve names, else the H200 7B one)")
    ap.add_argument("--clients", default="16,64,256,1024", help="client counts, ascending")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--slo-itl-ms", type=float, default=50.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--datasets", default="humaneval,sharegpt")
    ap.add_argument("--device", default="laptop", help=f"one of {', '.join(DEVICES)}")
    ap.add_argument("--also-device", default="phone", help="a second device class reported beside ('' for none)")
    ap.add_argument("--link", default="metro", choices=sorted(LINKS))
    ap.add_argument("--host-slots", type=int, default=0,
                    help="drafters on each replica's host for Tandem sessions that hand their runs to it (0: none)")
    ap.add_argument("--host-class", default="laptop", help="the host drafters' pace, as a device class")
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES,
                    help="acceptance traces: a bench.ceiling JSON (--drafter-engine llama.cpp --answer-lengths N)")
    ap.add_argument("--limit", type=int, default=0, help="the first N traced texts per dataset (0: all)")
    ap.add_argument("--answer-tokens", type=int, default=0,
                    help="tokens per answer (default 0: drawn from the traces' recorded ShareGPT answer lengths; a "
                         "fixed length keeps a closed loop's devices in step, their prompts arriving in bursts)")
    ap.add_argument("--context-tokens", type=int, default=0,
                    help="a conversation of about this many tokens (earlier turns in the prefix caches; 0: the "
                         "traced prompt alone)")
    ap.add_argument("--fresh-context", action="store_true",
                    help="long-context traffic: the context is a new document with every request, all prefilled")
    ap.add_argument("--think-s", type=float, default=0.0, help="mean think time between a device's requests")
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--seeds", type=int, default=None,
                    help="runs per load, their requests pooled into each percentile (default 3; --map: 2, for loads "
                         "within 15 %% of the SLO)")
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument("--verify-budget-tokens", type=int, default=0)
    prefill = ap.add_mutually_exclusive_group()
    prefill.add_argument("--batched-prefill", action="store_true",
                         help="prompts in chunks inside the verify forwards, as the product's scheduler does (the "
                              "default; accepted for older command lines)")
    prefill.add_argument("--serial-prefill", action="store_true",
                         help="the old rule: each prompt whole, one forward of its own between batches")
    ap.add_argument("--widths", default="1,2", help="tree widths the draft policy prices (1: chains only)")
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
    ap.add_argument("--report", type=Path, default=None,
                    help="the Markdown report (default bench/out/capacity.md, or capacity_map.md with --map)")
    ap.add_argument("--map", action="store_true", help="the regime map: a grid of targets, GPUs, SLOs, contexts, "
                                                       "traffic and devices (bench/capsim/regimes.py)")
    ap.add_argument("--full", action="store_true", help="with --map: every cell of the grid, not the default's")
    ap.add_argument("--cells", default="", help="with --map: only cells whose key (target/gpu/SLOms/context/traffic/"
                                                "device) contains this text (comma-separated: any of them)")
    ap.add_argument("--workers", type=int, default=2, help="with --map: processes")
    args = ap.parse_args(argv)

    if args.map:
        from .capsim.regimes import run_map
        return run_map(args)
    args.seeds = args.seeds or 3
    args.report = args.report or Path("bench/out/capacity.md")
    methods = [m for m in args.methods.split(",") if m]
    if bad := [m for m in methods if m not in METHODS]:
        ap.error(f"unknown method {bad}; known: {list(METHODS)}")
    try:
        clients = sorted({int(x) for x in args.clients.split(",") if x})
        scale = sorted({int(x) for x in args.scale_replicas.split(",") if x})
        widths = tuple(int(x) for x in args.widths.split(",") if x)
    except ValueError as e:
        ap.error(f"client and replica counts and widths are integers: {e}")
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
    devices = {"laptop": LAPTOP, "phone": PHONE, "browser-tab": BROWSER, "this-cpu": device_from_ceiling(args.traces)}
    for name in (args.device, args.also_device):
        if name and name not in devices:
            ap.error(f"unknown device {name}; known: {list(devices)}")
    drafter_file, eagle_file, drafter_note = drafters_for(args.curve, args.drafter_curve, args.eagle_curve)
    try:
        forward = Forward.load(args.curve)
        drafter, eagle = Forward.load(drafter_file), Forward.load(eagle_file)
    except CurveError as e:
        ap.error(str(e))
    base = Config("server_ar", datasets[0], 1, args.replicas, forward, devices[args.device], LINKS[args.link],
                  drafter, args.answer_tokens, args.think_s, args.warmup_s, args.duration_s,
                  max_batch_tokens=args.max_batch_tokens, budget_tokens=args.verify_budget_tokens,
                  batched_prefill=not args.serial_prefill, seed=args.seed, context_tokens=args.context_tokens,
                  fresh_context=args.fresh_context, widths=widths, eagle_drafter=eagle, host_slots=args.host_slots,
                  host_device=devices.get(args.host_class))

    def simulate(cfg: Config) -> dict:
        t0 = time.perf_counter()
        row = simulate_seeds(cfg, traces, args.seeds)
        row = {"method": cfg.method, "dataset": cfg.dataset, "clients": cfg.clients, "replicas": cfg.replicas,
               "device": cfg.device.name, "depth": cfg.depth or None, **row,
               "sim_s": round(time.perf_counter() - t0, 1)}
        _progress(f"{cfg.method} {cfg.dataset} {cfg.device.name} x{cfg.clients} on {cfg.replicas}: "
                  f"itl p50/p99 {row['itl_p50_ms']}/{row['itl_p99_ms']} ms (short answers' p99 "
                  f"{row['itl_short_p99_ms']}), ttft p99 {row['ttft_p99_ms']} ms, {row['server_tokens_per_s']} tok/s, "
                  f"gpu busy {row['gpu_busy']}, prefill {row['prefill_gpu_share']}"
                  + (f", depth {row['depth_mean']}" if "depth_mean" in row else "")
                  + (f", REFUSED: {row['refused']}" if row.get("refused") else "") + f" ({row['sim_s']} s)")
        return row

    results, capacity = [], {}
    for device in [d for d in (args.device, args.also_device) if d]:
        for method in methods:
            if device != args.device and not method.startswith("tandem"):
                continue  # the device does not matter to server-only methods
            for ds in datasets:
                cfg = replace(base, method=method, dataset=ds, device=devices[device],
                              depth=DEFAULT_DEPTH.get(method, 0))
                n, rows, bounded = capacity_search(
                    lambda c, cfg=cfg: simulate(replace(cfg, clients=c * cfg.replicas)), clients, args.slo_itl_ms,
                    args.slo_ttft_ms, args.refine)
                results += rows
                key = method if device == args.device else f"{method}@{device}"
                capacity.setdefault(key, {})[ds] = {
                    "clients_at_slo": n * args.replicas, "clients_per_gpu": round(n / forward.tp, 2),
                    "device": device, "bounded": bounded,
                    "non_monotone": non_monotone(rows, n, args.slo_itl_ms, args.slo_ttft_ms),
                    "assumptions": ASSUMPTIONS.get(method, "")}

    # the goals compare Tandem with server-only serving at the load where server-only reaches its capacity
    for ds in datasets:
        n = capacity.get("server_ar", {}).get(ds, {}).get("clients_at_slo")
        have = {(r["method"], r["dataset"], r["clients"], r["device"]) for r in results}
        if n and "tandem_adaptive" in methods and ("tandem_adaptive", ds, n, args.device) not in have:
            results.append(simulate(replace(base, method="tandem_adaptive", dataset=ds, clients=n)))

    scaling = []
    for r in scale:
        for method in [m for m in args.scale_methods.split(",") if m in methods]:
            per_gpu = capacity.get(method, {}).get(datasets[0], {}).get("clients_at_slo", clients[0])
            cfg = replace(base, method=method, dataset=datasets[0], replicas=r, depth=DEFAULT_DEPTH.get(method, 0))
            probe = sorted({max(1, int(per_gpu * f)) for f in (0.8, 0.9, 1.0, 1.1, 1.25)})
            n, rows, bounded = capacity_search(lambda c, cfg=cfg: simulate(replace(cfg, clients=c * cfg.replicas)),
                                               probe, args.slo_itl_ms, args.slo_ttft_ms, args.refine)
            scaling.append({"method": method, "dataset": datasets[0], "replicas": r, "clients_at_slo": n * r,
                            "clients_per_gpu": round(n / forward.tp, 2), "bounded": bounded,
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
              "curve_label": forward.curve.label, "tp": forward.tp,
              "drafter_curve": Path(drafter_file).name, "eagle_curve": Path(eagle_file).name,
              "drafter_note": drafter_note, "link": args.link,
              "link_profile": asdict(LINKS[args.link]), "device": args.device,
              "devices": {k: asdict(v) for k, v in devices.items()}, "traces": str(args.traces),
              "acceptance": {d: round(traces.acceptance(d), 3) for d in datasets},
              "slo_itl_ms": args.slo_itl_ms, "slo_ttft_ms": args.slo_ttft_ms, "replicas": args.replicas,
              "answer_tokens": args.answer_tokens, "think_s": args.think_s, "duration_s": args.duration_s,
              "warmup_s": args.warmup_s, "seeds": args.seeds, "max_batch_tokens": args.max_batch_tokens,
              "max_batch_tokens_effective": args.max_batch_tokens if forward.allows(args.max_batch_tokens)
              else forward.curve.tokens[-1],  # a measured curve caps forwards at its last point
              "batched_prefill": not args.serial_prefill, "context_tokens": args.context_tokens,
              "fresh_context": args.fresh_context, "widths": list(widths),
              "kv_ms_per_token": forward.kv_ms_per_token, "kv_tokens": forward.kv_tokens,
              "assumptions": {m: ASSUMPTIONS[m] for m in methods if m in ASSUMPTIONS},
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
