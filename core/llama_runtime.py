"""Thin llama.cpp (llama-cpp-python low-level API) runtime shared by the drafter and the verifier.

Why not the high-level ``llama_cpp.Llama``: tree batches need a context with ``kv_unified = true`` and
``n_seq_max`` >= the number of tree branches, which ``Llama`` does not set, and we need tokens tagged with several
seq ids in one ``llama_batch``. So we load the model and create contexts ourselves.

Tree-in-one-batch recipe (docs/design.md, "Engines"): tag each node with the ids of all leaf branches through
it, give it ``pos = committed_len - 1 + depth``, ``llama_memory_seq_cp`` the committed prefix into every branch id
before the decode (metadata only in a unified cache), and afterwards keep the accepted branch only.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Sequence

import llama_cpp as lc
import numpy as np

from . import llama_probe
from .chat_template import ChatTemplate
from .llama_cpu import LlamaError, best_variants, lib_dir, variant_libraries
from .vocab import fingerprint

log = logging.getLogger("tandem.llama")

__all__ = ["LlamaContext", "LlamaError", "LlamaModel", "init_backend", "top_k_logprobs"]

_init_lock = threading.Lock()
_variant: list[str | None] = []  # the CPU variant this process loaded (empty: backend not initialised yet)


@lc.llama_log_callback
def _quiet_log(level, text, user_data):  # llama.cpp is chatty on stderr; keep it quiet unless asked
    if level == 4 or os.environ.get("TANDEM_LLAMA_LOG"):  # 4 = GGML_LOG_LEVEL_ERROR (5 = continuation)
        log.warning("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())


def init_backend(variant: str | None) -> None:
    """Load llama.cpp's CPU backend once per process. A portable build (``GGML_BACKEND_DL``) ships one CPU library
    per instruction-set level and loads none by itself from a Python package's directory: load ``variant``'s
    library (``core.llama_probe`` decides which runs here). A build with a single CPU backend has it linked in."""
    with _init_lock:
        if _variant:
            if variant != _variant[0] and variant is not None:
                raise LlamaError(
                    f"this process already runs llama.cpp's CPU variant {_variant[0]!r}, and a "
                    f"model needs {variant!r}; load it in a process of its own"
                )
            return
        lc.llama_log_set(_quiet_log, ctypes.c_void_p())
        if variant is not None:
            path = variant_libraries().get(variant)
            if path is None:
                raise LlamaError(f"no CPU variant {variant!r} in {lib_dir()}")
            # through libllama's handle: dlsym then finds the libggml it links (wheels hold copies of it under
            # other names, and a second copy would keep a registry of its own)
            load = lc.llama_cpp._lib.ggml_backend_load
            load.argtypes, load.restype = [ctypes.c_char_p], ctypes.c_void_p
            if not load(str(path).encode()):
                raise LlamaError(f"llama.cpp could not load its CPU backend {path}")
        lc.llama_backend_init()
        _variant.append(variant)


class LlamaModel:
    """Weights + vocabulary of one GGUF file; contexts are created from it."""

    def __init__(
        self, path: str | Path, vocab_only: bool = False, extra_bufts: bool | None = None, repack: bool = True
    ):
        """``vocab_only``: load the tokenizer alone (no weights), e.g. to tokenize for another engine.
        ``extra_bufts``: llama.cpp's extra weight buffer types (AMX / repacked kernels); None lets
        ``core.llama_probe`` decide what this CPU runs (cached per machine and build). ``repack=False`` turns them
        off whatever the probe says (their kernels change with batch shape: see cloud/engines/deterministic.py)."""
        self.path = Path(path)
        if not self.path.is_file():
            raise LlamaError(f"model file {self.path} does not exist")
        if extra_bufts is None:
            try:
                settings = llama_probe.plan(self.path).settings
            except llama_probe.ProbeError:
                if not vocab_only:
                    raise
                # e.g. a vocabulary-only GGUF: no kernel will run, any CPU variant tokenizes
                settings = llama_probe.Settings(next(iter(best_variants()), None), False)
            init_backend(settings.variant)
            extra_bufts = settings.extra_bufts and repack
        elif not _variant:
            init_backend(next(iter(best_variants()), None))
        self.extra_bufts = extra_bufts
        params = lc.llama_model_default_params()
        params.vocab_only = vocab_only
        params.use_extra_bufts = extra_bufts
        self._model = lc.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise LlamaError(
                f"llama.cpp could not load {self.path} (not a GGUF file, a truncated or corrupt one, or "
                f"an architecture this llama.cpp build does not know)"
            )
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train = lc.llama_model_n_ctx_train(self._model)
        buf = ctypes.create_string_buffer(256)
        lc.llama_model_desc(self._model, buf, len(buf))
        self.description = buf.value.decode("utf-8", "replace")
        self.identity = f"{self.path.name} ({self.description})"
        self._fingerprints: dict[int, str] = {}  # prefix length -> fingerprint
        self._chat: ChatTemplate | None = None
        self._eog = np.array([lc.llama_vocab_is_eog(self._vocab, t) for t in range(self.n_vocab)], dtype=bool)

    def close(self) -> None:
        if self._model:
            lc.llama_model_free(self._model)
            self._model = None

    # -- vocabulary ---------------------------------------------------------------------------------------------
    @property
    def vocab_fingerprint(self) -> str:
        """sha256 over every token's text in id order (``core.vocab``): equal fingerprints mean ids carry the
        same text."""
        return self.vocab_fingerprint_of(self.n_vocab)

    def vocab_fingerprint_of(self, n: int) -> str:
        """The fingerprint of ids [0, n) alone: what a drafter with n ids sends, so a target whose vocabulary
        pads the drafter's (same texts below n, more ids above) can check it against its own first n."""
        if not 0 < n <= self.n_vocab:
            raise ValueError(f"a vocabulary prefix of {n} ids is outside [1, {self.n_vocab}]")
        if n not in self._fingerprints:
            self._fingerprints[n] = fingerprint(lc.llama_vocab_get_text(self._vocab, t) or b"" for t in range(n))
        return self._fingerprints[n]

    def is_eog(self, token: int) -> bool:
        return bool(self._eog[token])

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self._vocab, data, len(data), buf, cap, False, special)
        if n < 0:
            buf = (lc.llama_token * -n)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, -n, False, special)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        """Bytes of one token as it appears in generated text (control tokens render as nothing, or with
        ``special`` as their text, as a prompt spells them)."""
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    @property
    def vocab_handle(self):
        """llama.cpp's vocabulary object (for libraries that read it directly, e.g. llguidance)."""
        return self._vocab

    @property
    def chat_template(self) -> str:
        """The model's own Jinja chat template (GGUF ``tokenizer.chat_template``); empty when it has none."""
        tmpl = lc.llama_model_chat_template(self._model, None)
        return tmpl.decode("utf-8") if tmpl else ""

    def special_text(self, which: str) -> str:
        """The text of the BOS or EOS token (``which``: "bos" | "eos"), as templates write it; empty if none."""
        token = lc.llama_vocab_bos(self._vocab) if which == "bos" else lc.llama_vocab_eos(self._vocab)
        if token < 0:
            return ""
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", "replace")

    def chat_prompt(self, messages: Sequence[dict]) -> str:
        """Render a conversation with the model's own Jinja template (as Hugging Face does: a default system
        prompt, tool sections and the like are the template's to decide), ending with the assistant's turn."""
        if self._chat is None:
            if not self.chat_template:
                raise LlamaError(f"{self.path.name} has no chat template; pass a raw prompt instead")
            self._chat = ChatTemplate(self.chat_template, self.special_text("bos"), self.special_text("eos"))
        return self._chat.render(messages)


STATE_MAGIC = 0xAF143CD8  # what llama.cpp writes first in a sequence's serialized state


class LlamaContext:
    """One llama.cpp context with a unified KV cache, able to decode token trees tagged with seq-id sets."""

    def __init__(
        self,
        model: LlamaModel,
        n_ctx: int,
        n_seq_max: int,
        n_batch: int = 512,
        n_threads: int | None = None,
        flash_attn: bool | None = None,
    ):
        """``flash_attn``: None lets llama.cpp decide (it turns it on where the backend supports it)."""
        if n_seq_max > lc.llama_max_parallel_sequences():
            raise LlamaError(f"n_seq_max {n_seq_max} exceeds llama.cpp's limit {lc.llama_max_parallel_sequences()}")
        self.model = model
        threads = n_threads or max(1, os.cpu_count() or 1)
        p = lc.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_batch
        p.n_seq_max = n_seq_max
        p.kv_unified = True
        p.n_threads = threads
        p.n_threads_batch = threads
        p.no_perf = True
        if flash_attn is not None:
            p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._ctx = lc.llama_init_from_model(model._model, p)
        if not self._ctx:
            raise LlamaError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max})")
        self.n_ctx = lc.llama_n_ctx(self._ctx)
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_init(n_batch, 0, n_seq_max)

    def close(self) -> None:
        if self._ctx:
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            self._ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    # -- decoding -----------------------------------------------------------------------------------------------
    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seq_sets: Sequence[Sequence[int]], logits: Sequence[bool]
    ) -> np.ndarray:
        """One ``llama_decode`` of up to ``n_batch`` tokens; returns the logits rows of the tokens flagged in
        ``logits``, in batch order, as a view that is valid until the next decode."""
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise LlamaError(f"a batch holds 1..{self.n_batch} tokens, got {n}")
        b = self._batch
        n_out = 0
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            seqs = seq_sets[i]
            b.n_seq_id[i] = len(seqs)
            for j, s in enumerate(seqs):
                b.seq_id[i][j] = s
            b.logits[i] = bool(logits[i])
            n_out += bool(logits[i])
        b.n_tokens = n
        rc = lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise LlamaError(f"llama_decode failed with code {rc} (batch of {n} tokens)")
        if n_out == 0:
            return np.empty((0, self.model.n_vocab), dtype=np.float32)
        ptr = lc.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.model.n_vocab))

    def prefill(
        self,
        tokens: Sequence[int],
        start_pos: int,
        seq: int = 0,
        logits_last: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> np.ndarray:
        """Decode a run of tokens into ``seq`` in chunks of ``n_batch``; optionally return the last row's logits."""
        out = np.empty((0, self.model.n_vocab), dtype=np.float32)
        for lo in range(0, len(tokens), self.n_batch):
            chunk = tokens[lo : lo + self.n_batch]
            last = lo + len(chunk) == len(tokens)
            flags = [False] * len(chunk)
            if last and logits_last:
                flags[-1] = True
            out = self.decode(chunk, range(start_pos + lo, start_pos + lo + len(chunk)), [(seq,)] * len(chunk), flags)
            if progress:
                progress(lo + len(chunk), len(tokens))
        return out

    # -- KV cache -------------------------------------------------------------------------------------------------
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        lc.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        if not lc.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise LlamaError(f"llama.cpp could not remove positions [{p0}, {p1}) of seq {seq}")

    def seq_keep(self, seq: int) -> None:
        lc.llama_memory_seq_keep(self._mem, seq)

    def seq_pos_max(self, seq: int) -> int:
        return lc.llama_memory_seq_pos_max(self._mem, seq)

    def seq_pos_min(self, seq: int) -> int:
        return lc.llama_memory_seq_pos_min(self._mem, seq)

    def clear(self) -> None:
        lc.llama_memory_clear(self._mem, True)

    def count_cells_from(self, token: int, seq: int) -> None:
        """Learn how llama.cpp's serialized size of a seq grows per cell (decodes ``token`` at positions 0 and 1
        of ``seq``, which must be empty, and empties it again), so that ``seq_cell_count`` can count cells without
        copying any."""
        self.decode([token, token], [0, 1], [(seq,), (seq,)], [False, False])
        two = lc.llama_state_seq_get_size(self._ctx, seq)
        self.seq_rm(seq, 1, -1)
        one = lc.llama_state_seq_get_size(self._ctx, seq)
        self.seq_rm(seq)
        self._per_cell, self._no_cell = two - one, lc.llama_state_seq_get_size(self._ctx, seq)
        self._cells_base = one - self._per_cell

    def seq_cell_count(self, seq: int) -> int:
        """How many cells ``seq`` holds (each position counts once per cell holding it), from the size llama.cpp's
        serialization would take (counted, not copied); needs ``count_cells_from`` once."""
        size = lc.llama_state_seq_get_size(self._ctx, seq)
        if size == self._no_cell:
            return 0
        n, rest = divmod(size - self._cells_base, self._per_cell)
        if rest:
            raise LlamaError(f"seq {seq} serializes to {size} bytes, not a whole number of cells")
        return n

    def seq_state(self, seq: int) -> bytes:
        """The cells of ``seq`` (positions and K/V), as llama.cpp serializes them: ``set_seq_state`` puts them,
        bit for bit, into a seq of another context of the same model and settings."""
        size = lc.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        n = lc.llama_state_seq_get_data(self._ctx, buf, size, seq)
        if n != size:
            raise LlamaError(f"llama.cpp serialized {n} bytes of seq {seq}, expected {size}")
        return bytes(buf)

    def set_seq_state(self, seq: int, data: bytes) -> None:
        """Load cells ``seq_state`` serialized into ``seq`` (empty before), in the order they were kept."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if lc.llama_state_seq_set_data(self._ctx, buf, len(data), seq) != len(data):
            raise LlamaError(f"llama.cpp could not load {len(data)} bytes of cells into seq {seq}")

    def cells(self, seq: int = -1) -> list[tuple[int, tuple[int, ...]]]:
        """The occupied cells of ``seq`` (-1: of the whole cache) in cache order, as (position, seq ids; only
        ``seq`` itself when one is named): the whole truth of what a forward can attend to, for checks that cannot
        trust per-seq position ranges (a hole or a stray cell inside a range is invisible there). Reads llama.cpp's
        serialized state (a copy of those cells' K/V). Models whose cells carry extra data (M-RoPE) are refused."""
        if lc.llama_model_rope_type(self.model._model) in (lc.LLAMA_ROPE_TYPE_MROPE, lc.LLAMA_ROPE_TYPE_IMROPE):
            raise LlamaError("cells(): cells of M-RoPE models carry extra data this reader does not parse")
        data = memoryview(self.seq_state(seq))
        # llama.cpp's layout: magic, seq id, then the cache's: streams, and per stream its cells' count, each cell's
        # position and seq ids, then their K/V (not read here)
        magic, n_stream = int.from_bytes(data[0:4], "little"), int.from_bytes(data[8:12], "little")
        if magic != STATE_MAGIC or n_stream != 1:  # (a unified cache has one stream)
            raise LlamaError(
                f"cells(): a state of magic {magic:#x} with {n_stream} KV streams, expected "
                f"{STATE_MAGIC:#x} and 1 (kv_unified)"
            )
        count, at = int.from_bytes(data[12:16], "little"), 16
        out: list[tuple[int, tuple[int, ...]]] = []
        for _ in range(count):
            pos = int.from_bytes(data[at : at + 4], "little", signed=True)
            n_seq = int.from_bytes(data[at + 4 : at + 8], "little")
            ids = tuple(
                int.from_bytes(data[at + 8 + 4 * j : at + 12 + 4 * j], "little", signed=True) for j in range(n_seq)
            )
            if not 0 < n_seq <= self.n_seq_max or any(not 0 <= s < self.n_seq_max for s in ids):
                raise LlamaError(f"cells(): unreadable cell {len(out)} (pos {pos}, {n_seq} seq ids)")
            out.append((pos, ids))
            at += 8 + 4 * n_seq
        return out

    # -- adapters -------------------------------------------------------------------------------------------------
    def set_lora(self, adapter: "LoraAdapter | None", scale: float = 1.0) -> None:
        """Compute with ``adapter`` from the next decode on (None: the base weights alone). The cache keeps what
        was computed before: the caller drops what no longer holds."""
        if adapter is None:
            ok = lc.llama_set_adapters_lora(self._ctx, None, 0, None) == 0
        else:
            if adapter.model is not self.model:
                raise LlamaError(f"adapter {adapter.path.name} was loaded for another model")
            ok = (
                lc.llama_set_adapters_lora(
                    self._ctx, (lc.llama_adapter_lora_p_ctypes * 1)(adapter._adapter), 1, (ctypes.c_float * 1)(scale)
                )
                == 0
            )
        if not ok:
            raise LlamaError("llama.cpp could not set the context's LoRA adapters")


class LoraAdapter:
    """A LoRA adapter file (llama.cpp's GGUF) loaded for one model; contexts of that model apply it by
    ``LlamaContext.set_lora``. Loading checks it fits the model (architecture, tensor names and shapes)."""

    def __init__(self, model: LlamaModel, path: str | Path):
        self.model, self.path = model, Path(path)
        self._adapter = lc.llama_adapter_lora_init(model._model, str(self.path).encode())
        if not self._adapter:
            raise LlamaError(
                f"llama.cpp could not load the LoRA adapter {self.path} for {model.path.name} (not an "
                f"adapter of this model's architecture and shapes?)"
            )

    def close(self) -> None:
        """Free it (no context may still apply it). A closed model has freed its adapters already."""
        if self._adapter and self.model._model:
            lc.llama_adapter_lora_free(self._adapter)
            self._adapter = None


def top_k_logprobs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of one logits row with their log-softmax, most likely first."""
    row = logits.astype(np.float64, copy=False)
    m = row.max()
    lse = m + np.log(np.exp(row - m).sum())
    idx = np.argpartition(-row, k)[:k] if k < row.size else np.arange(row.size)
    idx = idx[np.argsort(-row[idx], kind="stable")]
    return [(int(t), float(row[t] - lse)) for t in idx]
