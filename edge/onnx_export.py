"""Export a drafter (GGUF through transformers, or a Hugging Face directory) to ONNX for onnxruntime on CPU.

The exported graph is one decoder step over T new tokens against P cached ones, with an explicit additive mask so
that a whole tree level can be evaluated at once (each node attends to the committed prefix and its ancestors):

    inputs   input_ids [T] int64, positions [T] int64, mask [T, P + T] float32 (0 = attend, -1e9 = not),
             past_k / past_v [L, H_kv, P, D] float32
    outputs  hidden [T, E] (after the final norm), new_k / new_v [L, H_kv, T, D]

The LM head is not in the graph: it is stored as ``head.npy`` and built as its own small (quantized) graph per
vocabulary (``edge.vocabtrim``), so a trimmed head costs no re-export. The decoder is written out here from the
model's weights (Qwen2 / Llama family: RMSNorm, rotary embeddings, grouped-query attention with optional q/k/v
bias, SwiGLU MLP) instead of tracing transformers' modules, whose cache classes do not export cleanly; a test checks
it against transformers' own forward.

Weights are block-quantized (int8 by default, int4 on request; ``quantize_weights``); the embedding table stays
float. The result is cached under ``$TANDEM_CACHE/onnx/<source sha256[:16]>-<quant>/`` with ``meta.json``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np

log = logging.getLogger("tandem.edge.onnx")

SUPPORTED = ("qwen2", "llama", "mistral")
NEG = -1e9  # additive mask value for "may not attend"
BITS = {"int8": 8, "int4": 4}  # weight-only quantizations (MatMulNBits)
BLOCK = 32
EXPORT_VERSION = 2  # bump when the graph or its quantization changes: old cache entries are then not reused


class ExportError(ValueError):
    pass


def _progress(msg: str) -> None:
    print(f"[export] {msg}", file=sys.stderr, flush=True)


def source_sha256(source: Path) -> str:
    """sha256 of the GGUF file, or of an HF directory's config and weight files (names + contents)."""
    sidecar = source.with_name(source.name + ".verified.json")  # orchestrator.models writes it for pinned files
    if source.is_file() and sidecar.is_file():
        try:
            meta = json.loads(sidecar.read_text())
            if meta.get("size") == source.stat().st_size and meta.get("sha256"):
                return meta["sha256"]
        except (OSError, ValueError):
            pass
    files = [source] if source.is_file() else sorted(
        p for p in source.iterdir() if p.suffix in (".json", ".safetensors", ".bin", ".model", ".txt"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def load_source(source: Path):
    """(transformers model in float32 on CPU, name) from a GGUF file or an HF directory."""
    from transformers import AutoModelForCausalLM
    if source.is_file() and source.suffix == ".gguf":
        src, extra = str(source.parent), {"gguf_file": source.name}
    elif source.is_dir() and (source / "config.json").is_file():
        src, extra = str(source), {}
    else:
        raise ExportError(f"{source} is neither a GGUF file nor a Hugging Face model directory (with config.json)")
    import torch
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **extra).eval()
    if model.config.model_type not in SUPPORTED:
        raise ExportError(f"model type {model.config.model_type!r} is not supported by the ONNX export "
                          f"(supported: {', '.join(SUPPORTED)})")
    return model


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise ExportError(f"rope scaling {params.get('rope_type')!r} is not supported by the ONNX export")
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", 10000.0))


def build_step(model):
    """A torch module computing one decoder step with explicit cache and mask tensors (see module docstring)."""
    import torch

    cfg = model.config
    inner = model.model
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    eps = cfg.rms_norm_eps
    inv_freq = 1.0 / (_rope_theta(cfg) ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate(x, cos, sin):  # x [H, T, D]; HF convention: rotate the two halves
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = inner.embed_tokens
            self.layers = inner.layers
            self.norm = inner.norm
            self.register_buffer("inv_freq", inv_freq, persistent=False)

        def forward(self, input_ids, positions, mask, past_k, past_v):
            x = self.embed(input_ids)  # [T, E]
            t = input_ids.shape[0]
            freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos()[None], emb.sin()[None]  # [1, T, D]
            new_k, new_v = [], []
            for i, layer in enumerate(self.layers):
                att = layer.self_attn
                h = rms(x, layer.input_layernorm.weight)
                q = att.q_proj(h).view(t, n_heads, head_dim).transpose(0, 1)
                k = att.k_proj(h).view(t, n_kv, head_dim).transpose(0, 1)
                v = att.v_proj(h).view(t, n_kv, head_dim).transpose(0, 1)
                q, k = rotate(q, cos, sin), rotate(k, cos, sin)
                new_k.append(k)
                new_v.append(v)
                keys = torch.cat((past_k[i], k), dim=1)  # [H_kv, P + T, D]
                vals = torch.cat((past_v[i], v), dim=1)
                rep = n_heads // n_kv
                keys = keys.repeat_interleave(rep, dim=0)
                vals = vals.repeat_interleave(rep, dim=0)
                scores = q @ keys.transpose(1, 2) / math.sqrt(head_dim) + mask[None]
                out = torch.softmax(scores, dim=-1) @ vals  # [H, T, D]
                x = x + att.o_proj(out.transpose(0, 1).reshape(t, n_heads * head_dim))
                h = rms(x, layer.post_attention_layernorm.weight)
                mlp = layer.mlp
                x = x + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
            return rms(x, self.norm.weight), torch.stack(new_k), torch.stack(new_v)

    step = Step().eval()
    dims = {"layers": len(inner.layers), "kv_heads": n_kv, "head_dim": head_dim, "hidden": cfg.hidden_size}
    return step, dims


def head_weight(model) -> np.ndarray:
    return model.get_output_embeddings().weight.detach().float().numpy()


def quantize_weights(src: Path, dst: Path, bits: int) -> None:
    """Weight-only block quantization of every MatMul with a constant weight (onnxruntime's MatMulNBits):
    symmetric, one scale per BLOCK input rows of each output column, activations quantized to int8 at run time
    (accuracy level 4, the fast CPU path). Measured on the 0.5B drafter against its float source, per-block
    scales keep greedy agreement at 97-99.5 % for int8 where per-tensor dynamic int8 gave 85-95 %."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # per-node INFO
    q = MatMulNBitsQuantizer(onnx.load(str(src)), bits=bits, block_size=BLOCK, is_symmetric=True, accuracy_level=4)
    q.process()
    q.model.save_model_to_file(str(dst), use_external_data_format=False)


def cache_dir_for(source: Path, quant: str, cache_root: Path | None = None) -> Path:
    from tandem.core.cache import cache_dir
    root = cache_root or cache_dir() / "onnx"
    return root / f"{source_sha256(source)[:16]}-{quant}-v{EXPORT_VERSION}"


def export(source: str | Path, quant: str = "int8", cache_root: Path | None = None, force: bool = False) -> Path:
    """Export (or find in the cache) the ONNX drafter for ``source``; returns its directory."""
    source = Path(source)
    if not source.exists():
        raise ExportError(f"{source} does not exist")
    if quant not in (*BITS, "fp32"):
        raise ExportError(f"quantization {quant!r} is not one of {', '.join((*BITS, 'fp32'))}")
    out = cache_dir_for(source, quant, cache_root)
    if (out / "meta.json").is_file() and not force:
        _progress(f"cached: {out}")
        return out
    import torch
    t0 = time.perf_counter()
    _progress(f"loading {source.name} through transformers (dequantising) ...")
    model = load_source(source)
    step, dims = build_step(model)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    L, H, D = dims["layers"], dims["kv_heads"], dims["head_dim"]
    args = (torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), torch.zeros(3, 7),
            torch.zeros(L, H, 4, D), torch.zeros(L, H, 4, D))
    fp32 = tmp / "decoder-fp32.onnx"
    _progress(f"exporting the decoder ({L} layers) to ONNX ...")
    # the TorchScript exporter: our step is plain tensor code, which it handles without the torch.export
    # machinery (and its extra dependencies); its deprecation and tracer warnings are expected
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(step, args, str(fp32), input_names=["input_ids", "positions", "mask", "past_k", "past_v"],
                          output_names=["hidden", "new_k", "new_v"], opset_version=17, dynamo=False,
                          dynamic_axes={"input_ids": {0: "T"}, "positions": {0: "T"}, "mask": {0: "T", 1: "PT"},
                                        "past_k": {2: "P"}, "past_v": {2: "P"}, "hidden": {0: "T"},
                                        "new_k": {2: "T"}, "new_v": {2: "T"}})
    decoder = tmp / "decoder.onnx"
    if quant in BITS:
        _progress(f"quantizing MatMul weights to {quant} (blocks of {BLOCK}) ...")
        quantize_weights(fp32, decoder, BITS[quant])
        for f in tmp.glob("decoder-fp32.onnx*"):
            f.unlink()
    else:
        fp32.rename(decoder)
    np.save(tmp / "head.npy", head_weight(model))
    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    meta = {"source": str(source), "source_sha256": source_sha256(source), "quant": quant,
            "model_type": cfg.model_type, "vocab_size": int(cfg.vocab_size), "eos": [e for e in eos if e is not None],
            **dims, "export_s": round(time.perf_counter() - t0, 1)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    _progress(f"done in {meta['export_s']} s: {out}")
    return out
