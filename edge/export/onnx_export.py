"""Export a drafter (a GGUF file or a Hugging Face directory) to ONNX for onnxruntime on CPU. A Qwen2 GGUF is
written straight from its tensors (``edge.export.gguf_onnx``: numpy, ``gguf`` and ``onnx`` only, no torch); anything
else goes through transformers and torch's ONNX exporter (the torch extra).

The exported graph is one decoder step over T new tokens against P cached ones, with an explicit additive mask so
that a whole tree level can be evaluated at once (each node attends to the committed prefix and its ancestors):

    inputs   embeds [T, E] float32, positions [T] int64, mask [T, P + T] float32 (0 = attend, -1e9 = not),
             past_k / past_v [L, H_kv, P, D] float32
    outputs  hidden [T, E] (after the final norm), new_k / new_v [L, H_kv, T, D]

Neither the embedding table nor the LM head is in the graph. Both are [V, E] row tables (``save_table``: int8 rows
with a scale each, memory-mapped; a tied model stores one): the drafter looks up T embedding rows itself, and builds
the head as its own small quantized graph per vocabulary (``edge.vocabtrim``), so a trimmed head costs no re-export
and the float table (a quarter of a 0.5B model) never sits on disk twice. The decoder is written out here from the
model's weights (Qwen2 / Llama family: RMSNorm, rotary embeddings, grouped-query attention with optional q/k/v
bias, SwiGLU MLP) instead of tracing transformers' modules, whose cache classes do not export cleanly; tests check
it against transformers' own forward, and the GGUF writer's graph against it.

Decoder weights are block-quantized (int4 by default, int8 on request; ``quantize_weights``). The result is cached
under ``$TANDEM_CACHE/onnx/<source sha256[:16]>-<quant>-v<EXPORT_VERSION>/`` with ``meta.json``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import tempfile
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from tandem.core.errors import TandemError

from .gguf_onnx import int8_rows

log = logging.getLogger("tandem.edge.onnx")

SUPPORTED = ("qwen2", "llama", "mistral")
NEG = -1e9  # additive mask value for "may not attend"
BITS = {"int8": 8, "int4": 4}  # weight-only quantizations (MatMulNBits)
BLOCK = 32
WEB_QUANT = "dynamic-int8"  # MatMulInteger: what onnxruntime-web runs fast (quantize_dynamic_int8)
QUANTS = (*BITS, WEB_QUANT, "fp32")
EXPORT_VERSION = 6  # bump when the graph or its quantization changes: old cache entries are then not reused


class ExportError(TandemError, ValueError):
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

    from tandem.core.model_id import transformers_source
    try:
        src, extra = transformers_source(source)
    except ValueError as e:
        raise ExportError(str(e)) from None
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
    default: float = getattr(cfg, "rope_theta", 10000.0)  # (transformers 4's place for it)
    return float(params.get("rope_theta") or default)


def build_step(model):
    """A torch module computing one decoder step with explicit cache and mask tensors (see module docstring and
    ``edge.export.torch_step``), and its dimensions."""
    import torch

    from .torch_step import Dims, Step

    cfg = model.config
    inner = model.model
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    inv_freq = 1.0 / (_rope_theta(cfg) ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    step = Step(inner, Dims(n_heads, n_kv, head_dim, cfg.rms_norm_eps), inv_freq).eval()
    dims = {"layers": len(inner.layers), "kv_heads": n_kv, "head_dim": head_dim, "hidden": cfg.hidden_size}
    return step, dims


def _tied(source: Path, model, embed: np.ndarray, head: np.ndarray) -> bool:
    """Whether the LM head is the embedding table, stored once then. A GGUF says so by having no ``output.weight``
    (transformers' loader gives lm_head a copy of its own either way)."""
    if source.is_file() and source.suffix == ".gguf":
        from gguf import GGUFReader
        return all(t.name != "output.weight" for t in GGUFReader(str(source)).tensors)
    return bool(getattr(model.config, "tie_word_embeddings", False)) or (
        head.shape == embed.shape and np.array_equal(head, embed))


def save_table(directory: Path, name: str, weight: np.ndarray, bits: int | None) -> None:
    """An embedding or LM-head matrix [V, E] as ``<name>.npy`` (+ ``<name>_scale.npy``), quantized like the decoder
    beside it: 4 bits in blocks of ``BLOCK`` along E (two per byte, a float16 absmax scale per block: the blocking
    MatMulNBits uses for a head built from these rows, so building one adds no second rounding error), 8 bits with a
    scale per row, or float32 (``bits`` None). Rows are what is read: a lookup reads T rows, a (trimmed) head is
    built from K of them."""
    w = np.asarray(weight, dtype=np.float32)
    v, e = w.shape
    if bits is None:
        np.save(directory / f"{name}.npy", w)
        return
    if bits == 4 and e % BLOCK == 0:
        blocks = w.reshape(v, e // BLOCK, BLOCK)
        scale = (np.abs(blocks).max(axis=2) / 7.0).astype(np.float16)
        safe = np.where(scale == 0, 1.0, scale.astype(np.float32))[:, :, None]
        q = (np.clip(np.rint(blocks / safe), -7, 7).astype(np.int8) + 8).astype(np.uint8).reshape(v, e)
        np.save(directory / f"{name}.npy", q[:, 0::2] | (q[:, 1::2] << 4))
        np.save(directory / f"{name}_scale.npy", scale)
        return
    q, scale = int8_rows(w)
    np.save(directory / f"{name}.npy", q)
    np.save(directory / f"{name}_scale.npy", scale)



class RowTable:
    """Rows of a matrix written by ``save_table``, memory-mapped (only the rows read are paged in)."""

    def __init__(self, directory: Path, name: str):
        self.values = np.load(directory / f"{name}.npy", mmap_mode="r")
        scale = directory / f"{name}_scale.npy"
        self.scale = np.load(scale) if scale.is_file() else None

    def __len__(self) -> int:
        return self.values.shape[0]

    def rows(self, ids) -> np.ndarray:
        """float32 [len(ids), E]; ``ids`` None: every row."""
        v = self.values if ids is None else self.values[np.asarray(ids)]
        if self.scale is None:
            return np.asarray(v, dtype=np.float32)
        scale = self.scale if ids is None else self.scale[np.asarray(ids)]
        if scale.ndim == 1:  # 8 bits, one scale per row
            return v.astype(np.float32) * scale[:, None]
        q = np.empty((v.shape[0], v.shape[1] * 2), dtype=np.int8)  # 4 bits: unpack, centre, scale per block
        q[:, 0::2] = v & 0xF
        q[:, 1::2] = v >> 4
        q -= 8
        blocks = q.reshape(v.shape[0], scale.shape[1], -1).astype(np.float32)
        return (blocks * scale.astype(np.float32)[:, :, None]).reshape(v.shape[0], -1)


def quantize_weights(src, dst: Path, bits: int) -> None:
    """Weight-only block quantization of every MatMul with a constant weight (onnxruntime's MatMulNBits):
    symmetric, one scale per BLOCK input rows of each output column, activations quantized to int8 at run time
    (accuracy level 4, the fast CPU path). Measured on the 0.5B drafter against its float source, per-block
    scales keep greedy agreement at 97-99.5 % for int8 where per-tensor dynamic int8 gave 85-95 %."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # per-node INFO
    model = onnx.load(str(src)) if isinstance(src, (str, Path)) else src  # a path, or the ModelProto itself
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=BLOCK, is_symmetric=True, accuracy_level=4)
    q.process()
    q.model.save_model_to_file(str(dst), use_external_data_format=False)


# u8 activations times s8 weights on x86 without VNNI (AVX2's vpmaddubsw) add pairs of products in int16 and
# saturate: 2 * 255 * 127 = 64,770 > 32,767, silently; WebAssembly relaxed SIMD's integer dot is defined for 7-bit
# operands only. Weights within +-63 bound a pair by 2 * 255 * 63 = 32,130: exact on every kernel, at one bit of
# weight precision (onnxruntime's own quantizer calls this reduce_range).
WEB_WEIGHT_QMAX = 63


def quantize_dynamic_int8(model):
    """Every MatMul with a constant [in, out] weight becomes onnxruntime's dynamic int8 pattern: the weight as int8
    within +-``WEB_WEIGHT_QMAX``, symmetric, one scale per output column; the activations quantized to uint8 at run
    time (DynamicQuantizeLinear), MatMulInteger, and the two scales applied to its int32 result. What
    ``onnxruntime.quantization.quantize_dynamic`` writes (with reduce_range), done here on the graph in memory (a
    self-contained fp32 graph is over protobuf's 2 GB). onnxruntime-web's WASM build runs it far faster than
    MatMulNBits (bench/results/2026-12-06/browser/): the browser's quantization."""
    from onnx import helper, numpy_helper
    weights = {t.name: t for t in model.graph.initializer}
    nodes, added, used = [], [], set()
    for n in model.graph.node:
        w = weights.get(n.input[1]) if n.op_type == "MatMul" else None
        if w is None or len(w.dims) != 2:
            nodes.append(n)
            continue
        columns, scale = int8_rows(numpy_helper.to_array(w).T, WEB_WEIGHT_QMAX)  # [in, out]: a scale per column
        x, q = n.input[0], n.output[0]
        added += [numpy_helper.from_array(np.ascontiguousarray(columns.T), f"{w.name}_q8"),
                  numpy_helper.from_array(scale, f"{w.name}_scale")]
        nodes += [helper.make_node("DynamicQuantizeLinear", [x], [f"{q}_x8", f"{q}_xs", f"{q}_xz"]),
                  helper.make_node("MatMulInteger", [f"{q}_x8", f"{w.name}_q8", f"{q}_xz"], [f"{q}_i32"]),
                  helper.make_node("Cast", [f"{q}_i32"], [f"{q}_f"], to=1),
                  helper.make_node("Mul", [f"{q}_f", f"{q}_xs"], [f"{q}_fx"]),
                  helper.make_node("Mul", [f"{q}_fx", f"{w.name}_scale"], [q])]
        used.add(w.name)
    keep = [t for t in model.graph.initializer if t.name not in used]
    del model.graph.node[:], model.graph.initializer[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(keep + added)
    return model


def cache_dir_for(source: Path, quant: str, cache_root: Path | None = None) -> Path:
    from tandem.core.cache import cache_dir
    root = cache_root or cache_dir() / "onnx"
    return root / f"{source_sha256(source)[:16]}-{quant}-v{EXPORT_VERSION}"


@functools.lru_cache(maxsize=4)
def _gguf_source(source: Path):
    """The GGUF file when the torch-free writer (``edge.export.gguf_onnx``) handles its architecture, else None.
    (Cached: reading a GGUF's header parses its whole vocabulary, 6.7 s for the default drafter.)"""
    if not (source.is_file() and source.suffix == ".gguf"):
        return None
    from .gguf_onnx import ARCHS, GGUFModel
    model = GGUFModel(source)
    return model if model.arch in ARCHS else None


def exports_without_torch(source: str | Path, quant: str = "int4") -> bool:
    """Whether ``export(source, quant)`` needs neither torch nor transformers: cached already, or a GGUF the
    torch-free writer handles. Raises ImportError when onnxruntime is missing (the drafter could not run)."""
    import onnxruntime  # noqa: F401
    source = Path(source)
    if (cache_dir_for(source, quant) / "meta.json").is_file():
        return True
    return source.exists() and _gguf_source(source) is not None


def _decoder_from_gguf(gguf, tables: bool = False):
    """The decoder written from the GGUF's tensors (no torch): (the float graph, dims, embedding [V, E], head
    [V, E] or None when tied, what meta.json says of the model); ``tables``: the self-contained step, its tables
    inside (None, None)."""
    from .gguf_onnx import build_graph
    _progress(f"writing the decoder from the GGUF's tensors ({gguf.arch}; no torch) ...")
    graph, dims = build_graph(gguf, _progress, tables=tables)
    vocab = gguf.tensor_shape("token_embd.weight")[0]
    about = {"model_type": gguf.arch, "vocab_size": int(vocab), "eos": gguf.eos(), "exporter": "gguf"}
    if tables:
        return graph, dims, None, None, about
    embed = gguf.tensor("token_embd.weight")
    head = gguf.tensor("output.weight") if gguf.has("output.weight") else None  # none: tied to the embedding
    return graph, dims, embed, head, about


def _decoder_from_torch(source: Path, fp32: Path):
    """The decoder traced from transformers' model (a Hugging Face directory, or a GGUF of another architecture)
    into ``fp32``: as ``_decoder_from_gguf``, the graph given as that file."""
    import torch
    _progress(f"loading {source.name} through transformers (dequantising) ...")
    model = load_source(source)
    step, dims = build_step(model)
    L, H, D = dims["layers"], dims["kv_heads"], dims["head_dim"]
    args = (torch.zeros(3, dims["hidden"]), torch.tensor([4, 5, 6]), torch.zeros(3, 7),
            torch.zeros(L, H, 4, D), torch.zeros(L, H, 4, D))
    _progress(f"exporting the decoder ({L} layers) to ONNX ...")
    # the TorchScript exporter: our step is plain tensor code, which it handles without the torch.export
    # machinery (and its extra dependencies); its deprecation and tracer warnings are expected
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(step, args, str(fp32), input_names=["embeds", "positions", "mask", "past_k", "past_v"],
                          output_names=["hidden", "new_k", "new_v"], opset_version=17, dynamo=False,
                          dynamic_axes={"embeds": {0: "T"}, "positions": {0: "T"}, "mask": {0: "T", 1: "PT"},
                                        "past_k": {2: "P"}, "past_v": {2: "P"}, "hidden": {0: "T"},
                                        "new_k": {2: "T"}, "new_v": {2: "T"}})
    embed = model.get_input_embeddings().weight.detach().float().numpy()
    head = model.get_output_embeddings().weight.detach().float().numpy()
    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    return fp32, dims, embed, None if _tied(source, model, embed, head) else head, {
        "model_type": cfg.model_type, "vocab_size": int(cfg.vocab_size), "eos": [e for e in eos if e is not None],
        "exporter": "torch"}


def _check_request(source: Path, quant: str, self_contained: bool) -> None:
    if not source.exists():
        raise ExportError(f"{source} does not exist")
    if quant not in QUANTS:
        raise ExportError(f"quantization {quant!r} is not one of {', '.join(QUANTS)}")
    if quant == WEB_QUANT and not self_contained:
        raise ExportError(f"{WEB_QUANT} is the browser drafter's quantization: export it with self_contained")


def _write_decoder(graph, decoder: Path, quant: str) -> None:
    """The float32 decoder ``graph`` (a model, or the path of one written by the torch exporter) as ``decoder``,
    quantized to ``quant``."""
    if quant in BITS:
        _progress(f"quantizing MatMul weights to {quant} (blocks of {BLOCK}) ...")
        quantize_weights(graph, decoder, BITS[quant])
        for f in decoder.parent.glob("decoder-fp32.onnx*"):
            f.unlink()
    elif quant == WEB_QUANT:
        import onnx
        _progress("quantizing MatMul weights to int8 per output column, activations at run time ...")
        onnx.save(quantize_dynamic_int8(graph), str(decoder))
    elif isinstance(graph, Path):
        graph.rename(decoder)
    else:
        import onnx
        onnx.save(graph, str(decoder))


def export(source: str | Path, quant: str = "int4", cache_root: Path | None = None, force: bool = False,
           self_contained: bool = False, adapter: str | Path | None = None) -> Path:
    """Export (or find in the cache) the ONNX drafter for ``source``; returns its directory. ``self_contained``
    (a Qwen2 GGUF only): ``model.onnx`` takes token ids and gives logits, its tables inside, with the tokenizer
    beside it as ``tokenizer.json`` (``core.gguf_tokenizer``): what a browser or app loads. ``adapter``: a LoRA
    adapter GGUF of this drafter (``cloud.learning.online``), merged into the weights (a Qwen2 GGUF only)."""
    source = Path(source)
    _check_request(source, quant, self_contained)
    adapter_sha = hashlib.sha256(Path(adapter).read_bytes()).hexdigest() if adapter else ""
    out = cache_dir_for(source, quant + ("-full" if self_contained else "") + (f"-lora{adapter_sha[:12]}"
                                                                                if adapter else ""), cache_root)
    if (out / "meta.json").is_file() and not force:
        _progress(f"cached: {out}")
        return out
    t0 = time.perf_counter()
    gguf = _gguf_source(source)
    if self_contained and gguf is None:
        raise ExportError(f"{source.name}: a self-contained export is written from a Qwen2 GGUF only")
    if adapter:
        if gguf is None:
            raise ExportError(f"{source.name}: an adapter is merged into a Qwen2 GGUF's export only")
        try:
            gguf = gguf.with_adapter(Path(adapter))
        except ValueError as e:
            raise ExportError(str(e)) from None
    # a folder of this export's own: two processes exporting the same model (two servers on a fresh machine) each
    # write theirs, and the first to finish publishes it whole
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent))
    try:
        _write_export(source, tmp, gguf, quant, self_contained, adapter_sha, t0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(tmp, out, replace=force)


def _publish(tmp: Path, out: Path, replace: bool = False) -> Path:
    """Move the finished export ``tmp`` to ``out`` (a rename: ``out`` is whole or absent, never half written),
    unless another process published the same export first (then its own is discarded); ``replace``: a forced
    export replaces what is there; a folder there without ``meta.json`` (broken by hand) is replaced too."""
    if replace:
        shutil.rmtree(out, ignore_errors=True)
    for _ in range(2):
        try:
            tmp.rename(out)
            _progress(f"done: {out}")
            return out
        except OSError:
            if (out / "meta.json").is_file():
                shutil.rmtree(tmp, ignore_errors=True)
                _progress(f"another process exported it first: {out}")
                return out
            shutil.rmtree(out, ignore_errors=True)
    raise ExportError(f"could not move the export to {out}")


def _write_export(source: Path, tmp: Path, gguf, quant: str, self_contained: bool, adapter_sha: str,
                  t0: float) -> None:
    """The export's files, into ``tmp``."""
    if gguf is not None:
        graph, dims, embed, head, about = _decoder_from_gguf(gguf, tables=self_contained)
    else:
        graph, dims, embed, head, about = _decoder_from_torch(source, tmp / "decoder-fp32.onnx")
    _write_decoder(graph, tmp / ("model.onnx" if self_contained else "decoder.onnx"), quant)
    if self_contained:
        from tandem.core.gguf_tokenizer import tokenizer_json
        if gguf.value("tokenizer.ggml.model") is not None:  # (a GGUF of weights alone has no vocabulary to ship)
            (tmp / "tokenizer.json").write_text(tokenizer_json(source, gguf.reader))
        about["self_contained"] = True
    else:
        save_table(tmp, "embed", embed, BITS.get(quant))
        if head is not None:
            save_table(tmp, "head", head, BITS.get(quant))
        about["head_table"] = "head" if head is not None else "embed"
    if adapter_sha:
        about["adapter_sha256"] = adapter_sha
    meta = {"source": str(source), "source_sha256": source_sha256(source), "quant": quant, **about, **dims,
            "export_s": round(time.perf_counter() - t0, 1)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))  # (written last: a folder with it is whole)
