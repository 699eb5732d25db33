"""Derive verifier cost curves from published figures (a roofline), for bench.capacity's regime map.

    python deploy/cost-curves/derive.py            # writes derived-*.json beside this file
    python deploy/cost-curves/derive.py --check    # exits 1 if a written file differs from what it would write

Every file written is labelled "derived": nothing in it was measured. For a model of P parameters (bf16) on a
replica of ``tp`` GPUs (tensor parallelism), a forward of n tokens takes, per GPU:

    weights  P x 2 bytes / tp / (MEM_EFF x bandwidth)                     (read once per forward)
    compute  2 P n FLOP / tp / (FLOP_EFF x dense bf16 peak)
    reduce   2 x layers x (latency + 2 (tp - 1) / tp x n x hidden x 2 bytes / (LINK_EFF x link bandwidth))
                                                                          (two all-reduces a layer; 0 at tp 1)

'ms' holds weights + compute + reduce at each point; 'floor_ms' the weights plus the launch floor, under which
GPU work hides (bench.capacity takes max(floor, points + KV read + attention)). The KV read and the attention's
compute depend on each forward's contexts, so bench.capacity adds them from 'kv_bytes_per_token' (2 x layers x
kv_heads x head_dim x 2 bytes), 'hbm_gb_s' (the replica's effective bandwidth) and 'attn_ms_per_token_ctx' (4 x
layers x heads x head_dim FLOP per query and key, at FLOP_EFF of the replica's peak). 'kv_gb' is KV_SHARE of the
memory the weights leave. Architectures are the models' published configs (Hugging Face config.json); GPU figures
are the vendors' datasheets.

The launch floor is not measured for a tuned engine: LAUNCH_MS_PER_LAYER (about 1 ms for a 28-layer model, as
h200-roofline-qwen2.5-7b.json assumes for CUDA graphs) plus LAUNCH_MS_FIXED, per forward. What Tandem's own torch
engine measures today is 20-21 ms, launch-bound (h200-torch-*.json): ``--launch-ms-per-layer`` re-derives with
another figure.

Per (model, GPU) the replica spans the fewest GPUs of 1, 2 or 4 whose memory the weights fill to at most
MAX_WEIGHT_SHARE (72B: 2 H200s, 4 H100s, A100s or L40S-class cards). Beside each target: server-side speculation's
drafters on the same GPU, the 0.5B of the same family (one GPU of the replica, as vLLM's draft_tensor_parallel_size
1 runs it) and an EAGLE-3-class head (one decoder layer of the target, a fusion layer of 3 x hidden x hidden and a
32k-token head, across the replica's GPUs).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MEM_EFF, FLOP_EFF, LINK_EFF = 0.8, 0.5, 0.8  # achieved share of the datasheet's bandwidth / peak (as the
# existing roofline curves assume)
KV_SHARE = 0.9  # of the memory the weights leave, for KV
MAX_WEIGHT_SHARE = 0.8
LAUNCH_MS_PER_LAYER, LAUNCH_MS_FIXED = 0.032, 0.1  # assumed: 1.0 ms for 28 layers
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 16384)


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    hbm_tb_s: float
    bf16_tflops: float  # dense
    mem_gb: float
    link_gb_s: float  # per direction, between the GPUs of a replica
    link_latency_us: float
    link: str


@dataclass(frozen=True)
class Model:
    key: str
    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = 152064


GPUS = {g.key: g for g in (
    GPU("h200", "NVIDIA H200 SXM", 4.8, 989.0, 141.0, 450.0, 5.0, "NVLink 4 (900 GB/s both ways)"),
    GPU("h100", "NVIDIA H100 SXM 80GB", 3.35, 989.0, 80.0, 450.0, 5.0, "NVLink 4 (900 GB/s both ways)"),
    GPU("a100", "NVIDIA A100 SXM4 80GB", 2.039, 312.0, 80.0, 300.0, 5.0, "NVLink 3 (600 GB/s both ways)"),
    GPU("l40s", "NVIDIA L40S (L40S-class: PCIe, no NVLink)", 0.864, 362.0, 48.0, 32.0, 20.0,
        "PCIe Gen4 x16 (32 GB/s each way)"),
)}
# Qwen2.5 configs (huggingface.co/Qwen/Qwen2.5-*/config.json): layers, hidden, attention heads, KV heads; parameter
# counts from the model cards
MODELS = {m.key: m for m in (
    Model("qwen2.5-0.5b", "Qwen2.5-0.5B", 0.494e9, 24, 896, 14, 2, 64, 4864, 151936),
    Model("qwen2.5-7b", "Qwen2.5-7B", 7.62e9, 28, 3584, 28, 4, 128, 18944),
    Model("qwen2.5-14b", "Qwen2.5-14B", 14.7e9, 48, 5120, 40, 8, 128, 13824),
    Model("qwen2.5-32b", "Qwen2.5-32B", 32.5e9, 64, 5120, 40, 8, 128, 27648),
    Model("qwen2.5-72b", "Qwen2.5-72B", 72.7e9, 80, 8192, 64, 8, 128, 29568),
)}
TARGETS = ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b")
DRAFTER = "qwen2.5-0.5b"
EAGLE_VOCAB = 32000


def eagle_head(m: Model) -> Model:
    """An EAGLE-3-class draft head for ``m``: one decoder layer like the target's (its attention and MLP), the
    fusion of three of the target's layers (3 x hidden x hidden) and a 32k-token head."""
    attn = m.hidden * (m.heads * m.head_dim) * 2 + m.hidden * (m.kv_heads * m.head_dim) * 2
    mlp = 3 * m.hidden * m.intermediate
    params = attn + mlp + 3 * m.hidden * m.hidden + EAGLE_VOCAB * m.hidden
    return Model(f"eagle3-{m.key}", f"EAGLE-3-class head for {m.name}", float(params), 1, m.hidden, m.heads,
                 m.kv_heads, m.head_dim, m.intermediate, EAGLE_VOCAB)


def replica_gpus(m: Model, g: GPU) -> int:
    for tp in (1, 2, 4):
        if m.params * 2 / 1e9 <= MAX_WEIGHT_SHARE * tp * g.mem_gb:
            return tp
    raise ValueError(f"{m.name} does not fit 4 x {g.name}")


def curve(m: Model, g: GPU, tp: int, role: str, launch_per_layer: float) -> dict:
    weights_gb = m.params * 2 / 1e9
    bw = MEM_EFF * g.hbm_tb_s * 1e12 * tp  # bytes/s, the replica's
    flops = FLOP_EFF * g.bf16_tflops * 1e12 * tp
    weights_ms = weights_gb * 1e9 / bw * 1000
    per_token_ms = 2 * m.params / flops * 1000
    launch = LAUNCH_MS_FIXED + launch_per_layer * m.layers

    def reduce_ms(n: int) -> float:
        if tp == 1:
            return 0.0
        msg = n * m.hidden * 2
        one = g.link_latency_us / 1000 + 2 * (tp - 1) / tp * msg / (LINK_EFF * g.link_gb_s * 1e9) * 1000
        return 2 * m.layers * one

    kv_bytes = 2 * m.layers * m.kv_heads * m.head_dim * 2
    kv_gb = KV_SHARE * (tp * g.mem_gb - weights_gb)
    attn_ms = 4 * m.layers * m.heads * m.head_dim / flops * 1000
    tp_note = (f" over {tp} GPUs (tensor parallel; two all-reduces a layer over {g.link}, {g.link_latency_us} us "
               f"each plus 2 (tp-1)/tp x n x {m.hidden} x 2 bytes at {LINK_EFF:.0%} of {g.link_gb_s:g} GB/s)"
               if tp > 1 else " on one GPU")
    return {
        "name": f"{g.name}{f' x{tp}' if tp > 1 else ''}, tuned engine (CUDA graphs), {m.name}: roofline",
        "label": "derived",
        "role": role,
        "gpu": g.key,
        "model": m.key,
        "tp": tp,
        "hardware": f"{tp} x {g.name} (datasheet: {g.hbm_tb_s} TB/s, {g.bf16_tflops:g} TFLOP/s dense bf16, "
                    f"{g.mem_gb:g} GB; {g.link})",
            "architecture": f"{m.name}: {m.params / 1e9:.3g}e9 parameters (bf16: {weights_gb:.2f} GB), {m.layers} "
                        f"layer(s), hidden {m.hidden}, {m.heads} heads, {m.kv_heads} KV heads of {m.head_dim}",
        "tokens": list(TOKENS),
        "ms": [round(weights_ms + per_token_ms * n + reduce_ms(n), 4) for n in TOKENS],
        "floor_ms": round(weights_ms + launch, 4),
        "kv_bytes_per_token": kv_bytes,
        "hbm_gb_s": round(bw / 1e9, 1),
        "kv_gb": round(kv_gb, 2),
        "attn_ms_per_token_ctx": float(f"{attn_ms:.4g}"),
        "source": f"Derived, not measured, by deploy/cost-curves/derive.py: {m.name} in bf16{tp_note}. "
                  f"Per forward of n tokens: the weights read at {MEM_EFF:.0%} of HBM bandwidth ({weights_ms:.3f} ms), "
                  f"2 x params x n FLOP at {FLOP_EFF:.0%} of dense bf16 peak ({per_token_ms * 1000:.2f} us a token)"
                  f"{' and the all-reduces' if tp > 1 else ''}: 'ms'. floor_ms adds a launch floor of "
                  f"{launch:.2f} ms ({LAUNCH_MS_FIXED} ms + {launch_per_layer} ms a layer: assumed for CUDA graphs, "
                  f"not measured). kv_bytes_per_token = 2 x {m.layers} layers x {m.kv_heads} KV heads x "
                  f"{m.head_dim} x 2 bytes; hbm_gb_s: {MEM_EFF:.0%} of the replica's bandwidth; kv_gb: "
                  f"{KV_SHARE:.0%} of the {tp * g.mem_gb:g} GB the weights leave; attn_ms_per_token_ctx: 4 x "
                  f"layers x heads x head_dim FLOP per (query, key) pair at {FLOP_EFF:.0%} of peak.",
    }


def name(model: str, gpu: str, tp: int) -> str:
    return f"derived-{gpu}-{model}{f'-tp{tp}' if tp > 1 else ''}.json"


def derive(launch_per_layer: float = LAUNCH_MS_PER_LAYER) -> dict[str, dict]:
    out = {}
    for g in GPUS.values():
        d = MODELS[DRAFTER]
        drafter_file = name(d.key, g.key, 1)
        out[drafter_file] = curve(d, g, 1, "drafter (server-side speculation, one GPU of the replica)",
                                  launch_per_layer)
        for key in TARGETS:
            m = MODELS[key]
            tp = replica_gpus(m, g)
            head = eagle_head(m)
            eagle_file = name(head.key, g.key, tp)
            out[eagle_file] = curve(head, g, tp, f"EAGLE-3-class draft head beside {m.name}", launch_per_layer)
            target = curve(m, g, tp, "target", launch_per_layer)
            target["drafter_curve"], target["eagle_curve"] = drafter_file, eagle_file
            out[name(m.key, g.key, tp)] = target
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launch-ms-per-layer", type=float, default=LAUNCH_MS_PER_LAYER)
    ap.add_argument("--check", action="store_true", help="compare with the files here instead of writing them")
    args = ap.parse_args(argv)
    files = derive(args.launch_ms_per_layer)
    stale = []
    for fname, d in files.items():
        text = json.dumps(d, indent=1) + "\n"
        path = HERE / fname
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(fname)
        else:
            path.write_text(text)
    if args.check and stale:
        print(f"stale derived curves (rerun deploy/cost-curves/derive.py): {stale}", file=sys.stderr)
        return 1
    print(f"{'checked' if args.check else 'wrote'} {len(files)} derived curves in {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
