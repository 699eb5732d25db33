"""One decoder step as a torch module with explicit cache and mask tensors, for ``edge.export.onnx_export`` to trace
(its module docstring has the graph's inputs and outputs). Imports torch: only ``onnx_export.build_step`` imports this.

Written for the graph ONNX Runtime runs fastest on a CPU: every projection is a plain MatMul against a constant
[in, out] weight (so all of them become MatMulNBits; a Linear with bias would export as a float Gemm), q/k/v and
gate/up are fused into one MatMul each, and grouped-query attention folds the query heads that share a KV head into
the rows of one batched MatMul instead of repeating keys and values per query head."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Dims:
    n_heads: int
    n_kv: int  # key/value heads
    head_dim: int
    eps: float  # RMSNorm's

    @property
    def rep(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv

    @property
    def q_out(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.n_kv * self.head_dim


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [H, T, D]; HF convention: rotate the two halves."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def weight_t(*linears: torch.nn.Linear) -> torch.Tensor:
    """[in, sum(out)]: the layout MatMul(x, W) wants."""
    return torch.cat([m.weight.detach().float() for m in linears], dim=0).T.contiguous()


class Layer(torch.nn.Module):
    """One decoder layer (a transformers Qwen2 / Llama layer's weights) of the step."""

    w_qkv: torch.Tensor  # the buffers, [in, out]
    b_qkv: torch.Tensor
    w_o: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    norm1: torch.Tensor
    norm2: torch.Tensor

    def __init__(self, layer: Any, d: Dims):
        super().__init__()
        self.d = d
        att, mlp = layer.self_attn, layer.mlp
        self.register_buffer("w_qkv", weight_t(att.q_proj, att.k_proj, att.v_proj))
        biases = [m.bias for m in (att.q_proj, att.k_proj, att.v_proj)]
        self.has_bias = all(b is not None for b in biases)
        if self.has_bias:
            self.register_buffer("b_qkv", torch.cat([b.detach().float() for b in biases]))
        self.register_buffer("w_o", weight_t(att.o_proj))
        self.register_buffer("w_gate_up", weight_t(mlp.gate_proj, mlp.up_proj))
        self.register_buffer("w_down", weight_t(mlp.down_proj))
        self.register_buffer("norm1", layer.input_layernorm.weight.detach().float())
        self.register_buffer("norm2", layer.post_attention_layernorm.weight.detach().float())

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d, t = self.d, x.shape[0]
        n_heads, n_kv, head_dim, rep, q_out, kv_out = d.n_heads, d.n_kv, d.head_dim, d.rep, d.q_out, d.kv_out
        qkv = rms(x, self.norm1, d.eps) @ self.w_qkv
        if self.has_bias:
            qkv = qkv + self.b_qkv
        q = qkv[:, :q_out].reshape(t, n_heads, head_dim).transpose(0, 1)
        k = qkv[:, q_out : q_out + kv_out].reshape(t, n_kv, head_dim).transpose(0, 1)
        v = qkv[:, q_out + kv_out :].reshape(t, n_kv, head_dim).transpose(0, 1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keys = torch.cat((past_k, k), dim=1)  # [H_kv, P + T, D]
        vals = torch.cat((past_v, v), dim=1)
        # query head h reads KV head h // rep: the rep heads of a group become rep * T rows against one KV head
        scores = q.reshape(n_kv, rep * t, head_dim) @ keys.transpose(1, 2) / math.sqrt(head_dim)
        probs = torch.softmax(scores.reshape(n_kv, rep, t, -1) + mask, dim=-1)
        out = probs.reshape(n_kv, rep * t, -1) @ vals  # [H_kv, rep * T, D] = [H, T, D]
        x = x + out.reshape(n_heads, t, head_dim).transpose(0, 1).reshape(t, q_out) @ self.w_o
        gate, up = (rms(x, self.norm2, d.eps) @ self.w_gate_up).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ self.w_down, k, v


class Step(torch.nn.Module):
    """The decoder step: every layer of a transformers model's ``model.model``, then the final norm."""

    norm: torch.Tensor
    inv_freq: torch.Tensor

    def __init__(self, inner: Any, d: Dims, inv_freq: torch.Tensor):
        super().__init__()
        self.eps = d.eps
        self.layers = torch.nn.ModuleList(Layer(layer, d) for layer in inner.layers)
        self.register_buffer("norm", inner.norm.weight.detach().float())
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = embeds  # [T, E]: the rows of the embedding table, looked up by the drafter (edge.onnx_drafter)
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None], emb.sin()[None]  # [1, T, D]
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, mask, past_k[i], past_v[i])
            new_k.append(k)
            new_v.append(v)
        return rms(x, self.norm, self.eps), torch.stack(new_k), torch.stack(new_v)
