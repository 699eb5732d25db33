"""``bench.capacity``'s goals, Markdown report and plot."""
from __future__ import annotations

from pathlib import Path

from bench.output import pyplot

CODE, CHAT = "humaneval", "sharegpt"
GOALS = [  # (goal, dataset, what is compared, target)
    ("capacity >= 2.5x server_ar on code", CODE, "capacity_vs_ar", 2.5),
    ("capacity >= 1.5x server_ar on chat", CHAT, "capacity_vs_ar", 1.5),
    ("capacity >= server_sd on code", CODE, "capacity_vs_sd", 1.0),
    ("capacity >= server_sd on chat", CHAT, "capacity_vs_sd", 1.0),
    ("p50 ITL <= server_ar's at server_ar's capacity (code)", CODE, "itl_at_ar_capacity", 1.0),
    ("p50 ITL <= server_ar's at server_ar's capacity (chat)", CHAT, "itl_at_ar_capacity", 1.0),
    ("GPU-s per 1k tokens <= 0.4x server_ar at its capacity (code)", CODE, "gpu_at_ar_capacity", 0.4),
]


def _row(result: dict, method: str, ds: str, clients: int) -> dict | None:
    rows = [r for r in result["results"] if r["method"] == method and r["dataset"] == ds
            and r["clients"] == clients and r["device"] == result["device"]]
    return rows[-1] if rows else None


def held_back(result: dict, ds: str, method: str = "tandem_adaptive") -> str:
    """Which term of a Tandem round is largest where the method first fails its SLO (the round trip, the verify
    forward with its queue, the drafting), with the acceptance (tokens per verify) and what speculation spends
    there (forward tokens per committed token: 1.0 for server-only decoding)."""
    fails = [r for r in result["results"] if r["method"] == method and r["dataset"] == ds
             and r["device"] == result["device"] and not passes(r, result["slo_itl_ms"], result["slo_ttft_ms"])]
    if not fails:
        return "no failing load was simulated"
    r = min(fails, key=lambda x: x["clients"])
    dev = result["devices"][result["device"]]
    nodes = r["forward_tokens_per_token"] * r["tokens_per_verify"] - 1  # drafted tokens per verify
    terms = {"verifier curve": r["forward_ms_mean"] + r["queue_ms_mean"],
             "RTT": 2 * result["link_profile"]["one_way_ms"], "drafter speed": dev["level_ms"] * max(0.0, nodes)}
    worst = max(terms, key=terms.get)
    parts = ", ".join(f"{k} {v:.0f} ms" for k, v in terms.items())
    return (f"{worst}: at {r['clients']} clients a round is {parts}; forwards of {r['forward_tokens_mean']:.0f} "
            f"tokens; acceptance {r['tokens_per_verify']:.2f} tokens per verify for "
            f"{r['forward_tokens_per_token']:.2f} forward tokens per committed token (server_ar: 1.00)")


def passes(row: dict, slo_itl_ms: float, slo_ttft_ms: float) -> bool:
    """Within the SLO: p99 time per output token (answers of at least 4 tokens) and p99 time to first token; a run
    refused (a forward past a measured curve) never passes."""
    itl, ttft = row["itl_p99_ms"], row["ttft_p99_ms"]
    return (row["requests"] > 0 and not row.get("refused") and itl is not None and itl <= slo_itl_ms
            and ttft is not None and ttft <= slo_ttft_ms)


def goals(result: dict) -> list[dict]:
    cap = result["capacity"]
    out = []
    for goal, ds, kind, target in GOALS:
        tandem = cap.get("tandem_adaptive", {}).get(ds, {}).get("clients_at_slo")
        ar = cap.get("server_ar", {}).get(ds, {}).get("clients_at_slo")
        value = None
        if kind == "capacity_vs_ar" and tandem is not None and ar:
            value = tandem / ar
        elif kind == "capacity_vs_sd":
            sd = cap.get("server_sd", {}).get(ds, {}).get("clients_at_slo")
            value = tandem / sd if tandem is not None and sd else None
        elif ar:
            a, t = _row(result, "server_ar", ds, ar), _row(result, "tandem_adaptive", ds, ar)
            if a and t:
                key = "itl_p50_ms" if kind == "itl_at_ar_capacity" else "gpu_s_per_1k_tokens"
                if a[key] and t[key] is not None:
                    value = t[key] / a[key]
        lower_better = kind in ("itl_at_ar_capacity", "gpu_at_ar_capacity")
        met = value is not None and (value <= target if lower_better else value >= target)
        out.append({"goal": goal, "dataset": ds, "value": None if value is None else round(value, 3),
                    "target": target, "met": met, "held_back_by": None if met else held_back(result, ds)})
    return out


def report(result: dict, path: Path) -> None:
    dev = result["devices"][result["device"]]
    lines = [
        "# Capacity: many devices sharing GPU verifiers (simulated)", "",
        f"Every figure here is **simulated** by `bench.capacity` (discrete events, virtual clock); "
        f"curve `{result['curve']}` ({result['curve_label']}), server-side drafter `{result['drafter_curve']}`, "
        f"link {result['link']} ({result['link_profile']['one_way_ms']} ms one way), device "
        f"{result['device']} ({dev['level_ms']} ms a level, {dev['catch_up_ms']} ms a caught-up token; "
        f"{dev['label']}). Acceptance from `{Path(result['traces']).name}`: first-choice agreement "
        + ", ".join(f"{d} {a}" for d, a in result["acceptance"].items())
        + f". SLO: p99 time per output token <= {result['slo_itl_ms']} ms, p99 TTFT <= {result['slo_ttft_ms']} ms. "
        f"{result['answer_tokens'] or 'ShareGPT-length'} tokens per answer, think time {result['think_s']} s, "
        f"{result['duration_s']} s measured after {result['warmup_s']} s.", "",
        "## Capacity (clients at the SLO)", "", "| method | " + " | ".join(result["acceptance"]) + " |",
        "|---|" + "---|" * len(result["acceptance"])]
    for m, by in result["capacity"].items():
        cells = [by.get(d) for d in result["acceptance"]]
        lines.append(f"| {m} | " + " | ".join("" if c is None else ("" if c["bounded"] else ">= ") +
                                             str(c["clients_at_slo"]) for c in cells) + " |")
    lines += ["", "## Goals", "", "| goal | value | target | met | held back by |", "|---|---|---|---|---|"]
    for g in result["goals"]:
        lines.append(f"| {g['goal']} | {g['value']} | {g['target']} | {'yes' if g['met'] else 'no'} | "
                     f"{g['held_back_by'] or ''} |")
    if result["scaling"]:
        lines += ["", "## Scaling", "", "| method | replicas | clients at SLO | per GPU |", "|---|---|---|---|"]
        lines += [f"| {s['method']} | {s['replicas']} | {s['clients_at_slo']} | {s['clients_per_gpu']} |"
                  for s in result["scaling"]]
    lines += ["", "## Validation against real paced runs", ""]
    if result["validation"]:
        lines += ["| run | link | method | dataset | clients | metric | real | simulated | error % |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {v['source']} | {v.get('profile', 'loopback')} | {v['method']} | {v['dataset']} | "
                  f"{v['clients']} | {v['metric']} | {v['real']} | {v['simulated']} | {v['error_pct']:+} |"
                  for v in result["validation"]]
        counts = sorted({v["clients"] for v in result["validation"]})
        curves = sorted({Path(v["curve"]).name for v in result["validation"]})
        lines += ["", f"Validated: {', '.join(map(str, counts))} client(s) on one replica paced to "
                      f"{', '.join(curves)}. Everything else (more clients and replicas, other curves, devices and "
                      "links) is extrapolation from the same model."]
    else:
        lines.append("None in this run: every figure is extrapolation.")
    lines += ["", "## All runs", "", "| method | dataset | device | clients | ITL p50 / p99 ms | TTFT p50 / p99 ms | "
              "tokens/s (server) | GPU-s / 1k tok | busy | fwd ms | fwd tokens | tok / verify | past curve |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["results"], key=lambda r: (r["dataset"], r["method"], r["device"], r["clients"])):
        lines.append(f"| {r['method']} | {r['dataset']} | {r['device']} | {r['clients']} | {r['itl_p50_ms']} / "
                     f"{r['itl_p99_ms']} | {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['server_tokens_per_s']} | "
                     f"{r['gpu_s_per_1k_tokens']} | {r['gpu_busy']} | {r['forward_ms_mean']} | "
                     f"{r['forward_tokens_mean']} | {r['tokens_per_verify']} | {r['beyond_curve_share']} |")
    lines += [""] + [f"![]({Path(p).name})" for p in result.get("plots", [])]
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, path: Path) -> list[str]:
    """p99 time per output token against clients, one line per method, a panel per dataset."""
    plt = pyplot()
    if plt is None:
        return []
    datasets = list(result["acceptance"])
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for m in dict.fromkeys(r["method"] for r in result["results"]):
            for dev in dict.fromkeys(r["device"] for r in result["results"]):
                pts = sorted((r["clients"], r["itl_p99_ms"]) for r in result["results"] if r["method"] == m
                             and r["dataset"] == ds and r["device"] == dev and r["itl_p99_ms"] is not None)
                if pts:
                    label = m if dev == result["device"] else f"{m} ({dev})"
                    ax.plot(*zip(*pts), marker="o", label=label, linestyle="-" if dev == result["device"] else ":")
        ax.axhline(result["slo_itl_ms"], color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{ds}: p99 time per output token (simulated)")
        ax.set_xlabel(f"clients ({result['replicas']} replica(s))")
        ax.set_ylabel("ms")
        ax.legend(fontsize=7)
    out = path.with_name(path.stem + "_itl.png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [str(out)]
