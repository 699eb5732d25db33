"""Portable llama.cpp build (runtime CPU-variant dispatch) against a native build (-march=native), in one run.

    python -m bench.portable --limit 2 --json bench/out/portable.json

The cached wheel and the images are built portable (deploy/llama-cpp.cmake-args), so they run on any x86-64 CPU;
this measures what that costs on this machine. Each build is installed into its own directory and timed in child
processes, alternating builds round by round so that drift on a shared host hits both alike: prefill tokens/s,
one-token decode ms (what the drafter and target-only decoding do), and 8-token batch ms (a verify forward) on the
target model, plus the portable build with extra buffer types off (what an AMX host that fails the probe runs).
Builds missing from the wheel cache are built first (the native one ~5 min, the portable one ~25 min on 2 cores).

Correctness check: every configuration's greedy tokens must equal the native build's, except at a near-tie
(different kernels round differently); otherwise the bench exits 1.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.core import lifetime
from tandem.core.cache import cache_dir

from .output import cpu_name, finish

ROOT = Path(__file__).resolve().parent.parent
LLAMA = "llama-cpp-python==0.3.36"
ARGS_FILE = ROOT / "deploy" / "llama-cpp.cmake-args"
NATIVE_ARGS = "-DGGML_NATIVE=ON"
NEAR_TIE = 1.0  # logits: a top-2 gap this small can flip between builds whose kernels round differently


def _progress(msg: str) -> None:
    print(f"[portable] {msg}", file=sys.stderr, flush=True)


def portable_args() -> str:
    """The flags in deploy/llama-cpp.cmake-args, one line, as the Makefile reads them."""
    return " ".join(w for line in ARGS_FILE.read_text().splitlines() if not line.startswith("#") for w in line.split())


def wheel_dir(cmake_args: str) -> Path:
    """Where a build with these flags is cached: the Makefile computes the same key."""
    key = hashlib.sha256(f"{LLAMA} {cmake_args}".encode()).hexdigest()[:12]
    return cache_dir() / "wheels" / key


def ensure_wheel(cmake_args: str) -> Path:
    out = wheel_dir(cmake_args)
    found = sorted(out.glob("llama_cpp_python-*.whl"))
    if found:
        return found[-1]
    _progress(f"building {LLAMA} with {cmake_args} (minutes; cached in {out})")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CMAKE_ARGS=cmake_args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), LLAMA], check=True, env=env)
    return sorted(out.glob("llama_cpp_python-*.whl"))[-1]


def install(wheel: Path, into: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(into), str(wheel)],
                   check=True)


# -- the timed child ------------------------------------------------------------------------------------------------
def child(spec: dict) -> int:
    """Runs with one build first on sys.path: time prefill, one-token decode and 8-token batches on the target."""
    import numpy as np

    from tandem.core.llama_runtime import LlamaContext, LlamaModel, _variant
    model = LlamaModel(spec["model"])
    ctx = LlamaContext(model, n_ctx=1024, n_seq_max=1, n_batch=512, n_threads=spec["threads"])
    out = {"variant": _variant[0], "extra_bufts": model.extra_bufts, "prompts": []}
    for prompt in spec["prompts"]:
        ctx.clear()
        t0 = time.perf_counter()
        row = ctx.prefill(prompt, 0, logits_last=True)[0]
        prefill_s = time.perf_counter() - t0
        tokens, gaps, decode_s, pos = [], [], [], len(prompt)
        for _ in range(spec["new_tokens"]):
            top2 = np.partition(row, -2)[-2:]
            tok = int(np.argmax(row))
            tokens.append(tok)
            gaps.append(float(top2[1] - top2[0]))
            t0 = time.perf_counter()
            row = ctx.decode([tok], [pos], [(0,)], [True])[0]
            decode_s.append(time.perf_counter() - t0)
            pos += 1
        batch_s = []
        for _ in range(spec["batches"]):  # an 8-node chain verify on the committed text, then rolled back
            t0 = time.perf_counter()
            ctx.decode(tokens[:8], range(pos, pos + 8), [(0,)] * 8, [True] * 8)
            batch_s.append(time.perf_counter() - t0)
            ctx.seq_rm(0, pos, -1)
        out["prompts"].append({"prefill_tokens": len(prompt), "prefill_s": prefill_s, "tokens": tokens,
                               "gaps": gaps, "decode_ms": 1000 * statistics.median(decode_s),
                               "batch8_ms": 1000 * statistics.median(batch_s)})
    print(json.dumps(out))
    return 0


def run_child(site: Path, spec: dict, env_extra: dict) -> dict:
    env = dict(lifetime.child_env(), PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), **env_extra)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        r = subprocess.run([sys.executable, "-m", "bench.portable", "--child", f.name], capture_output=True,
                           text=True, env=env, cwd=ROOT)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        raise RuntimeError(f"timing child failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- orchestration --------------------------------------------------------------------------------------------------
def first_divergence(tokens: list[int], ref: dict) -> tuple[int | None, float | None]:
    for i, (a, b) in enumerate(zip(tokens, ref["tokens"])):
        if a != b:
            return i, ref["gaps"][i]
    return None, None


def report(result: dict, path: Path) -> None:
    lines = ["# Portable vs native llama.cpp build", "",
             f"CPU: {result['cpu']}. Target {result['target']}, {result['threads']} threads, {result['prompts']} "
             f"HumanEval prompts, {result['new_tokens']} greedy tokens each, {result['rounds']} alternating rounds "
             f"(medians). Portable = `{result['portable_cmake_args']}` (chose CPU variant "
             f"`{result['configs']['portable']['variant']}`); native = `{NATIVE_ARGS}`.", "",
             "| build | decode ms/token | vs native | 8-token batch ms | vs native | prefill tokens/s | vs native "
             "| same tokens |", "|---|---|---|---|---|---|---|---|"]
    for name, c in result["configs"].items():
        lines.append(f"| {name} | {c['decode_ms']} | {c['decode_vs_native']}x | {c['batch8_ms']} | "
                     f"{c['batch8_vs_native']}x | {c['prefill_tokens_per_s']} | {c['prefill_vs_native']}x | "
                     f"{c['tokens_identical']} |")
    lines += ["", f"Portable decode within 5 % of native: **{result['portable_within_5pct']}**. Lower ms is better; "
              "`portable-extra-off` is what runs where the AMX probe fails (no repacked weights)."]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.portable", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=2, help="HumanEval prompts")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--batches", type=int, default=8, help="timed 8-token batches per prompt")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds over the builds")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--target", default="default")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/portable.md"))
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        lifetime.bind_to_parent()
        return child(json.loads(args.child.read_text()))
    from tandem.core.llama_runtime import LlamaModel
    from tandem.core import logs
    from tandem.orchestrator import models

    from tandem.orchestrator.datasets import humaneval, humaneval_messages
    logs.configure()
    target = models.resolve(args.target, "target")
    tok = LlamaModel(target, vocab_only=True)
    prompts = [tok.tokenize(tok.chat_prompt(humaneval_messages(p))) for p in humaneval(args.limit)]
    wheels = {"native": ensure_wheel(NATIVE_ARGS), "portable": ensure_wheel(portable_args())}
    spec = {"model": str(target), "threads": args.threads, "prompts": prompts, "new_tokens": args.new_tokens,
            "batches": args.batches}
    configs = {"native": ("native", {}), "portable": ("portable", {}),
               "portable-extra-off": ("portable", {"TANDEM_LLAMA_EXTRA_BUFTS": "off"})}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory(prefix="tandem-portable-") as tmp:
        sites = {}
        for build, wheel in wheels.items():
            sites[build] = Path(tmp) / build
            install(wheel, sites[build])
        for r in range(args.rounds):
            for name, (build, env) in configs.items():
                runs[name].append(run_child(sites[build], spec, env))
                p = runs[name][-1]["prompts"]
                _progress(f"round {r + 1}/{args.rounds} {name}: decode {statistics.mean(x['decode_ms'] for x in p):.2f}"
                          f" ms/token, batch8 {statistics.mean(x['batch8_ms'] for x in p):.1f} ms")

    def med(name: str, key: str) -> float:
        return statistics.median(statistics.mean(x[key] for x in run["prompts"]) for run in runs[name])

    def prefill_tps(name: str) -> float:
        return statistics.median(sum(x["prefill_tokens"] for x in run["prompts"]) /
                                 sum(x["prefill_s"] for x in run["prompts"]) for run in runs[name])

    ref = runs["native"][0]["prompts"]
    ok, out = True, {}
    for name in configs:
        divergences = []
        for run in runs[name]:
            for p, r in zip(run["prompts"], ref):
                at, gap = first_divergence(p["tokens"], r)
                if at is not None:
                    divergences.append({"at": at, "gap": round(gap, 3)})
                    ok &= gap < NEAR_TIE
        out[name] = {"variant": runs[name][0]["variant"], "extra_bufts": runs[name][0]["extra_bufts"],
                     "decode_ms": round(med(name, "decode_ms"), 2), "batch8_ms": round(med(name, "batch8_ms"), 2),
                     "prefill_tokens_per_s": round(prefill_tps(name), 1), "tokens_identical": not divergences,
                     "divergences": divergences[:4]}
    for c in out.values():
        c["decode_vs_native"] = round(c["decode_ms"] / out["native"]["decode_ms"], 3)
        c["batch8_vs_native"] = round(c["batch8_ms"] / out["native"]["batch8_ms"], 3)
        c["prefill_vs_native"] = round(c["prefill_tokens_per_s"] / out["native"]["prefill_tokens_per_s"], 3)
    cpu = cpu_name("unknown")
    result = {"cpu": cpu, "target": target.name, "threads": args.threads, "prompts": len(prompts),
              "new_tokens": args.new_tokens, "rounds": args.rounds, "portable_cmake_args": portable_args(),
              "configs": out, "portable_within_5pct": out["portable"]["decode_vs_native"] <= 1.05,
              "wheels": {k: v.name for k, v in wheels.items()}}
    return finish(result, args.json, report, args.report, ok,
                  "a build's greedy tokens diverge from the native build's other than at a near-tie", "portable")


if __name__ == "__main__":
    sys.exit(main())
