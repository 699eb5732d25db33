"""PyTorch / transformers verifier engine: a draft tree in one forward with an additive 4D tree mask.

Loads a Hugging Face model directory, or a GGUF file through transformers' GGUF loader (dequantised). On CUDA it
runs bf16 with SDPA; on CPU float32. Per session it keeps a ``DynamicCache`` holding every committed token but the
last. A tree forward feeds the root and all nodes at once with

- ``position_ids``: root at ``n_past``, a node at ``n_past + depth``;
- ``attention_mask`` of shape ``[1, 1, q, n_past + q]``: 0 where a query may attend (the whole committed past, and
  within the tree its ancestors and itself), the dtype's minimum elsewhere;

then ``keep_path`` gathers the positions of the root and the accepted nodes in every layer's keys and values, so
the cache again holds exactly the committed tokens.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from .engine import TreeJob
from tandem.core.tree import DraftTree

log = logging.getLogger("tandem.cloud.torch")


def tree_attention_allowed(tree: DraftTree) -> np.ndarray:
    """Boolean ``[q, q]`` (q = nodes + 1, row/col 0 = root): ``allowed[i, j]`` iff j is i or an ancestor of i."""
    q = len(tree) + 1
    allowed = np.zeros((q, q), dtype=bool)
    allowed[:, 0] = True
    for i, p in enumerate(tree.parents):
        row = i + 1
        if p >= 0:
            allowed[row] = allowed[p + 1]
        allowed[row, row] = True
    return allowed


class _Seq:
    __slots__ = ("cache", "n_past")

    def __init__(self, cache):
        self.cache = cache
        self.n_past = 0


class TorchVerifierEngine:
    name = "torch"

    def __init__(self, model_path: str | Path | None = None, n_ctx: int = 4096, max_tree_nodes: int = 64,
                 device: str | None = None, dtype: str | None = None, n_threads: int | None = None,
                 max_sessions: int = 16, model=None, tokenizer=None, max_batch_tokens: int = 8192):
        """Load ``model_path`` (HF directory or GGUF file), or wrap an already built ``model`` (tests)."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        if n_threads:
            torch.set_num_threads(n_threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if self.device.type == "cuda"
                                                          else torch.float32)
        if model is None:
            path = Path(model_path)
            if path.is_file() and path.suffix == ".gguf":
                src, extra = str(path.parent), {"gguf_file": path.name}
            elif path.is_dir():
                src, extra = str(path), {}
            else:
                raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face model directory")
            model = AutoModelForCausalLM.from_pretrained(src, dtype=self.dtype, attn_implementation="sdpa",
                                                         **extra)
            try:
                tokenizer = AutoTokenizer.from_pretrained(src, **extra)
            except (OSError, ValueError):  # weights without a tokenizer: no vocabulary fingerprint to offer
                log.warning("no tokenizer found with %s: clients' vocabulary fingerprints are not checked", path)
                tokenizer = None
            name = path.name
        else:
            model = model.to(self.dtype)
            model.config._attn_implementation = "sdpa"
            name = getattr(model.config, "name_or_path", "") or "in-memory model"
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.n_ctx = min(n_ctx, int(getattr(cfg, "max_position_embeddings", n_ctx)))
        self.max_tree_nodes = max_tree_nodes
        self.max_batch_tokens = max_batch_tokens  # padded rows: the forward holds sessions x largest tree
        self.max_sessions = max_sessions
        self.model_id = f"{name} ({cfg.model_type}, torch {str(self.dtype).replace('torch.', '')})"
        self.chat_template = (getattr(tokenizer, "chat_template", None) or "") if tokenizer is not None else ""
        self.bos_token = (getattr(tokenizer, "bos_token", None) or "") if tokenizer is not None else ""
        self.eos_token = (getattr(tokenizer, "eos_token", None) or "") if tokenizer is not None else ""
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        if getattr(cfg, "eos_token_id", None) is not None:
            eos |= {cfg.eos_token_id} if isinstance(cfg.eos_token_id, int) else set(cfg.eos_token_id)
        self._eog = frozenset(eos)
        self._fingerprint: str | None = None
        log.info("torch verifier: %s on %s, %s, sdpa", name, self.device, self.dtype)

    @property
    def vocab_fingerprint(self) -> str:
        """sha256 over token texts in id order (ids past the tokenizer, e.g. embedding padding, hash as empty)."""
        if self._fingerprint is None:
            if self.tokenizer is None:
                return ""
            h = hashlib.sha256()
            texts = self.tokenizer.convert_ids_to_tokens(list(range(min(len(self.tokenizer), self.vocab_size))))
            for t in texts + [""] * (self.vocab_size - len(texts)):
                h.update((t or "").encode("utf-8"))
                h.update(b"\0")
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def new_sequence(self) -> _Seq:
        from transformers import DynamicCache
        return _Seq(DynamicCache(config=self.model.config))

    def prefill(self, seq: _Seq, tokens: Sequence[int], generated: int = 0, chunk: int = 512) -> None:
        if seq.n_past:
            raise RuntimeError("prefill needs an empty sequence")
        torch = self.torch
        with torch.inference_mode():
            for lo in range(0, len(tokens), chunk):
                ids = torch.tensor([list(tokens[lo: lo + chunk])], device=self.device)
                pos = torch.arange(lo, lo + ids.shape[1], device=self.device)[None]
                self.model(input_ids=ids, position_ids=pos, past_key_values=seq.cache, use_cache=True,
                           logits_to_keep=1)
        seq.n_past = len(tokens)

    def forward_tree(self, seq: _Seq, root_token: int, tree: DraftTree) -> np.ndarray:
        return self.forward_batch([TreeJob(seq, root_token, tree)])[0]

    def forward_batch(self, jobs: Sequence[TreeJob]) -> list[np.ndarray]:
        """Padded batch: row i holds session i's cache left-padded to the longest past P and its root + tree
        right-padded to the largest tree Q; the per-row mask hides the padding. Afterwards each session's cache is
        cut back out of the batch cache (its past + its own new tokens)."""
        torch = self.torch
        from transformers import DynamicCache

        n = len(jobs)
        pasts = [j.seq.n_past for j in jobs]
        P, Q = max(pasts), max(j.n_tokens for j in jobs)
        ids = torch.zeros((n, Q), dtype=torch.long)
        pos = torch.zeros((n, Q), dtype=torch.long)
        allowed = np.zeros((n, 1, Q, P + Q), dtype=bool)
        for i, j in enumerate(jobs):
            q, base = j.n_tokens, pasts[i]
            ids[i, :q] = torch.tensor([j.root, *j.tree.tokens])
            pos[i, :q] = torch.tensor([base] + [base + d for d in j.tree.depths])
            allowed[i, 0, :q, P - base: P] = True
            allowed[i, 0, :q, P: P + q] = tree_attention_allowed(j.tree)
            for r in range(q, Q):  # padding queries attend to themselves only; their outputs are dropped
                allowed[i, 0, r, P + r] = True
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~torch.from_numpy(allowed).to(self.device), torch.finfo(self.dtype).min)
        if n == 1:
            cache = jobs[0].seq.cache
        else:
            cache = DynamicCache(config=self.model.config)
            for li in range(len(self.model.model.layers)):
                ks, vs = [], []
                for j in jobs:
                    layer = j.seq.cache.layers[li] if j.seq.n_past else None
                    ks.append(self._left_pad(layer.keys if layer is not None else None, P, li))
                    vs.append(self._left_pad(layer.values if layer is not None else None, P, li))
                cache.update(torch.cat(ks), torch.cat(vs), li)
        with torch.inference_mode():
            out = self.model(input_ids=ids.to(self.device), position_ids=pos.to(self.device), attention_mask=mask,
                             past_key_values=cache, use_cache=True)
        if n > 1:  # cut each session's cache back out: its own past + its own new tokens
            for i, j in enumerate(jobs):
                keep = torch.tensor(list(range(P - pasts[i], P)) + list(range(P, P + j.n_tokens)),
                                    device=self.device)
                fresh = DynamicCache(config=self.model.config)
                for li, layer in enumerate(cache.layers):
                    fresh.update(layer.keys[i: i + 1].index_select(2, keep),
                                 layer.values[i: i + 1].index_select(2, keep), li)
                j.seq.cache = fresh
        logits = out.logits.float().cpu().numpy()
        return [logits[i, : j.n_tokens] for i, j in enumerate(jobs)]

    def _left_pad(self, t, P: int, layer: int):
        """Keys/values ``[1, H, n, D]`` left-padded with zeros to ``[1, H, P, D]``."""
        torch = self.torch
        cfg = self.model.config
        if t is None:
            heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
            dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            return torch.zeros((1, heads, P, dim), dtype=self.dtype, device=self.device)
        if t.shape[2] == P:
            return t
        pad = torch.zeros((1, t.shape[1], P - t.shape[2], t.shape[3]), dtype=t.dtype, device=t.device)
        return torch.cat([pad, t], dim=2)

    def keep_path(self, seq: _Seq, tree: DraftTree, path: Sequence[int]) -> None:
        torch = self.torch
        base = seq.n_past
        keep = torch.tensor(list(range(base + 1)) + [base + 1 + n for n in path], device=self.device)
        for layer in seq.cache.layers:
            layer.keys = layer.keys.index_select(2, keep)
            layer.values = layer.values.index_select(2, keep)
        seq.n_past = base + 1 + len(path)

    def release(self, seq: _Seq) -> None:
        seq.cache = None
