"""Batch-invariant forwards for the torch engine's deterministic mode: a position's logits are the same bits
whether it is decoded alone, in a chain or as a tree node, in any run of the tree.

Where the bits move (measured on CPU, float32, torch 2.13; cloud/engines/deterministic.py has llama.cpp's story):

- a linear layer's row depends on the number of rows M (M = 1 takes a gemv path; M >= 16 other gemm blocking), not
  on the row's index or the other rows' contents at a fixed M. So every forward over generated positions holds
  exactly ``RUN_TOKENS`` rows (padding rows nobody attends to), one session at a time;
- attention reduces over the keys: SDPA's result for a row changes with the key count (masked keys included), and
  a tree node's ancestors sit between masked siblings, so its keys are not where a sequential decode has them.

``invariant_attention`` therefore gathers, for every query row, exactly the keys it may see, in cache order (which
is position order: the committed past, then its ancestors, then itself), and reduces them in fixed chunks of
``KEY_CHUNK`` with the online-softmax merge: matmuls of one fixed shape, in the same order whatever else the
forward holds. A chunk past a row's last key is fully masked and merges as an exact no-op (its scores are the
dtype's minimum: the running max does not move, the rescale is exp(0) = 1 and it adds exact zeros), so the key
count a forward happens to have does not matter either.

Prompt chunks longer than a run take the engine's usual SDPA path: a prompt is always prefilled in the same fixed
chunks, so its positions come out the same for the same prompt.
"""
from __future__ import annotations

RUN_TOKENS = 8  # rows in every forward over generated positions (root + up to 7 nodes per run)
KEY_CHUNK = 128  # keys reduced per step of the online softmax
NAME = "tandem_invariant"  # the attention implementation's registered name


def invariant_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention interface: ``query [B, H, Q, D]``, ``key/value [B, Hkv, L, D]``, ``attention_mask``
    additive ``[B, 1, Q, L]`` (0 where a row may attend). Returns ``([B, Q, H, D], None)``."""
    import torch

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:  # logit soft-capping, attention sinks
        raise NotImplementedError("deterministic mode's attention has no soft-capping or sinks; run without it")
    B, H, Q, D = query.shape
    if Q > RUN_TOKENS or attention_mask is None:  # a prompt chunk: the same prompt is always chunked alike
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    Hkv, L = key.shape[1], key.shape[2]
    G = H // Hkv
    scale = scaling if scaling is not None else D ** -0.5
    mask = attention_mask[:, 0, :, :L]
    visible = mask if mask.dtype == torch.bool else mask == 0  # [B, Q, L]
    n_keys = visible.sum(-1)  # [B, Q]
    width = -(-int(n_keys.max()) // KEY_CHUNK) * KEY_CHUNK  # whole chunks
    # each row's visible key indices, in cache order, packed to the front; the rest point at key 0, masked
    order = torch.argsort((~visible).to(torch.int8), dim=-1, stable=True)  # visible first, order kept
    idx = torch.zeros((B, Q, width), dtype=torch.long, device=key.device)
    idx[..., : min(L, width)] = order[..., :width]
    live = torch.arange(width, device=key.device)[None, None, :] < n_keys[..., None]  # [B, Q, width]
    lowest = torch.finfo(query.dtype).min
    # per kv head and row: [B, Hkv, Q, width, D]
    gather = idx[:, None, :, :, None].expand(B, Hkv, Q, width, D)
    keys = torch.gather(key[:, :, None].expand(B, Hkv, Q, L, D), 3, gather)
    values = torch.gather(value[:, :, None].expand(B, Hkv, Q, L, D), 3, gather)
    q = query.view(B, Hkv, G, Q, D).permute(0, 1, 3, 2, 4)  # [B, Hkv, Q, G, D]
    m = torch.full((B, Hkv, Q, G, 1), float("-inf"), dtype=query.dtype, device=query.device)
    s = torch.zeros_like(m)
    acc = torch.zeros((B, Hkv, Q, G, D), dtype=query.dtype, device=query.device)
    for lo in range(0, width, KEY_CHUNK):
        k = keys[:, :, :, lo: lo + KEY_CHUNK]  # [B, Hkv, Q, C, D]
        v = values[:, :, :, lo: lo + KEY_CHUNK]
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hkv, Q, G, C]
        scores = scores.masked_fill(~live[:, None, :, None, lo: lo + KEY_CHUNK], lowest)
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        p = torch.exp(scores - m_new)
        alpha = torch.exp(m - m_new)
        s = s * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, v)
        m = m_new
    out = (acc / s).permute(0, 2, 1, 3, 4).reshape(B, Q, H, D)  # [B, Q, Hkv * G, D]: head h = kv head h // G
    return out, None


def register() -> str:
    """Make ``invariant_attention`` selectable as ``config._attn_implementation`` (prompt chunks get SDPA's masks);
    returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, invariant_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
