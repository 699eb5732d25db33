"""The regime map's Markdown table and heat map (``python -m bench.capacity --map``)."""
from __future__ import annotations

import math
from pathlib import Path

from bench.output import pyplot

SHORT = {"qwen2.5-7b": "7B", "qwen2.5-14b": "14B", "qwen2.5-32b": "32B", "qwen2.5-72b": "72B"}


def _n(x) -> str:
    return "-" if x is None else (f"{x:g}" if isinstance(x, (int, float)) else str(x))


def report(result: dict, path: Path) -> None:
    lines = [
        "# Where Tandem pays: the regime map (simulated)", "",
        f"Every figure here is **simulated** by `bench.capacity --map` ({result['date']}, {result['machine']}, "
        f"{result['map_s']} s) on cost curves **derived** from datasheets and published architectures "
        "(`deploy/cost-curves/derive.py`; each file says from what). Clients per GPU at p99 inter-token latency <= "
        f"the cell's SLO (answers of >= 4 tokens) and p99 TTFT <= {result['slo_ttft_ms']:g} ms; {result['seeds']} "
        f"seeds pooled per load, about {result['window']['answers_per_seed']} answers a seed; capacity to within "
        f"{result['resolution']:.0%}. Link: {result['link']} ({result['link_profile']['one_way_ms']} ms one way). "
        "Prompts batched with decoding (chunked prefill) for every method. `>=` marks a capacity no failing load "
        "bounded; `*` a failing load below the capacity (non-monotonic results, kept).", "",
        "| target | GPU | F/S | SLO ms | context | traffic | device | server-only | server SD (depth) | EAGLE-class "
        "| Tandem | bound | Tandem / best baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["cells"]:
        s = r["searches"]

        def cell(k: str, key: str, r: dict = r) -> str:
            x = r["searches"][k]
            return ("" if x["bounded"] else ">= ") + _n(r["clients"][key]) + ("*" if x["non_monotone"] else "")

        depth = s["server_sd"]["at_capacity"].get("depth_mean")
        ratio = r["ratio"]
        lines.append(f"| {SHORT.get(r['target'], r['target'])} | {r['gpu'].upper()}"
                     f"{' x' + str(r['tp']) if r['tp'] > 1 else ''} | {r['floor_share']:.2f} | {r['slo_itl_ms']:g} | "
                     f"{r['context']} | {r['dataset']} | {r['device']} | {cell('server_ar', 'server_ar')} | "
                     f"{cell('server_sd', 'server_sd')} ({_n(depth)}) | {cell('server_eagle', 'server_eagle')} | "
                     f"{cell('tandem', 'tandem')} | {_n(r['bound'])} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} ({r['best_baseline']}) |")
    lines += ["", "F/S: the target's forward floor (weights read + launch) over the per-token SLO. Clients are per GPU "
              "(a replica of a 72B or 32B spans 2-4 GPUs). bound: Tandem's acceptance in closed form, every session "
              "in every forward, drafting free, prompts included (`bench/capsim/bound.py`).", "",
              "## Baselines' assumptions", ""]
    lines += [f"- `{m}`: {a}" for m, a in result["assumptions"].items()]
    lines += ["", "## Devices", ""]
    lines += [f"- {k}: {v['level_ms']} ms a drafted level, {v['catch_up_ms']} ms a caught-up token ({v['label']}: "
              f"{v['source']})" for k, v in result["devices"].items()]
    lines += ["", "## At each capacity", "",
              "| cell | method | probes | ITL p50 / p99 ms | short answers' p99 | TTFT p99 | GPU busy | prefill share "
              "| drafter share | tokens / verify | sim s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["cells"]:
        key = f"{SHORT.get(r['target'])} {r['gpu']} {r['slo_itl_ms']:g} {r['context']} {r['dataset']} {r['device']}"
        for m, x in r["searches"].items():
            a = x["at_capacity"]
            lines.append(f"| {key} | {m} | {x['probes']} | {_n(a.get('itl_p50_ms'))} / {_n(a.get('itl_p99_ms'))} | "
                         f"{_n(a.get('itl_short_p99_ms'))} | {_n(a.get('ttft_p99_ms'))} | {_n(a.get('gpu_busy'))} | "
                         f"{_n(a.get('prefill_gpu_share'))} | {_n(a.get('drafter_gpu_share'))} | "
                         f"{_n(a.get('tokens_per_verify'))} | {x['sim_s']} |")
    if result.get("plots"):
        lines += [""] + [f"![]({Path(p).name})" for p in result["plots"]]
    path.write_text("\n".join(lines) + "\n")


def heatmap(result: dict, path: Path) -> list[str]:
    """Tandem / best baseline: a row per (target, GPU, context, device), a column per (traffic, SLO)."""
    plt = pyplot()
    if plt is None or not result["cells"]:
        return []
    cells = result["cells"]
    rows = sorted({(r["target"], r["gpu"], r["context"], r["device"]) for r in cells},
                  key=lambda k: (list(SHORT).index(k[0]) if k[0] in SHORT else 9, k[1], k[2], k[3]))
    cols = sorted({(r["dataset"], r["slo_itl_ms"]) for r in cells}, key=lambda k: (k[0], k[1]))
    grid = [[None] * len(cols) for _ in rows]
    for r in cells:
        i = rows.index((r["target"], r["gpu"], r["context"], r["device"]))
        j = cols.index((r["dataset"], r["slo_itl_ms"]))
        grid[i][j] = r["ratio"]
    import numpy as np
    data = np.array([[math.log2(x) if x else np.nan for x in row] for row in grid], dtype=float)
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(cols), 1.2 + 0.42 * len(rows)))
    lim = max(1.0, float(np.nanmax(np.abs(data))) if np.isfinite(data).any() else 1.0)
    im = ax.imshow(data, cmap="RdYlGn", vmin=-lim, vmax=lim, aspect="auto")
    for i, row in enumerate(grid):
        for j, x in enumerate(row):
            ax.text(j, i, "-" if x is None else f"{x:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(cols)), [f"{d}\n{s:g} ms" for d, s in cols], fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{SHORT.get(t, t)} {g.upper()} {c // 1024}k {d}" for t, g, c, d in rows],
                  fontsize=8)
    ax.set_title("Tandem / best baseline, clients per GPU at the SLO (simulated, derived curves)", fontsize=9)
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("log2 ratio (green: Tandem holds more)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]
