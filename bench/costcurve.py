"""A verifier's cost curve: wall time of one verify forward against the tokens in it (root + tree nodes).

    python -m bench.costcurve --engine llama.cpp --threads 1 \
        --json deploy/cost-curves/cpu-1core-qwen2.5-coder-1.5b-q4km.json
    python -m bench.costcurve --engine torch --config qwen2.5-7b --device cuda --json h200-qwen2.5-7b.json

The curve is what ``tandem serve --verifier-cost FILE`` paces forwards to (cloud/engines/pacing.py) and what the
policy's cost model learns online. It is measured through the engine a verifier runs (``forward_batch`` with a chain of
n - 1 nodes below the root, after a prefill of ``--context`` tokens, then the cache pruned back), median of
``--reps``. For torch it also times the bare model forward, without copying the logits rows to the host (what an
engine that accepts on the device would pay). ``--config`` builds a random-weight model of a public architecture
in bf16 on the device (forward time does not depend on the weights' values), so a GPU machine needs no download.

Correctness check: a chain of the target's own greedy tokens must be accepted whole at every size (the forward
computed what the verifier accepts against); otherwise the bench exits 1. Random-weight models have near-flat
logits, where batch shape flips ties: for them the check is reported, not enforced.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

from .output import cpu_name, finish

TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
NEAR_TIE = 1.2  # top-2 logit gap within twice the measured batch-shape noise

# public architectures (Hugging Face model cards, config.json)
CONFIGS = {
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),  # to try the bench itself quickly
}


def _progress(msg: str) -> None:
    print(f"[costcurve] {msg}", file=sys.stderr, flush=True)


def build_engine(args):
    if args.engine == "llama.cpp":
        from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
        from tandem.orchestrator import models
        return LlamaVerifierEngine(models.resolve(args.target, "target"), n_ctx=args.context + 128,
                                   n_threads=args.threads, max_sessions=1, max_tree_nodes=max(TOKENS))
    import torch
    import transformers

    from tandem.cloud.engines.torch_engine import TorchVerifierEngine
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.config:
        cfg = transformers.Qwen2Config(max_position_embeddings=32768, **CONFIGS[args.config])
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.Qwen2ForCausalLM(cfg).to(dtype)
        return TorchVerifierEngine(model=model, n_ctx=args.context + 128, device=device,
                                   max_tree_nodes=max(TOKENS))
    from tandem.orchestrator import models
    return TorchVerifierEngine(models.resolve(args.target, "target"), n_ctx=args.context + 128, device=device,
                               max_tree_nodes=max(TOKENS))


def contexts(args, engine) -> list[list[int]]:
    if args.config:  # random weights: any tokens are as good as any other
        import numpy as np
        rng = np.random.default_rng(0)
        return [rng.integers(0, engine.vocab_size, args.context).tolist() for _ in range(args.limit)]
    from tandem.orchestrator.datasets import humaneval, humaneval_messages
    tok = engine.model
    out = []
    for p in humaneval(args.limit):
        ids = tok.tokenize(tok.chat_prompt(humaneval_messages(p)))
        out.append((ids * (args.context // len(ids) + 1))[:args.context])
    return out


def measure(engine, context: list[int], n: int, reps: int, bare) -> tuple[float, float | None, bool]:
    """Median ms of a forward of n tokens (root + chain), its bare-model time, and whether a chain of the
    target's own greedy tokens was accepted whole."""
    from tandem.cloud.acceptance import accept
    from tandem.cloud.engines.engine import TreeJob
    from tandem.core.sampling import Sampling
    from tandem.core.tree import DraftTree
    seq = engine.new_sequence()
    try:
        engine.prefill(seq, context[:-1])
        root, greedy, gaps = context[-1], [], []
        for _ in range(n - 1):  # the target's own continuation, one token at a time
            row = engine.forward_tree(seq, greedy[-1] if greedy else root, DraftTree())[0]
            engine.keep_path(seq, DraftTree(), [])
            greedy.append(int(row.argmax()))
            top2 = sorted(row[np.argpartition(row, -2)[-2:]])
            gaps.append(float(top2[1] - top2[0]))
        engine.release(seq)
        seq = engine.new_sequence()
        engine.prefill(seq, context[:-1])
        chain = DraftTree.chain(greedy)
        times, bare_times, whole = [], [], True
        for r in range(reps + 2):  # two warm-ups
            t0 = time.perf_counter()
            rows = engine.forward_batch([TreeJob(seq, root, chain)])[0]
            elapsed = time.perf_counter() - t0
            acc = accept(chain, rows, Sampling())
            # whole, or cut at a near-tie (batch shape moves logits; docs/design.md, "Acceptance", numerics)
            whole &= len(acc.accepted) == len(greedy) or gaps[len(acc.accepted)] < NEAR_TIE
            engine.keep_path(seq, chain, [])  # the root only, then back to the context: each rep starts alike
            if r >= 2:
                times.append(elapsed)
                if bare is not None:
                    bare_times.append(bare(seq, root, chain))
            seq_len_fix(engine, seq, len(context) - 1)
        return (1000 * statistics.median(times), 1000 * statistics.median(bare_times) if bare_times else None,
                whole)
    finally:
        engine.release(seq)


def seq_len_fix(engine, seq, n_past: int) -> None:
    """Cut the sequence back to the context (keep_path kept the root): each repetition starts alike."""
    if engine.name == "llama.cpp":
        engine._ctx.seq_rm(seq.first, n_past, -1)
        seq.n_past = n_past
    else:
        for layer in seq.cache.layers:
            layer.keys = layer.keys[:, :, :n_past]
            layer.values = layer.values[:, :, :n_past]
        seq.n_past = n_past


def bare_forward(engine):
    """Timer of the torch model forward alone (no logits to the host), on the device."""
    if engine.name != "torch":
        return None
    import torch

    from tandem.cloud.engines.torch_engine import tree_attention_allowed

    def run(seq, root, chain) -> float:
        q, base = len(chain) + 1, seq.n_past
        ids = torch.tensor([[root, *chain.tokens]], device=engine.device)
        pos = torch.arange(base, base + q, device=engine.device)[None]
        allowed = torch.zeros((1, 1, q, base + q), dtype=torch.bool, device=engine.device)
        allowed[0, 0, :, :base] = True
        allowed[0, 0, :, base:] = torch.from_numpy(tree_attention_allowed(chain)).to(engine.device)
        mask = torch.zeros(allowed.shape, dtype=engine.dtype, device=engine.device)
        mask.masked_fill_(~allowed, torch.finfo(engine.dtype).min)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            engine.model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=seq.cache,
                         use_cache=True, logits_to_keep=q)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        seq_len_fix(engine, seq, base)
        return elapsed

    return run


def report(result: dict, path: Path) -> None:
    lines = [f"# Verifier cost curve: {result['name']}", "",
             f"{result['hardware']}; {result['model']}; context {result['context_tokens']} tokens; median of "
             f"{result['reps']} forwards. Measured {result['measured_on']}.", "",
             "| tokens in forward | ms (engine) | x one-token forward |" + (" ms (model only) |" if result.get(
                 "model_ms") else ""), "|---|---|---|" + ("---|" if result.get("model_ms") else "")]
    for i, n in enumerate(result["tokens"]):
        row = f"| {n} | {result['ms'][i]:.2f} | {result['ms'][i] / result['ms'][0]:.2f} |"
        if result.get("model_ms"):
            row += f" {result['model_ms'][i]:.2f} |"
        lines.append(row)
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.costcurve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="llama.cpp", choices=("llama.cpp", "torch"))
    ap.add_argument("--target", default="default")
    ap.add_argument("--config", choices=sorted(CONFIGS), help="random-weight model of this architecture (torch)")
    ap.add_argument("--device", help="torch device (default: cuda when present)")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads (the bench.network verifier has 1)")
    ap.add_argument("--context", type=int, default=512, help="committed tokens before the forward")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--limit", type=int, default=1, help="contexts (HumanEval prompts) averaged")
    ap.add_argument("--name", default="")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/costcurve.md"))
    args = ap.parse_args(argv)
    tokens = [int(x) for x in args.tokens.split(",")]
    engine = build_engine(args)
    bare = bare_forward(engine)
    ctxs = contexts(args, engine)
    ms, model_ms, ok = [], [], True
    for n in tokens:
        runs = [measure(engine, c, n, args.reps, bare) for c in ctxs]
        ms.append(round(statistics.mean(r[0] for r in runs), 3))
        if bare is not None:
            model_ms.append(round(statistics.mean(r[1] for r in runs), 3))
        ok &= all(r[2] for r in runs)
        _progress(f"{n} tokens: {ms[-1]:.2f} ms" + (f" (model {model_ms[-1]:.2f} ms)" if bare else ""))
    if engine.name == "torch":
        import torch
        hardware = (torch.cuda.get_device_name() if engine.device.type == "cuda"
                    else f"CPU, {torch.get_num_threads()} threads")
    else:
        cpu = cpu_name("CPU")
        hardware = f"{cpu}, {args.threads} thread(s), llama.cpp"
    model = f"{args.config} (random weights, {engine.dtype})".replace("torch.", "") if args.config else engine.model_id
    result = {"name": args.name or f"{engine.name} {model}", "label": "measured", "hardware": hardware,
              "model": model, "context_tokens": args.context, "reps": args.reps, "tokens": tokens, "ms": ms,
              "measured_on": date.today().isoformat(), "greedy_chain_accepted": ok}
    if model_ms:
        result["model_ms"] = model_ms
    return finish(result, args.json, report, args.report, ok or bool(args.config),
                  "a chain of the target's own greedy tokens was not accepted whole", "costcurve")


if __name__ == "__main__":
    sys.exit(main())
