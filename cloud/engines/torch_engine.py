"""PyTorch / transformers verifier engine: a draft tree in one forward with an additive 4D tree mask.

Loads a Hugging Face model directory, or a GGUF file through transformers' GGUF loader (dequantised). On CUDA it
runs bf16 with SDPA; on CPU float32. Per session it keeps a ``DynamicCache`` holding every committed token but the
last. A tree forward feeds the root and all nodes at once with

- ``position_ids``: root at ``n_past``, a node at ``n_past + depth``;
- ``attention_mask`` of shape ``[1, 1, q, n_past + q]``: 0 where a query may attend (the whole committed past, and
  within the tree its ancestors and itself), the dtype's minimum elsewhere;

then ``keep_path`` gathers the positions of the root and the accepted nodes in every layer's keys and values, so
the cache again holds exactly the committed tokens.

Prefix cache (``prefix_cache_tokens`` > 0): when a session ends, its committed tokens' KV is copied out in blocks
(cloud/caches/block_cache.py decides which); a new session's prefill concatenates the longest chain of its prompt's
blocks that its own partition cached (core/tenancy.py) into its cache and computes the rest from there. The reused KV
was computed in other forwards (another chunking of the prompt, verify forwards of the answer): equal up to rounding, as
on the llama.cpp engine.

Deterministic mode (``deterministic=True``): every forward over generated positions (a tree, a resume's earlier
output) is cut into runs of exactly ``RUN_TOKENS`` rows, one session at a time, with attention that reduces each
row's own visible keys in fixed chunks (cloud/engines/torch_invariant.py says why each is needed, as measured), so a
position's logits are the same bits in a tree, a chain or alone. No prefix cache in this mode.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tandem.core.tenancy import SHARED
from tandem.core.vocab import fingerprint

from ..caches.block_cache import BlockCache
from .engine import TreeJob
from .torch_invariant import RUN_TOKENS
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


def _end_of_generation_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a generation: the model's generation config's, the tokenizer's and the model config's."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    cfg = model.config
    if getattr(cfg, "eos_token_id", None) is not None:
        eos |= {cfg.eos_token_id} if isinstance(cfg.eos_token_id, int) else set(cfg.eos_token_id)
    return frozenset(eos)


class _Seq:
    __slots__ = ("cache", "n_past", "tokens", "root", "partition")

    def __init__(self, cache):
        self.cache = cache
        self.n_past = 0
        self.tokens: list[int] = []  # the committed tokens in the cache (what the prefix cache keeps at the end)
        self.root = -1  # the root of the tree last forwarded
        self.partition = SHARED  # the prefix-cache partition it reads from and is stored into (core.tenancy)


class TorchVerifierEngine:
    name = "torch"

    def __init__(self, model_path: str | Path | None = None, n_ctx: int = 4096, max_tree_nodes: int = 64,
                 device: str | None = None, dtype: str | None = None, n_threads: int | None = None,
                 max_sessions: int = 16, model=None, tokenizer=None, max_batch_tokens: int = 8192,
                 prefix_cache_tokens: int = 0, prefix_block_tokens: int = 16, deterministic: bool = False):
        """Load ``model_path`` (HF directory or GGUF file), or wrap an already built ``model`` (tests).
        ``prefix_cache_tokens``: KV kept for finished sessions' histories, in blocks of ``prefix_block_tokens``
        (0: no prefix cache). ``deterministic``: batch-invariant verify forwards (see the module docstring)."""
        if deterministic and prefix_cache_tokens > 0:
            raise ValueError("deterministic mode runs without the prefix cache: set prefix_cache_tokens=0")
        import torch

        self.torch = torch
        if n_threads:
            torch.set_num_threads(n_threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if self.device.type == "cuda"
                                                          else torch.float32)
        self._gguf: Path | None = None  # the GGUF file the model came from (its vocabulary is the tokenizer file)
        if model is None:
            if model_path is None:
                raise TypeError("TorchVerifierEngine needs a model_path or a model")
            model, tokenizer = self._load(Path(model_path))
            name = Path(model_path).name
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
        self.prefix_cache = BlockCache(prefix_cache_tokens, prefix_block_tokens) if prefix_cache_tokens > 0 \
            else None
        self.model_id = f"{name} ({cfg.model_type}, torch {str(self.dtype).replace('torch.', '')})"
        self.chat_template = (getattr(tokenizer, "chat_template", None) or "") if tokenizer is not None else ""
        self.bos_token = (getattr(tokenizer, "bos_token", None) or "") if tokenizer is not None else ""
        self.eos_token = (getattr(tokenizer, "eos_token", None) or "") if tokenizer is not None else ""
        self._eog = _end_of_generation_ids(self.model, tokenizer)
        self._fingerprints: dict[int, str] = {}  # prefix length -> fingerprint
        self.deterministic = deterministic
        if deterministic:
            self._init_deterministic()
        log.info("torch verifier: %s on %s, %s, %s", name, self.device, self.dtype,
                 "batch-invariant runs" if deterministic else "sdpa")

    def _load(self, path: Path) -> tuple[Any, Any]:
        """The model and (None when there is none) the tokenizer of a Hugging Face directory or a GGUF file."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if path.is_file() and path.suffix == ".gguf":
            self._gguf = path
            src, extra = str(path.parent), {"gguf_file": path.name}
        elif path.is_dir():
            src, extra = str(path), {}
        else:
            raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face model directory")
        model = AutoModelForCausalLM.from_pretrained(src, dtype=self.dtype, attn_implementation="sdpa", **extra)
        try:
            tokenizer = AutoTokenizer.from_pretrained(src, **extra)
        except (OSError, ValueError):  # weights without a tokenizer: no vocabulary fingerprint to offer
            log.warning("no tokenizer found with %s: clients' vocabulary fingerprints are not checked", path)
            tokenizer = None
        return model, tokenizer

    def _init_deterministic(self) -> None:
        from .deterministic import SELF_CHECK_TEXT, NotBatchInvariant
        from .torch_invariant import register

        self.model.config._attn_implementation = register()
        ids = self.tokenizer(SELF_CHECK_TEXT)["input_ids"] if self.tokenizer is not None else []
        ids = [int(t) % self.vocab_size for t in ids] or [(7 * i + 3) % self.vocab_size for i in range(16)]
        worst = self.self_check(ids)
        if worst:
            raise NotBatchInvariant(
                f"{self.model_id}: logits move by up to {worst:.3g} between runs of 1..{RUN_TOKENS} tokens with this "
                f"torch build on {self.device}, so deterministic mode cannot hold; run without it")

    def self_check(self, tokens: Sequence[int]) -> float:
        """Decode ``tokens`` one per run and again in runs of 2..RUN_TOKENS; the largest |logit difference| for the
        same positions (0.0 when runs are batch-invariant here)."""
        worst, single = 0.0, None
        for size in range(1, RUN_TOKENS + 1):
            seq = self.new_sequence()
            rows = []
            for lo in range(0, len(tokens), size):
                run = list(tokens[lo: lo + size])
                rows.append(self._runs(seq, run, range(lo, lo + len(run)), np.tril(np.ones((len(run),) * 2, bool))))
                seq.n_past += len(run)
            got = np.concatenate(rows)
            if single is None:
                single = got
            worst = max(worst, float(np.abs(got - single).max()))
            self.release(seq)
        return worst

    @property
    def vocab_fingerprint(self) -> str:
        """sha256 over token texts in id order (ids past the tokenizer, e.g. embedding padding, hash as empty)."""
        return self.vocab_fingerprint_of(self.vocab_size)

    def vocab_fingerprint_of(self, n: int) -> str:
        """The fingerprint of ids [0, n) alone (see ``core.llama_runtime.LlamaModel.vocab_fingerprint_of``)."""
        if self.tokenizer is None:
            return ""
        if not 0 < n <= self.vocab_size:
            raise ValueError(f"a vocabulary prefix of {n} ids is outside [1, {self.vocab_size}]")
        if n not in self._fingerprints:
            texts = self.tokenizer.convert_ids_to_tokens(list(range(min(len(self.tokenizer), n))))
            self._fingerprints[n] = fingerprint((t or "").encode("utf-8") for t in texts + [""] * (n - len(texts)))
        return self._fingerprints[n]

    def tokenizer_file(self) -> tuple[str, Path] | None:
        """The target's tokenizer as a file an edge can load, written once into the cache: the vocabulary-only
        GGUF of a GGUF model, else the fast tokenizer's ``tokenizer.json``; None without a fast tokenizer."""
        from tandem.core.cache import cache_dir
        from tandem.core.hf_tokenizer import FORMAT

        if self._gguf is not None:
            from tandem.core.vocab import served_vocab_gguf
            return "gguf-vocab", served_vocab_gguf(self._gguf, self.vocab_fingerprint)
        folder = cache_dir() / "verifier" / "tokenizers"
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        path = folder / f"{self.vocab_fingerprint[:32]}.json"
        if not path.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(backend.to_str())
            tmp.replace(path)
        return FORMAT, path

    def piece(self, token: int) -> bytes:
        """The text a token renders as, whole (a byte-level token that ends inside a UTF-8 character renders as
        U+FFFD here; the ids this serves, past a drafter's vocabulary, are padding and added tokens)."""
        if self.tokenizer is None or not 0 <= token < len(self.tokenizer):
            return b""
        return self.tokenizer.decode([token], skip_special_tokens=True).encode("utf-8")

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def new_sequence(self) -> _Seq:
        from transformers import DynamicCache
        return _Seq(DynamicCache(config=self.model.config))

    def prefill(self, seq: _Seq, tokens: Sequence[int], generated: int = 0, partition: str = SHARED,
                chunk: int = 512) -> int:
        """Returns how many of ``tokens`` came from ``partition``'s prefix cache instead of being computed."""
        if seq.n_past:
            raise RuntimeError("prefill needs an empty sequence")
        torch = self.torch
        tokens = list(tokens)
        seq.partition = partition
        reused = 0
        if self.prefix_cache is not None:
            blocks, reused = self.prefix_cache.lookup(tokens, partition)
            for li in range(len(blocks[0]) if blocks else 0):
                seq.cache.update(torch.cat([b[li][0] for b in blocks], dim=2),
                                 torch.cat([b[li][1] for b in blocks], dim=2), li)
        # deterministic mode: what verify forwards computed before (a resume's output) goes through the same runs
        split = len(tokens) - min(generated, len(tokens)) if self.deterministic else len(tokens)
        with torch.inference_mode():
            for lo in range(reused, split, chunk):
                ids = torch.tensor([tokens[lo: min(split, lo + chunk)]], device=self.device)
                pos = torch.arange(lo, lo + ids.shape[1], device=self.device)[None]
                self.model(input_ids=ids, position_ids=pos, past_key_values=seq.cache, use_cache=True,
                           logits_to_keep=1)
                if split - reused > 4 * chunk:
                    log.info("prefill %d/%d tokens", min(lo + chunk, split), len(tokens))
        if split < len(tokens):
            seq.n_past = split
            n = len(tokens) - split
            self._runs(seq, tokens[split:], range(split, len(tokens)), np.tril(np.ones((n, n), dtype=bool)))
        seq.n_past = len(tokens)
        seq.tokens = tokens
        return reused

    def forward_tree(self, seq: _Seq, root_token: int, tree: DraftTree) -> np.ndarray:
        return self.forward_batch([TreeJob(seq, root_token, tree)])[0]

    def forward_batch(self, jobs: Sequence[TreeJob]) -> list[np.ndarray]:
        """Padded batch: row i holds session i's cache left-padded to the longest past P and its root + tree
        right-padded to the largest tree Q; the per-row mask hides the padding. Afterwards each session's cache is
        cut back out of the batch cache (its past + its own new tokens)."""
        if self.deterministic:  # one session per forward: a linear layer's rows round by the rows in the forward
            return [self._forward_runs(j) for j in jobs]
        torch = self.torch
        from transformers import DynamicCache

        n = len(jobs)
        pasts = [j.seq.n_past for j in jobs]
        P, Q = max(pasts), max(j.n_tokens for j in jobs)
        ids = torch.zeros((n, Q), dtype=torch.long)
        pos = torch.zeros((n, Q), dtype=torch.long)
        allowed = np.zeros((n, 1, Q, P + Q), dtype=bool)
        for i, j in enumerate(jobs):
            j.seq.root = j.root
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

    def _forward_runs(self, job: TreeJob) -> np.ndarray:
        job.seq.root = job.root
        base = job.seq.n_past
        return self._runs(job.seq, [job.root, *job.tree.tokens], [base] + [base + d for d in job.tree.depths],
                          tree_attention_allowed(job.tree))

    def _runs(self, seq: _Seq, tokens: Sequence[int], positions: Sequence[int], allowed: np.ndarray) -> np.ndarray:
        """Feed ``tokens`` after ``seq``'s ``n_past`` committed tokens in forwards of exactly ``RUN_TOKENS`` rows
        (padding rows attend to themselves only and leave the cache after each run); ``allowed[i, j]``: token i
        sees token j of these (every one sees the whole committed past). All of them stay in the cache, after the
        past, in order; returns their logits ``(len(tokens), vocab)``."""
        torch, R, base = self.torch, RUN_TOKENS, seq.n_past
        out = []
        for lo in range(0, len(tokens), R):
            real, past = min(R, len(tokens) - lo), base + lo
            ids = torch.zeros((1, R), dtype=torch.long)
            ids[0, :real] = torch.tensor(list(tokens[lo: lo + real]))
            pos = torch.full((1, R), int(positions[lo + real - 1]) + 1, dtype=torch.long)
            pos[0, :real] = torch.tensor([int(p) for p in positions[lo: lo + real]])
            ok = np.zeros((1, 1, R, past + R), dtype=bool)
            ok[0, 0, :real, :base] = True
            ok[0, 0, :real, base: past + real] = allowed[lo: lo + real, : lo + real]
            for r in range(real, R):
                ok[0, 0, r, past + r] = True
            mask = torch.zeros(ok.shape, dtype=self.dtype, device=self.device)
            mask.masked_fill_(~torch.from_numpy(ok).to(self.device), torch.finfo(self.dtype).min)
            with torch.inference_mode():
                res = self.model(input_ids=ids.to(self.device), position_ids=pos.to(self.device), attention_mask=mask,
                                 past_key_values=seq.cache, use_cache=True)
            out.append(res.logits[0, :real].float().cpu().numpy())
            for layer in seq.cache.layers:  # the pads leave
                layer.keys, layer.values = layer.keys[:, :, : past + real], layer.values[:, :, : past + real]
        return np.concatenate(out)

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
        seq.tokens += [seq.root, *(tree.tokens[i] for i in path)]

    def release(self, seq: _Seq) -> None:
        if self.prefix_cache is not None and seq.n_past and seq.cache is not None:
            layers, b = seq.cache.layers, self.prefix_cache.block_tokens
            # clone: a slice would keep the whole session's tensors alive
            self.prefix_cache.store(seq.tokens[:seq.n_past], lambda i: tuple(
                (layer.keys[:, :, i * b: (i + 1) * b].clone(), layer.values[:, :, i * b: (i + 1) * b].clone())
                for layer in layers), seq.partition)
        seq.cache = None
        seq.n_past = 0
        seq.tokens = []

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (their tensors are freed with them)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
