"""Drafter engines and head vocabularies: what drafting costs, what it covers, what it buys end to end.

    python -m bench.drafter --limit 2 --calibration 12 --json bench/out/drafter.json

In one run, on the real pair:

1. VocabTrim calibration: heads are ranked by the declared corpus (orchestrator.calibration: ShareGPT replies and
   the Python standard library, millions of tokens) merged with the target's greedy outputs on the first halves of
   HumanEval and ShareGPT; K in ``--ks`` plus the K chosen by coverage: the smallest holding ``--coverage`` of
   the target's tokens on calibration prompts its ranking did not see (two folds, orchestrator.calibration);
2. held-out prompts (the second halves, disjoint): the target's own outputs are the coverage reference and the
   lossless reference;
3. drafting cost per engine, quantization (``--quants``) and K: ms per drafted token (a chain of 8, one decoder
   call per level) and per tree (4,16,6), after the prompt is cached; the files it runs from (MB on disk) and its
   peak resident memory (a child process per row loads it and drafts);
4. end to end through gRPC on localhost with a fixed chain (1,6,6) in lock-step rounds: tau and tokens/s, with and
   without the n-gram branch (edge.ngram), each output checked token by token against target-only decoding.

The llama.cpp drafter always computes its full head inside ``llama_decode``; the bench measures what that head
costs (a decode with logits minus one without) to show whether a trimmed head could save anything there.
Exits 1 when an output diverges from target-only decoding other than at a measured near-tie.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .output import cpu_name, finish
from bench.output import pyplot

K_LIST = (0, 32000, 16000, 8000, 4000)  # 0 = full vocabulary
CHAIN, TREE, E2E = "1,8,8", "4,16,6", "1,6,6"
# what the SDK's provider choice (edge.onnx_drafter.providers_for) gives on the platforms it ships for, with the
# providers onnxruntime's packages for them carry (onnxruntime-android / onnxruntime-objc, the PyPI wheels)
PLATFORMS = (("Linux", "x86_64", ["CPUExecutionProvider"]),
             ("Linux", "aarch64", ["CPUExecutionProvider"]),
             ("Windows", "AMD64", ["CPUExecutionProvider", "DmlExecutionProvider"]),
             ("Darwin", "arm64", ["CoreMLExecutionProvider", "CPUExecutionProvider"]),
             ("Android", "aarch64", ["NnapiExecutionProvider", "XnnpackExecutionProvider", "QNNExecutionProvider",
                                     "CPUExecutionProvider"]),
             ("iOS", "arm64", ["CoreMLExecutionProvider", "XnnpackExecutionProvider", "CPUExecutionProvider"]))


def _progress(msg: str) -> None:
    print(f"[drafter] {msg}", file=sys.stderr, flush=True)


def draft_costs(drafter, prompts, repeats: int = 2) -> tuple[float, float]:
    """(ms per drafted token of a chain, ms per tree), prompt caught up beforehand, median over prompts x repeats."""
    from tandem.core.tree import TreeShape
    chain, tree = TreeShape.parse(CHAIN), TreeShape.parse(TREE)
    per_token, per_tree = [], []
    for p in prompts:
        drafter.start(p)
        for _ in range(repeats):
            for shape, out in ((chain, per_token), (tree, per_tree)):
                drafter.catch_up()  # the root's logits (re-evaluated after the previous draft's rollback)
                t0 = time.perf_counter()
                built = drafter.draft(shape)
                ms = (time.perf_counter() - t0) * 1000
                out.append(ms / max(1, len(built.tree)) if shape is chain else ms)
                drafter.commit(built, [], [])  # nothing accepted: back to the committed prefix
    return float(np.median(per_token)), float(np.median(per_tree))


def disk_mb(engine: str, path: Path, ids=None) -> float:
    """MB of the files a drafter runs from: the GGUF, or the ONNX export's decoder and row tables plus the head graph
    for this vocabulary (built on first use)."""
    if engine == "llama_cpp":
        return round(path.stat().st_size / 1e6, 1)
    files = [path / "decoder.onnx", *path.glob("embed*.npy"), *path.glob("head*.npy")]
    quant = json.loads((path / "meta.json").read_text())["quant"]
    if ids is None:
        files.append(path / f"head-full-{quant}.onnx")
    else:
        import hashlib
        files.append(path / f"head-{len(ids)}-{hashlib.sha256(ids.tobytes()).hexdigest()[:12]}-{quant}.onnx")
    return round(sum(f.stat().st_size for f in files if f.is_file()) / 1e6, 1)


def peak_rss_mb(engine: str, path: Path, gguf: Path, threads: int, prompt: list[int], ids=None) -> float:
    """Peak resident memory (VmHWM) of a fresh process that loads the drafter and drafts a chain and a tree."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = ""
        if ids is not None:
            ids_file = f"{tmp}/ids.npy"
            np.save(ids_file, ids)
        spec = json.dumps({"engine": engine, "path": str(path), "gguf": str(gguf), "threads": threads,
                           "prompt": prompt, "ids": ids_file})
        proc = subprocess.run([sys.executable, "-m", "bench.drafter", "--rss-probe", spec], capture_output=True,
                              text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"rss probe failed: {proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def _rss_probe(spec: str) -> int:
    from tandem.core.tree import TreeShape
    s = json.loads(spec)
    if s["engine"] == "llama_cpp":
        from tandem.edge.llama_drafter import LlamaDrafter
        d = LlamaDrafter(s["path"], n_ctx=4096, n_threads=s["threads"])
    else:
        from tandem.edge.onnx_drafter import OnnxDrafter
        ids = np.load(s["ids"]) if s["ids"] else None
        d = OnnxDrafter(s["path"], tokenizer_gguf=s["gguf"], n_ctx=4096, n_threads=s["threads"], vocab_ids=ids)
    d.start(s["prompt"])
    for shape in (CHAIN, TREE):
        d.commit(d.draft(TreeShape.parse(shape)), [], [])
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(round(hwm / 1024, 1))
    return 0


def llama_head_ms(drafter, prompt, repeats: int = 8) -> dict:
    """One-token decodes with and without logits on the llama.cpp drafter: the difference is its LM head."""
    ctx = drafter._ctx
    drafter.start(prompt)
    drafter.catch_up()
    n = len(prompt)
    out = {}
    for logits in (True, False):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ctx.decode([prompt[-1]], [n], [(0,)], [logits])
            times.append((time.perf_counter() - t0) * 1000)
            ctx.seq_rm(0, n, -1)
        out["with_logits_ms" if logits else "without_logits_ms"] = round(float(np.median(times)), 2)
    out["head_ms"] = round(out["with_logits_ms"] - out["without_logits_ms"], 2)
    return out


def e2e(client, prompts, datasets, refs, noise, max_new_tokens: int) -> dict:
    from tandem.cloud import reference
    rows, verdicts = [], []
    for prompt, ds, ref in zip(prompts, datasets, refs):
        gen = client.generate(prompt, max_new_tokens=max_new_tokens).result()
        s = gen.stats
        rows.append((ds, s.generated_tokens, s.rounds, s.wall_s, s.ngram_accepted))
        verdicts.append(reference.classify(gen.tokens, ref, noise)[0])

    def summary(sel):
        tokens, rounds, wall = (sum(r[i] for r in sel) for i in (1, 2, 3))
        return {"tau": round(tokens / rounds, 3) if rounds else 0.0,
                "tokens_per_s": round(tokens / wall, 2) if wall else 0.0}

    return {**summary(rows), "by_dataset": {d: summary([r for r in rows if r[0] == d]) for d in sorted(set(datasets))},
            "ngram_accepted": sum(r[4] for r in rows),
            "exact": verdicts.count("exact"), "near_tie": verdicts.count("near_tie"), "other": verdicts.count("other")}


def plot(result: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    first = next((r.get("quant") for r in result["results"] if r["engine"] == "onnx"), None)
    rows = [r for r in result["results"] if r["engine"] == "onnx" and not r["ngram"] and r.get("quant") == first]
    rows.sort(key=lambda r: r["vocab_k"] or 10 ** 9)
    labels = [str(r["vocab_k"] or "full") for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.plot(labels, [r["draft_ms_per_token"] for r in rows], "o-", label="ONNX draft ms / token")
    llama = next((r for r in result["results"] if r["engine"] == "llama_cpp" and not r["ngram"]), None)
    if llama:
        ax.axhline(llama["draft_ms_per_token"], ls="--", c="gray", label="llama.cpp draft ms / token (full)")
    ax.set_xlabel("head vocabulary K")
    ax.set_ylabel("ms per drafted token")
    ax2 = ax.twinx()
    ax2.plot(labels, [r["tau"] for r in rows], "s-", c="tab:red", label="tau (chain 1,6,6)")
    ax2.set_ylabel("tau")
    fig.legend(fontsize=7, loc="upper center", ncol=3)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    name = "drafter_k.png"
    fig.savefig(path.parent / name, dpi=110)
    plt.close(fig)
    return name


def report(result: dict, path: Path) -> None:
    c = result.get("corpus", {})
    lines = ["# Drafter engines, VocabTrim heads and n-gram drafts", "",
             f"CPU {result.get('cpu', '?')}, {result['threads']} threads. Held-out: {result['prompts']} prompts "
             f"(HumanEval + ShareGPT second halves), {result['max_new_tokens']} new tokens, temperature 0. Head "
             f"ranking: the declared corpus ({c.get('tokens', '?')} tokens: "
             + ", ".join(f"{n} {v['tokens']}" for n, v in c.get("sources", {}).items())
             + f") merged with the target's greedy outputs on {result['calibration_prompts']} calibration prompts "
             f"({result['calibration_tokens']} tokens, a quarter of the merged mass). Draft cost: chain {CHAIN} (ms "
             f"per drafted token) and tree {TREE} (ms per tree). End to end: fixed chain {E2E} through gRPC on "
             f"localhost; target-only decoding {result['baseline_tokens_per_s']} tokens/s in this run. "
             f"lossless_ok = {result['lossless_ok']}.", "",
             "| engine | quant | K | n-gram | draft ms/token | ms/tree | coverage | tau | tokens/s | disk MB | "
             "peak RSS MB | exact / near-tie / other |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        k = f"{r['vocab_k'] or 'full'}" + (" (by coverage)" if r.get("k_by_coverage") else "")
        lines.append(f"| {r['engine']} | {r.get('quant', '-')} | {k} | {'yes' if r['ngram'] else 'no'} | "
                     f"{r['draft_ms_per_token']} | {r['draft_ms_per_tree']} | {r['coverage']} | {r['tau']} | "
                     f"{r['tokens_per_s']} | {r.get('disk_mb', '-')} | {r.get('peak_rss_mb', '-')} | "
                     f"{r['exact']} / {r['near_tie']} / {r['other']} |")
    g = result.get("goals", {})
    if g:
        lines += ["", f"Goals (issue 17): ONNX full head / llama.cpp draft ms per token = "
                      f"{g['onnx_full_vs_llama_draft_ms']} (goal <= 1.0); head by coverage / full head draft ms = "
                      f"{g['trimmed_vs_full_draft_ms']} (goal <= 0.85) at tau {g['trimmed_vs_full_tau']}x "
                      "(goal >= 0.95)."]
    h = result["llama_cpp_head"]
    lines += ["", f"llama.cpp LM head: a one-token decode takes {h['with_logits_ms']} ms with logits and "
                  f"{h['without_logits_ms']} ms without, so its full head costs {h['head_ms']} ms per decode. "
                  "llama.cpp computes that head inside llama_decode whenever logits are requested; a trimmed head "
                  "would need the hidden state instead (an embeddings context: a second decode), so trimming "
                  "cannot save anything there and is not offered for llama.cpp.", ""]
    if result.get("providers"):
        lines += ["Execution providers the SDK picks (`edge.onnx_drafter.providers_for`) for the default "
                  "quantization on the platforms onnxruntime ships for (not measured here: only this x86 CPU is):", "",
                  "| platform | providers |", "|---|---|"]
        lines += [f"| {plat} | {', '.join(p)} |" for plat, p in result["providers"].items()]
        lines.append("")
    if result.get("plot"):
        lines += [f"![{result['plot']}]({result['plot']})", ""]
    lines += ["## Defaults", "", result["defaults"]]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.drafter", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=2, help="held-out prompts per dataset")
    ap.add_argument("--calibration", type=int, default=20, help="calibration prompts per dataset")
    ap.add_argument("--calibration-tokens", type=int, default=128, help="target tokens per calibration prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ks", default=",".join(str(k) for k in K_LIST), help="head sizes, 0 = full")
    ap.add_argument("--coverage", type=float, default=0.98,
                    help="also the smallest K whose corpus ranking covers this much of the target's outputs")
    ap.add_argument("--quants", default="int4,int8",
                    help="ONNX weight quantizations: the first gets every K, the others the full head")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/drafter.md"))
    ap.add_argument("--rss-probe", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rss_probe:
        return _rss_probe(args.rss_probe)

    from collections import Counter

    from tandem.orchestrator.calibration import corpus_counts, k_by_coverage, merge
    from tandem.orchestrator.datasets import calibration_chats, heldout_chats
    from tandem.cloud import reference
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    from tandem.cloud.server import serve
    from tandem.edge import vocabtrim
    from tandem.edge.client import EdgeClient
    from tandem.core.tree import TreeShape
    from tandem.edge.llama_drafter import LlamaDrafter
    from tandem.edge.ngram import NgramDrafter
    from tandem.edge.onnx_drafter import OnnxDrafter, providers_for
    from tandem.edge.export.onnx_export import export
    from tandem.core import logs
    from tandem.orchestrator import models
    logs.configure()

    ks = [int(k) for k in args.ks.split(",")]
    quants = [q for q in args.quants.split(",") if q]
    target_path, drafter_path = models.fetch("target"), models.fetch("drafter")
    engine = LlamaVerifierEngine(target_path, n_ctx=4096, n_threads=args.threads, max_sessions=2)
    tok = engine.model
    corpus, corpus_meta = corpus_counts(tok, progress=_progress)
    cal = [tok.tokenize(tok.chat_prompt(c)) for c in calibration_chats(args.calibration, args.calibration)]
    per_prompt: list[list[int]] = []
    for i, p in enumerate(cal):
        per_prompt.append(reference.greedy(engine, p, args.calibration_tokens).tokens)
        _progress(f"calibration {i + 1}/{len(cal)}")
    cal_outputs = [t for o in per_prompt for t in o]
    counts = merge(corpus, Counter(cal_outputs))
    k_cov = k_by_coverage(corpus, per_prompt, args.coverage)
    if k_cov and k_cov not in ks:
        ks.append(k_cov)
    eog = [t for t in range(tok.n_vocab) if tok.is_eog(t)]
    heads = {k: (None if k == 0 else vocabtrim.choose(counts, k=k, always=eog, fill_below=tok.n_vocab))
             for k in ks}
    held = heldout_chats(args.limit, args.limit)
    prompts = [tok.tokenize(tok.chat_prompt(c)) for _, c in held]
    datasets = [d for d, _ in held]
    refs = [reference.greedy(engine, p, args.max_new_tokens) for p in prompts]
    base_tps = sum(len(r.tokens) for r in refs) / sum(r.wall_s for r in refs)
    noise = max(reference.batch_shape_noise(engine, p, r.tokens[:8]) for p, r in zip(prompts[:2], refs[:2]))
    held_tokens = [t for r in refs for t in r.tokens]
    _progress(f"references: {len(held_tokens)} held-out target tokens, {base_tps:.1f} tokens/s, noise {noise:.3f}")

    server, port = serve(engine, "127.0.0.1:0", max_sessions=2)
    address = f"127.0.0.1:{port}"
    results = []

    def run(engine_name, drafter, k, ngram_on, costs, quant, files: Path):
        # lock-step rounds (every token verified in a tree): tau measures the drafter, not how often the verifier
        # decoded alone while it drafted
        client = EdgeClient(drafter, address, TreeShape.parse(E2E), ngram=NgramDrafter() if ngram_on else None,
                            stream=False)
        out = e2e(client, prompts, datasets, refs, noise, args.max_new_tokens)
        client.close()
        cov = 1.0 if heads.get(k) is None else vocabtrim.coverage(heads[k], held_tokens)
        row = {"engine": engine_name, "vocab_k": k, "ngram": ngram_on, "draft_ms_per_token": round(costs[0], 2),
               "draft_ms_per_tree": round(costs[1], 1), "coverage": round(cov, 4), **out, "quant": quant,
               "k_by_coverage": k == k_cov, "disk_mb": disk_mb(engine_name, files, heads.get(k))}
        if not ngram_on:
            row["peak_rss_mb"] = peak_rss_mb(engine_name, files, drafter_path, args.threads, prompts[0],
                                             heads.get(k))
        results.append(row)
        _progress(f"{engine_name} {quant} K={k or 'full'} ngram={ngram_on}: {row}")

    llama = LlamaDrafter(drafter_path, n_ctx=4096, n_threads=args.threads)
    head_probe = llama_head_ms(llama, prompts[0])
    costs = draft_costs(llama, prompts[:2])
    run("llama_cpp", llama, 0, False, costs, "q4_k_m", drafter_path)
    run("llama_cpp", llama, 0, True, costs, "q4_k_m", drafter_path)
    del llama

    _progress("ONNX export (cached after the first run) ...")
    best = None
    for qi, quant in enumerate(quants):
        model_dir = export(drafter_path, quant)
        onnx = OnnxDrafter(model_dir, tokenizer_gguf=drafter_path, n_ctx=4096, n_threads=args.threads)
        for k in (ks if qi == 0 else [0]):
            onnx.set_vocab(heads[k])
            run("onnx", onnx, k, False, draft_costs(onnx, prompts[:2]), quant, model_dir)
        if qi == 0:
            best = max((r for r in results if r["engine"] == "onnx"), key=lambda r: r["tokens_per_s"])
            onnx.set_vocab(heads[best["vocab_k"]])
            run("onnx", onnx, best["vocab_k"], True, (best["draft_ms_per_token"], best["draft_ms_per_tree"]), quant,
                model_dir)
        del onnx
    server.stop(grace=None)

    fastest = max(results, key=lambda r: r["tokens_per_s"])
    full_onnx = next(r for r in results if r["engine"] == "onnx" and r["vocab_k"] == 0 and not r["ngram"])
    llama_row = results[0]
    ng = [(r, next(b for b in results if b["engine"] == r["engine"] and b["vocab_k"] == r["vocab_k"]
                   and b["quant"] == r["quant"] and not b["ngram"])) for r in results if r["ngram"]]
    ng_text = "; ".join(f"{r['engine']}: " + ", ".join(
        f"{d} {b['by_dataset'][d]['tokens_per_s']} -> {r['by_dataset'][d]['tokens_per_s']} tokens/s" for d in
        sorted(r["by_dataset"])) for r, b in ng)
    cov_row = next((r for r in results if r.get("k_by_coverage") and not r["ngram"]), None)
    goals = {
        "onnx_full_vs_llama_draft_ms": round(full_onnx["draft_ms_per_token"] / llama_row["draft_ms_per_token"], 3),
        "trimmed_vs_full_draft_ms": round(cov_row["draft_ms_per_token"] / full_onnx["draft_ms_per_token"], 3)
        if cov_row else None,
        "trimmed_vs_full_tau": round(cov_row["tau"] / full_onnx["tau"], 3) if cov_row and full_onnx["tau"] else None,
    }
    defaults = (
        f"- Drafter engine: {fastest['engine']} ({fastest['quant']}) is fastest end to end here "
        f"({fastest['tokens_per_s']} tokens/s). The ONNX drafter ({full_onnx['quant']}, full head) costs "
        f"{full_onnx['draft_ms_per_token']} ms per drafted token against llama.cpp's "
        f"{llama_row['draft_ms_per_token']} ({goals['onnx_full_vs_llama_draft_ms']}x), from "
        f"{full_onnx['disk_mb']} MB of files against the GGUF's {llama_row['disk_mb']} MB.\n"
        + (f"- Head by coverage: K={cov_row['vocab_k']} (the smallest holding {args.coverage} of the target's "
           f"tokens on calibration prompts its ranking did not see) drafts at "
           f"{goals['trimmed_vs_full_draft_ms']}x the full head's ms/token with {goals['trimmed_vs_full_tau']}x "
           f"its tau; held-out coverage {cov_row['coverage']}.\n" if cov_row else "")
        + f"- n-gram branch: {ng_text}. It wins on code (repeated identifiers and signatures) and costs verifier "
        "work on chat when its branches are rejected, so it stays opt-in (--ngram).")
    lossless_ok = all(r["other"] == 0 for r in results)
    import platform
    result = {"lossless_ok": lossless_ok, "results": results, "llama_cpp_head": head_probe,
              "prompts": len(prompts), "calibration_prompts": len(cal), "calibration_tokens": len(cal_outputs),
              "max_new_tokens": args.max_new_tokens, "threads": args.threads,
              "baseline_tokens_per_s": round(base_tps, 2), "batch_shape_noise": round(noise, 4), "defaults": defaults,
              "heads": {str(k): (len(v) if v is not None else tok.n_vocab) for k, v in heads.items()},
              "corpus": corpus_meta, "coverage_target": args.coverage, "k_by_coverage": k_cov, "goals": goals,
              "cpu": cpu_name(platform.machine()),
              "providers": {f"{sysname} {machine}": providers_for(sysname, machine, quants[0], avail) for
                            sysname, machine, avail in PLATFORMS}}
    args.report.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = plot(result, args.report)
    return finish(result, args.json, report, args.report, lossless_ok,
                  "outputs diverge from target-only decoding other than at near-ties", "drafter")


if __name__ == "__main__":
    sys.exit(main())
