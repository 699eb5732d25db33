"""The drafter's decoder step written as an ONNX graph straight from a GGUF file: no torch, no transformers.

The ``gguf`` package reads the tensors and dequantizes them (the same routine transformers' GGUF loader calls, so
the float weights are the ones the torch export sees); ``onnx.helper`` writes the graph ``onnx_export`` documents
(inputs embeds, positions, mask, past_k, past_v; outputs hidden, new_k, new_v) with the same arithmetic as its
``build_step``: fused q/k/v and gate/up MatMuls against [in, out] constants, rotary embeddings on the two halves,
grouped-query attention as one batched MatMul per KV head group, RMSNorm as w * (x / sqrt(mean(x^2) + eps)).

``tables=True`` writes the self-contained step a browser or app loads with nothing beside it but the tokenizer:
token ids in, logits out for the rows ``logit_rows`` names (a prefill wants its last row's, a tree every node's: the
head is the step's largest MatMul), the embedding inside (int8 rows with a scale each, looked up and scaled in the
graph) and the LM head as one more MatMul (block-quantized with the decoder's).

Qwen2 only: llama.cpp stores Llama and Mistral q/k weights permuted for its interleaved rotary layout, which this
writer does not undo; those GGUFs (and Hugging Face directories) go through the torch export.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

ARCHS = ("qwen2",)


@dataclass(frozen=True)
class Dims:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    eps: float
    rope_theta: float


class GGUFModel:
    """A GGUF file's architecture, dimensions and dequantized float32 tensors (by llama.cpp's names)."""

    def __init__(self, path: Path):
        from gguf import GGUFReader
        self.reader = GGUFReader(str(path))
        self.fields = self.reader.fields
        self.arch = self.value("general.architecture")
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._lora: dict[str, tuple[np.ndarray, np.ndarray, float]] = {}  # weight -> (A, B, alpha / r)
        self.adapter_sha256 = ""

    def with_adapter(self, path: Path) -> "GGUFModel":
        """This model with a LoRA adapter (llama.cpp's adapter GGUF, ``cloud.learning.lora_gguf``) merged into the
        weights it adapts: ``W + (alpha / r) B A``, what llama.cpp computes at run time, in the weights themselves."""
        import copy
        import hashlib

        from gguf import GGUFReader, Keys
        from gguf.quants import dequantize
        r = GGUFReader(str(path))
        fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
        if fields.get(Keys.General.TYPE) != "adapter" or fields.get(Keys.Adapter.TYPE) != "lora":
            raise ValueError(f"{path.name} is not a LoRA adapter GGUF")
        if fields.get(Keys.General.ARCHITECTURE) != self.arch:
            raise ValueError(f"{path.name} adapts a {fields.get(Keys.General.ARCHITECTURE)} model, this is {self.arch}")
        parts = {t.name: np.asarray(dequantize(t.data, t.tensor_type), np.float32) for t in r.tensors}
        lora = {}
        for name, a in parts.items():
            if not name.endswith(".lora_a"):
                continue
            weight, b = name.removesuffix(".lora_a"), parts.get(name.removesuffix(".lora_a") + ".lora_b")
            if b is None or weight not in self._tensors or self.tensor_shape(weight) != (b.shape[0], a.shape[1]):
                raise ValueError(f"{path.name}: {weight} does not fit this model")
            lora[weight] = (a, b, float(fields[Keys.Adapter.LORA_ALPHA]) / a.shape[0])
        out = copy.copy(self)
        out._lora = lora
        out.adapter_sha256 = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        return out

    def value(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def dims(self) -> Dims:
        a = self.arch
        heads = int(self.value(f"{a}.attention.head_count"))
        hidden = int(self.value(f"{a}.embedding_length"))
        return Dims(layers=int(self.value(f"{a}.block_count")), heads=heads,
                    kv_heads=int(self.value(f"{a}.attention.head_count_kv", heads)),
                    head_dim=int(self.value(f"{a}.attention.key_length", hidden // heads)), hidden=hidden,
                    ffn=int(self.value(f"{a}.feed_forward_length")),
                    eps=float(self.value(f"{a}.attention.layer_norm_rms_epsilon")),
                    rope_theta=float(self.value(f"{a}.rope.freq_base", 10000.0)))

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """As ``tensor`` returns it (GGUF lists dimensions innermost first)."""
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def tensor(self, name: str) -> np.ndarray:
        """float32, shaped as torch holds it ([out, in] for a projection)."""
        from gguf.quants import dequantize
        t = self._tensors[name]
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name in self._lora:
            a, b, scale = self._lora[name]
            w = w + scale * (b @ a)  # (a fresh array: an F32 tensor is the mapped file itself)
        return w

    def eos(self) -> list[int]:
        eos = self.value("tokenizer.ggml.eos_token_id")
        return [] if eos is None else [int(eos)]


class _Graph:
    """Nodes and constants as they are added, each output named once."""

    def __init__(self):
        self.nodes, self.inits, self._n = [], [], 0

    def const(self, value, name: str | None = None) -> str:
        from onnx import numpy_helper
        self._n += 1
        name = name or f"c{self._n}"
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, kind: str, *inputs: str, outputs: int = 1, **attrs):
        from onnx import helper
        self._n += 1
        names = [f"{kind.lower()}{self._n}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(kind, list(inputs), names, **attrs))
        return names[0] if outputs == 1 else names


def _ints(*values: int) -> np.ndarray:
    """An int64 vector constant (shapes, axes, split sizes)."""
    return np.array(values, dtype=np.int64)


def _rms(g: _Graph, x: str, weight: str, eps: str) -> str:
    mean = g.op("ReduceMean", g.op("Mul", x, x), axes=[-1], keepdims=1)
    return g.op("Mul", weight, g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean, eps)))))


def _rotate(g: _Graph, x: str, cos: str, sin: str, half: str) -> str:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] for the halves x1, x2 of the head dimension."""
    x1, x2 = g.op("Split", x, half, axis=-1, outputs=2)
    rot = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rot, sin))


def _projection(m: GGUFModel, *names: str) -> np.ndarray:
    """[in, sum(out)]: the layout MatMul(x, W) wants, fused over ``names``."""
    return np.ascontiguousarray(np.concatenate([m.tensor(n) for n in names], axis=0).T)


def int8_rows(w: np.ndarray, qmax: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``w`` [V, E] as int8 in [-qmax, qmax] with a float32 absmax scale per row (an all-zero row gets
    scale 1): the 8-bit layout of the embedding here and of ``onnx_export.save_table``'s row tables."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=1) / float(qmax)
    scale[scale == 0] = 1.0
    return np.clip(np.rint(w / scale[:, None]), -qmax, qmax).astype(np.int8), scale.astype(np.float32)


def _embedding(g: _Graph, table: np.ndarray) -> str:
    """The rows of ``input_ids``: int8 with a per-row absmax scale (``onnx_export.save_table``'s 8-bit layout)."""
    from onnx import TensorProto
    q, scale = int8_rows(table)
    rows = g.op("Cast", g.op("Gather", g.const(q, "embed_q8"), "input_ids", axis=0), to=TensorProto.FLOAT)
    return g.op("Mul", rows, g.op("Unsqueeze", g.op("Gather", g.const(scale, "embed_scale"),
                                                    "input_ids", axis=0), g.const(_ints(1))))


def _rope_angles(g: _Graph, d: Dims) -> str:
    """The rotary embedding's angles [T, D] at the step's ``positions`` (each frequency twice)."""
    from onnx import TensorProto
    inv_freq = 1.0 / (d.rope_theta ** (np.arange(0, d.head_dim, 2, dtype=np.float32) / d.head_dim))
    freqs = g.op("Mul", g.op("Unsqueeze", g.op("Cast", "positions", to=TensorProto.FLOAT), g.const(_ints(1))),
                 g.const(inv_freq.astype(np.float32)[None, :]))  # [T, D/2]
    return g.op("Concat", freqs, freqs, axis=-1)


@dataclass(frozen=True)
class _Shared:
    """The graph's constants and shapes every layer reads (names of its initializers and nodes)."""
    d: Dims
    eps: str
    half: str
    zero: str
    cos: str  # [1, T, D]
    sin: str
    scores_shape: str
    grouped_shape: str
    scale: str
    split_qkv: str
    split_ffn: str
    heads_shape: dict[int, str]
    to_groups: str
    to_heads: str
    flat: str


def _layer(g: _Graph, m: GGUFModel, i: int, x: str, c: _Shared) -> tuple[str, str, str]:
    """Decoder layer ``i`` on the residual stream ``x``: the stream after it, and the step's keys and values."""
    d, p = c.d, f"blk.{i}."
    qkv = g.op("MatMul", _rms(g, x, g.const(m.tensor(p + "attn_norm.weight")), c.eps),
               g.const(_projection(m, p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight")))
    if all(m.has(p + f"attn_{n}.bias") for n in "qkv"):
        qkv = g.op("Add", qkv, g.const(np.concatenate([m.tensor(p + f"attn_{n}.bias") for n in "qkv"])))
    q, k, v = g.op("Split", qkv, c.split_qkv, axis=1, outputs=3)
    q, k, v = (g.op("Transpose", g.op("Reshape", t, c.heads_shape[n]), perm=[1, 0, 2])
               for t, n in ((q, d.heads), (k, d.kv_heads), (v, d.kv_heads)))  # [H, T, D]
    q, k = _rotate(g, q, c.cos, c.sin, c.half), _rotate(g, k, c.cos, c.sin, c.half)
    layer = g.const(np.int64(i))
    keys = g.op("Concat", g.op("Gather", "past_k", layer, axis=0), k, axis=1)  # [H_kv, P + T, D]
    vals = g.op("Concat", g.op("Gather", "past_v", layer, axis=0), v, axis=1)
    # query head h reads KV head h // rep: the rep heads of a group become rep * T rows against one KV head
    scores = g.op("Div", g.op("MatMul", g.op("Reshape", q, c.to_groups), g.op("Transpose", keys, perm=[0, 2, 1])),
                  c.scale)
    probs = g.op("Softmax", g.op("Add", g.op("Reshape", scores, c.scores_shape), "mask"), axis=-1)
    out = g.op("MatMul", g.op("Reshape", probs, c.grouped_shape), vals)  # [H_kv, rep * T, D] = [H, T, D]
    out = g.op("Reshape", g.op("Transpose", g.op("Reshape", out, c.to_heads), perm=[1, 0, 2]), c.flat)
    x = g.op("Add", x, g.op("MatMul", out, g.const(_projection(m, p + "attn_output.weight"))))
    gate, up = g.op("Split", g.op("MatMul", _rms(g, x, g.const(m.tensor(p + "ffn_norm.weight")), c.eps),
                                  g.const(_projection(m, p + "ffn_gate.weight", p + "ffn_up.weight"))),
                    c.split_ffn, axis=-1, outputs=2)
    silu = g.op("Mul", gate, g.op("Sigmoid", gate))
    x = g.op("Add", x, g.op("MatMul", g.op("Mul", silu, up), g.const(_projection(m, p + "ffn_down.weight"))))
    return x, k, v


def _signature(d: Dims, vocab: int, tables: bool) -> tuple[list, list]:
    """The step's inputs and outputs (the module docstring): embeddings in and hidden states out, or with
    ``tables`` ids in and logits out."""
    from onnx import TensorProto, helper
    f32 = TensorProto.FLOAT
    kv: list[str | int] = ["L", d.kv_heads, "P", d.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["T"]) if tables else
              helper.make_tensor_value_info("embeds", f32, ["T", d.hidden]),
              helper.make_tensor_value_info("positions", TensorProto.INT64, ["T"]),
              helper.make_tensor_value_info("mask", f32, ["T", "PT"]),
              helper.make_tensor_value_info("past_k", f32, [d.layers, *kv[1:]]),
              helper.make_tensor_value_info("past_v", f32, [d.layers, *kv[1:]]),
              *([helper.make_tensor_value_info("logit_rows", TensorProto.INT64, ["R"])] if tables else [])]
    outputs = [helper.make_tensor_value_info("logits", f32, ["R", vocab]) if tables else
               helper.make_tensor_value_info("hidden", f32, ["T", d.hidden]),
               helper.make_tensor_value_info("new_k", f32, [d.layers, d.kv_heads, "T", d.head_dim]),
               helper.make_tensor_value_info("new_v", f32, [d.layers, d.kv_heads, "T", d.head_dim])]
    return inputs, outputs


def build_graph(m: GGUFModel, progress=lambda msg: None, tables: bool = False):
    """The float32 decoder step (an ``onnx.ModelProto``) and its dimensions, as ``onnx_export.build_step``'s; with
    ``tables``, ids in and logits out (the module docstring)."""
    from onnx import helper
    if m.arch not in ARCHS:
        raise ValueError(f"GGUF architecture {m.arch!r}: the torch-free export writes {', '.join(ARCHS)} only")
    d = m.dims()
    rep, q_out, kv_out = d.heads // d.kv_heads, d.heads * d.head_dim, d.kv_heads * d.head_dim
    g = _Graph()
    eps, half = g.const(np.float32(d.eps)), g.const(np.array([d.head_dim // 2] * 2, dtype=np.int64))
    emb = _rope_angles(g, d)
    zero = g.const(_ints(0))
    cos, sin = g.op("Unsqueeze", g.op("Cos", emb), zero), g.op("Unsqueeze", g.op("Sin", emb), zero)  # [1, T, D]
    mask_shape = g.op("Shape", "mask")  # [T, P + T]
    scores_shape = g.op("Concat", g.const(_ints(d.kv_heads, rep)), mask_shape, axis=0)
    grouped_shape = g.op("Concat", g.const(_ints(d.kv_heads, -1)),
                         g.op("Slice", mask_shape, g.const(_ints(1)), g.const(_ints(2))), axis=0)
    scale = g.const(np.float32(np.sqrt(d.head_dim)))
    split_qkv, split_ffn = g.const(_ints(q_out, kv_out, kv_out)), g.const(_ints(d.ffn, d.ffn))
    heads_shape = {n: g.const(_ints(-1, n, d.head_dim)) for n in {d.heads, d.kv_heads}}
    to_groups, to_heads = g.const(_ints(d.kv_heads, -1, d.head_dim)), g.const(_ints(d.heads, -1, d.head_dim))
    shared = _Shared(d, eps, half, zero, cos, sin, scores_shape, grouped_shape, scale, split_qkv, split_ffn,
                     heads_shape, to_groups, to_heads, flat=g.const(_ints(-1, q_out)))
    x, new_k, new_v = "embeds", [], []
    if tables:
        x = _embedding(g, m.tensor("token_embd.weight"))
    for i in range(d.layers):
        x, k, v = _layer(g, m, i, x, shared)
        new_k.append(g.op("Unsqueeze", k, zero))
        new_v.append(g.op("Unsqueeze", v, zero))
        if (i + 1) % max(1, d.layers // 4) == 0:  # a line per quarter of the layers
            progress(f"{i + 1} of {d.layers} layers written")
    hidden = _rms(g, x, g.const(m.tensor("output_norm.weight")), eps)
    vocab = int(m.tensor_shape("token_embd.weight")[0])
    if tables:
        head = "output.weight" if m.has("output.weight") else "token_embd.weight"  # none: tied to the embedding
        rows = g.op("Gather", hidden, "logit_rows", axis=0)
        g.nodes.append(helper.make_node("MatMul", [rows, g.const(_projection(m, head))], ["logits"]))
    else:
        g.nodes.append(helper.make_node("Identity", [hidden], ["hidden"]))
    g.nodes.append(helper.make_node("Concat", new_k, ["new_k"], axis=0))
    g.nodes.append(helper.make_node("Concat", new_v, ["new_v"], axis=0))
    graph = helper.make_graph(g.nodes, "tandem_drafter_step", *_signature(d, vocab, tables), g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tandem")
    model.ir_version = 8
    dims = {"layers": d.layers, "kv_heads": d.kv_heads, "head_dim": d.head_dim, "hidden": d.hidden}
    return model, dims
