"""Structured output: what the verifier's grammar costs, against free text, in one run.

    python -m bench.structured --limit 4 --max-new-tokens 96 --json structured.json

For each HumanEval function, the target is asked for a JSON description of it (schema below). Runs, on the same
engine and drafter: constrained target-only decoding (the lossless reference), then the edge path (llama.cpp
drafter -> gRPC -> verifier, lock-step trees ``--tree``) free and constrained by the schema. Reports tau, tokens/s
and verifier ms per token of both, and the grammar's own cost: llguidance mask time per tree row and the time to
compile the schema. Exits 1 when a constrained output is not valid JSON of the schema, or diverges from the
constrained reference other than at a measured near-tie.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tandem.cloud import reference
from tandem.cloud.constraint import GrammarMask, tokenizer
from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
from tandem.cloud.server import serve
from tandem.core import logs
from tandem.core.messages import Constraint
from tandem.core.tree import DraftTree, TreeShape
from tandem.edge.client import EdgeClient
from tandem.edge.llama_drafter import LlamaDrafter
from tandem.edge.planner import FixedPlanner
from tandem.orchestrator import models
from tandem.orchestrator.datasets import humaneval

from .output import finish

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "arguments", "returns", "summary"],
          "properties": {"name": {"type": "string"}, "arguments": {"type": "array", "items": {"type": "string"}},
                         "returns": {"type": "string"}, "summary": {"type": "string"}}}


def _progress(msg: str) -> None:
    print(f"[structured] {msg}", file=sys.stderr, flush=True)


def valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (isinstance(obj, dict) and set(obj) == set(SCHEMA["required"]) and isinstance(obj["arguments"], list)
            and all(isinstance(obj[k], str) for k in ("name", "returns", "summary")))


def grammar_costs(engine, prompts_tokens: list[list[int]], tok_s: float) -> dict:
    """llguidance's own costs on this machine: schema compile, and mask time per row along real outputs."""
    compile_ms, row_us = [], []
    for tokens in prompts_tokens:
        t0 = time.perf_counter()
        g = GrammarMask(engine, Constraint(json_schema=json.dumps(SCHEMA)))
        compile_ms.append((time.perf_counter() - t0) * 1000)
        for i in range(0, max(0, len(tokens) - 4), 4):  # 4-token chains along the output, as a verify sees them
            chain = DraftTree.chain([t for t in tokens[i:i + 4] if not engine.is_eog(t)])
            t0 = time.perf_counter()
            g.masks(chain)
            row_us.append((time.perf_counter() - t0) * 1e6 / (len(chain) + 1))
            g.commit(tokens[i:i + 4])
    return {"tokenizer_s": round(tok_s, 2), "compile_ms": round(sum(compile_ms) / len(compile_ms), 2),
            "mask_us_per_row": round(sum(row_us) / max(1, len(row_us)), 1)}


def report(result: dict, path: Path) -> None:
    lines = ["# Structured output: the grammar's cost", "",
             f"{result['prompts']} HumanEval functions described as JSON (schema in bench/structured.py), "
             f"{result['max_new_tokens']} new tokens, greedy, lock-step tree {result['tree']}, target "
             f"{result['target']}. lossless_ok = {result['lossless_ok']}, all constrained outputs valid = "
             f"{result['valid_ok']}.", "",
             "| run | tau | tokens/s | verifier ms/token | valid JSON |", "|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['label']} | {r['tau']} | {r['tokens_per_s']} | {r['verifier_ms_per_token']} | "
                     f"{r['valid']}/{result['prompts']} |")
    g = result["grammar"]
    lines += ["", f"Constrained vs free: tau {result['tau_ratio']}x, tokens/s {result['speed_ratio']}x. llguidance "
                  f"on this machine: tokenizer from the GGUF vocabulary {g['tokenizer_s']} s (once per engine), "
                  f"schema compile {g['compile_ms']} ms, mask {g['mask_us_per_row']} us per tree row.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=4, help="HumanEval functions")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--tree", default="2,8,4")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--json", type=Path, help="also write the JSON here")
    ap.add_argument("--report", type=Path, default=Path("bench/out/structured.md"))
    args = ap.parse_args(argv)
    logs.configure()
    engine = LlamaVerifierEngine(models.resolve(args.target, "target"), n_ctx=4096, n_threads=args.threads)
    drafter = LlamaDrafter(models.resolve(args.drafter, "drafter"), n_ctx=4096, n_threads=args.threads)
    m, constraint = engine.model, Constraint(json_schema=json.dumps(SCHEMA))
    t0 = time.perf_counter()
    tokenizer(engine)  # llguidance's view of the vocabulary: built once per engine
    tok_s = time.perf_counter() - t0
    asks = [[{"role": "user", "content": f"Describe the Python function `{p['entry_point']}` below as a JSON object "
              f"with keys name, arguments (list of names), returns and summary.\n\n{p['prompt']}"}]
            for p in humaneval(args.limit)]
    prompts = [m.tokenize(m.chat_prompt(a)) for a in asks]
    first = reference.greedy(engine, prompts[0], 8)
    noise = reference.batch_shape_noise(engine, prompts[0], first.tokens)
    server, port = serve(engine, "127.0.0.1:0", max_sessions=2)
    client = EdgeClient(drafter, f"127.0.0.1:{port}")
    planner = FixedPlanner(TreeShape.parse(args.tree), stream=False)
    runs = {"free": [], "constrained": []}
    refs, outputs = [], []
    try:
        for i, p in enumerate(prompts):
            refs.append(reference.decode(engine, p, args.max_new_tokens, constraint=constraint))
            for label in runs:
                gen = client.generate(p, max_new_tokens=args.max_new_tokens, planner=planner,
                                      constraint=constraint if label == "constrained" else None).result()
                runs[label].append(gen)
            outputs.append(runs["constrained"][-1].tokens)
            _progress(f"prompt {i + 1}/{len(prompts)}: tau free {runs['free'][-1].stats.tau:.2f}, constrained "
                      f"{runs['constrained'][-1].stats.tau:.2f}")
    finally:
        client.close()
        server.stop(None)
    divergences = [(i, *reference.classify(g.tokens, r, noise)) for i, (g, r) in enumerate(zip(runs["constrained"],
                                                                                             refs))]
    summary = []
    for label, gens in runs.items():
        tokens = sum(len(g.tokens) for g in gens)
        summary.append({"label": label, "tau": round(tokens / max(1, sum(g.stats.rounds for g in gens)), 3),
                        "tokens_per_s": round(tokens / sum(g.stats.wall_s for g in gens), 2),
                        "verifier_ms_per_token": round(sum(g.stats.verify_us for g in gens) / 1000 / tokens, 2),
                        "valid": sum(valid(g.text) for g in gens)})
    free, con = summary
    result = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "tree": args.tree,
              "target": engine.model_id, "runs": summary, "batch_shape_noise": round(noise, 4),
              "tau_ratio": round(con["tau"] / free["tau"], 3),
              "speed_ratio": round(con["tokens_per_s"] / free["tokens_per_s"], 3),
              "grammar": grammar_costs(engine, outputs, tok_s),
              "divergences": [d for d in divergences if d[1] != "exact"]}
    result["lossless_ok"] = all(kind in ("exact", "near_tie") for _, kind, _ in divergences)
    result["valid_ok"] = con["valid"] == len(prompts)
    return finish(result, args.json, report, args.report, result["lossless_ok"] and result["valid_ok"],
                  "a constrained output diverged from the constrained reference or is not valid JSON of the schema",
                  "structured")


if __name__ == "__main__":
    sys.exit(main())
