"""ONNX Runtime drafter: the exported decoder (edge/export/onnx_export.py) on CPU, behind the same protocol as the
llama.cpp drafter, with an optional VocabTrim head.

Cache: keys/values live in numpy arrays ``[L, H_kv, n_ctx, D]``. Slots ``[0, n_kv)`` hold the committed tokens the
drafter has evaluated; a draft appends its evaluated tree nodes after them, one level per decoder call, each node
masked to see the committed prefix, its ancestors and itself (a tree mask, so levels are batched, not branches).
After a verdict the evaluated accepted nodes (a prefix of the accepted path) are moved down to follow the
committed slots and everything else is forgotten: rollback is an index, not a recompute.

Proactive drafting (``speculate``/``adopt``): while a tree is being verified, the path the drafter expects to be
accepted and the next tree below it are evaluated into the free slots after the tree in flight (the mask lets them
see exactly the committed prefix and that path), so the verdict either adopts them (the path's slots move down) or
they are forgotten.
"""
from __future__ import annotations

import hashlib
import json
import logging
import platform
import threading
from pathlib import Path
from typing import Sequence, overload

import numpy as np

from tandem.core.llama_runtime import LlamaModel, top_k_logprobs
from tandem.core.model_id import file_sha256
from tandem.core.tree import DraftTree, TreeShape, common_prefix

from .drafting import BuiltTree, TopK, build_tree
from .export.onnx_export import BITS, NEG, RowTable, quantize_weights
from .vocabtrim import LiveVocab

log = logging.getLogger("tandem.edge.onnx")

_POOL_LOCK = threading.Lock()
_POOL_THREADS: list[int] = []  # the process's onnxruntime intra-op pool size, once set


def providers_for(system: str, machine: str, quant: str, available: Sequence[str]) -> list[str]:
    """The execution providers a drafter session uses on a platform (``platform.system()``/``machine()``), best
    first, among those this onnxruntime build has; the CPU provider always last.

    The decoder's weights are MatMulNBits (int4/int8), a contrib op only the CPU provider runs; on arm64 it uses
    KleidiAI/NEON kernels, on x86 AVX2/AVX-512. A provider that cannot take those nodes would split the graph into
    many small partitions with copies at every boundary, so:

    - Android (arm64): XNNPACK first, which takes the float ops it supports (softmax, the attention matmuls) and
      leaves MatMulNBits to the CPU provider. NNAPI is deprecated since Android 15 and QNN (Snapdragon NPU) needs a
      statically shaped QDQ graph, while a drafter's shapes change every call (T new tokens, P cached ones).
    - Apple: CoreML only for a float (fp32) export; it has no MatMulNBits, and it compiles per input shape.
    - Everything else: the CPU provider."""
    system, machine = system.lower(), machine.lower()
    arm = machine in ("arm64", "aarch64", "armv8l")
    wanted = []
    if system == "android" or (system == "linux" and arm and "XnnpackExecutionProvider" in available):
        wanted.append("XnnpackExecutionProvider")
    if system in ("darwin", "ios") and quant == "fp32":
        wanted.append("CoreMLExecutionProvider")
    return [p for p in wanted if p in available] + ["CPUExecutionProvider"]


def session_options(n_threads: int | None):
    """Options for every session of this process's drafters: one shared intra-op thread pool.

    The decoder and the head are separate sessions, called one after the other for every drafted level. With a
    pool per session (onnxruntime's default) the decoder's idle threads spin while the head runs and the two
    pools fight over the cores: a level then costs about twice the two sessions' times apart (commit 267268b has
    the figures). One process-wide pool (sized by the first drafter; ``n_threads`` None: onnxruntime's choice, the
    physical cores) removes the contention."""
    import onnxruntime as ort
    from onnxruntime.capi import _pybind_state
    with _POOL_LOCK:
        if not _POOL_THREADS:
            try:
                _pybind_state.set_global_thread_pool_sizes(n_threads or 0, 1)
            except Exception as e:  # created before us (another onnxruntime user in this process): share them
                log.info("onnxruntime's global thread pools exist already: %s", e)
            _POOL_THREADS.append(n_threads or 0)
        elif _POOL_THREADS[0] != (n_threads or 0):
            log.info("onnxruntime's thread pool is already sized %d (asked %d): sharing it",
                     _POOL_THREADS[0], n_threads or 0)
    opts = ort.SessionOptions()
    opts.use_per_session_threads = False
    opts.log_severity_level = 3
    return opts


def _head_graph(weight: np.ndarray, path: Path, quant: str) -> None:
    """hidden [T, E] -> logits [T, K] = hidden @ weight.T, saved at ``path`` (quantized like the decoder)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    k, e = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["hidden", "W"], ["logits"])], "head",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["T", e])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", k])],
        [numpy_helper.from_array(np.ascontiguousarray(weight.T, dtype=np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if quant not in BITS:
        onnx.save(model, str(path))
        return
    fp32 = path.with_suffix(".fp32.onnx")
    onnx.save(model, str(fp32))
    quantize_weights(fp32, path, BITS[quant])
    fp32.unlink()


class OnnxDrafter:
    name = "onnx"
    _root_logits: np.ndarray | None  # the head's logits below the last committed token, once evaluated

    def __init__(self, model_dir: str | Path, tokenizer_gguf: str | Path | None = None, n_ctx: int = 4096,
                 n_threads: int | None = None, vocab_ids: np.ndarray | None = None, max_nodes: int = 64,
                 prefill_chunk: int = 256, tokenizer=None):
        """``model_dir``: an export (edge/export/onnx_export.py). Tokenization uses ``tokenizer``, else the vocabulary
        of ``tokenizer_gguf`` (default: the export's source, when it is a GGUF)."""
        import onnxruntime as ort
        self.dir = Path(model_dir)
        self.meta = json.loads((self.dir / "meta.json").read_text())
        if tokenizer is None:
            gguf = Path(tokenizer_gguf or self.meta["source"])
            if gguf.suffix != ".gguf":
                raise ValueError("the ONNX drafter tokenizes with a GGUF of the same vocabulary; pass "
                                 "tokenizer_gguf")
            tokenizer = LlamaModel(gguf, vocab_only=True)
        self.tokenizer = tokenizer
        if self.tokenizer.n_vocab != self.meta["vocab_size"]:
            raise ValueError(f"tokenizer has {self.tokenizer.n_vocab} ids, the exported model "
                             f"{self.meta['vocab_size']}: they are not the same model family")
        opts = session_options(n_threads)
        self.providers = providers_for(platform.system(), platform.machine(), self.meta["quant"],
                                       ort.get_available_providers())
        self._opts = opts
        self._base_dir = self.dir  # the export without an adapter (set_adapter)
        self._load(self.dir)
        self.live: LiveVocab | None = None
        self.head_refreshes = 0  # heads swapped in from live traffic (``learn``)
        self._next_head: tuple[np.ndarray, object] | None = None  # built in the background, swapped in at start
        self._building = False
        self._head_lock = threading.Lock()
        self.set_vocab(vocab_ids)
        self.n_ctx = n_ctx
        self.max_nodes = max_nodes
        self.prefill_chunk = prefill_chunk
        L, H, D = self.meta["layers"], self.meta["kv_heads"], self.meta["head_dim"]
        self._k = np.zeros((L, H, n_ctx, D), dtype=np.float32)
        self._v = np.zeros_like(self._k)
        self.history: list[int] = []
        self._n_kv = 0
        self._slot: dict[int, int] = {}  # candidate -> cache slot of this round's evaluated nodes
        self._anc: dict[int, list[int]] = {}  # candidate -> slots of its evaluated ancestors + itself
        self._top = 0  # first free slot (after the committed ones and the tree in flight's)
        self._spec: tuple | None = None  # (path tokens, their slots, tree, slots, ancestors) of a speculation

    def _load(self, model_dir: Path) -> None:
        import onnxruntime as ort
        self.dir = model_dir
        self._embed = RowTable(self.dir, "embed")
        self._head_rows = RowTable(self.dir, self.meta.get("head_table", "embed"))
        self._decoder = ort.InferenceSession(str(self.dir / "decoder.onnx"), self._opts, providers=self.providers)

    # -- adapters (edge.adapters) ---------------------------------------------------------------------------------
    @property
    def base_sha256(self) -> str:
        """The source GGUF's sha256: what an adapter names as the drafter it was trained on."""
        return file_sha256(self.meta["source"])

    def prepare_adapter(self, path: str | Path) -> Path:
        """The export with the LoRA adapter at ``path`` merged into its weights (made once, cached: minutes of a
        background thread, never the drafting one)."""
        from .export.onnx_export import export
        return export(self.meta["source"], self.meta["quant"], cache_root=self._base_dir.parent, adapter=path)

    def set_adapter(self, prepared: Path | None) -> None:
        """Draft with an export ``prepare_adapter`` made (None: the export without one). Between generations only:
        the cache's slots were computed with the weights before, so all of them go."""
        meta = json.loads(((prepared or self._base_dir) / "meta.json").read_text())
        if (meta["source_sha256"], meta["quant"]) != (self.meta["source_sha256"], self.meta["quant"]):
            raise ValueError(f"{prepared} is not an export of this drafter's source and quantization")
        self._load(prepared or self._base_dir)
        self.set_vocab(self.ids)
        self._n_kv = self._top = 0
        self._root_logits = None
        self._slot, self._anc, self._spec = {}, {}, None

    def set_vocab(self, vocab_ids: np.ndarray | None) -> None:
        """Score the full vocabulary (None) or only these sorted ids (a VocabTrim head); built once, cached."""
        self.ids = None if vocab_ids is None else np.asarray(vocab_ids, dtype=np.int32)
        self._head = self._head_session(self.ids)
        self._root_logits = None  # logits over the old head are meaningless now
        if self.live is not None and self.ids is not None:
            self.live.set_ids(self.ids)

    def learn(self, live: LiveVocab | None) -> None:
        """Keep a trimmed head current with the traffic served (``vocabtrim.LiveVocab`` over this head's ids): every
        committed token is counted; when the head misses more than its target, a new head of the same size is built
        on a background thread and swapped in at the next ``start``, between generations. The verifier's decisions
        never depend on the head, so this changes acceptance, never output."""
        if live is not None and self.ids is None:
            raise ValueError("live vocabulary learning needs a trimmed head (vocab_ids)")
        self.live = live
        if live is not None and self.ids is not None:
            live.set_ids(self.ids)

    def _swap_head(self, live: LiveVocab) -> None:
        with self._head_lock:
            ready, self._next_head = self._next_head, None
        if ready is not None:
            self.ids, self._head = ready
            live.set_ids(ready[0])
            self.head_refreshes += 1
            log.info("drafter head refreshed from live traffic (%d ids)", len(ready[0]))
        elif live.due and not self._building:
            self._building = True
            threading.Thread(target=self._build_head, args=(live.vocab(),), name="vocabtrim-head",
                             daemon=True).start()

    def _build_head(self, ids: np.ndarray) -> None:
        try:
            session = self._head_session(ids)
            with self._head_lock:
                self._next_head = (ids, session)
        except Exception:  # a failed refresh keeps the current head
            log.exception("could not build a refreshed drafter head")
        finally:
            self._building = False

    def _head_session(self, ids: np.ndarray | None):
        import onnxruntime as ort
        return ort.InferenceSession(str(self._head_file(ids)), self._opts, providers=self.providers)

    @property
    def vocab_k(self) -> int:
        return self.meta["vocab_size"] if self.ids is None else len(self.ids)

    def _head_file(self, ids: np.ndarray | None) -> Path:
        quant = self.meta["quant"]
        if ids is None:
            path = self.dir / f"head-full-{quant}.onnx"
        else:
            digest = hashlib.sha256(ids.tobytes()).hexdigest()[:12]
            path = self.dir / f"head-{len(ids)}-{digest}-{quant}.onnx"
        if not path.is_file():  # built under a temporary name: a crash mid-way leaves no half head behind
            partial = path.with_name(f"{path.stem}.{threading.get_ident()}.partial.onnx")
            _head_graph(self._head_rows.rows(ids), partial, quant)
            partial.replace(path)
        return path

    # -- model calls --------------------------------------------------------------------------------------------
    @overload
    def _run(self, tokens: Sequence[int], positions: Sequence[int], mask: np.ndarray, n_past: int,
             logits_rows: slice) -> np.ndarray: ...

    @overload
    def _run(self, tokens: Sequence[int], positions: Sequence[int], mask: np.ndarray, n_past: int,
             logits_rows: None) -> None: ...

    def _run(self, tokens: Sequence[int], positions: Sequence[int], mask: np.ndarray, n_past: int,
             logits_rows: slice | None) -> np.ndarray | None:
        """Evaluate ``tokens`` against cache slots [0, n_past); their K/V go to slots [n_past, n_past + T). The head
        logits of the rows ``logits_rows`` of them (None: none)."""
        t = len(tokens)
        if n_past + t > self.n_ctx:
            raise ValueError(f"drafter context of {self.n_ctx} tokens is full")
        hidden, new_k, new_v = self._decoder.run(None, {
            "embeds": self._embed.rows(tokens), "positions": np.asarray(positions, dtype=np.int64),
            "mask": mask, "past_k": self._k[:, :, :n_past], "past_v": self._v[:, :, :n_past]})
        self._k[:, :, n_past:n_past + t] = new_k
        self._v[:, :, n_past:n_past + t] = new_v
        if logits_rows is None:
            return None
        return self._head.run(None, {"hidden": np.ascontiguousarray(hidden[logits_rows])})[0]

    def _top_k(self, logits_row: np.ndarray, k: int) -> TopK:
        """Top-k of one row of head logits, as real token ids (log-probabilities over the head's vocabulary)."""
        if self.ids is None:
            return top_k_logprobs(logits_row, k)
        return [(int(self.ids[i]), lp) for i, lp in top_k_logprobs(logits_row, k)]

    def score(self, tokens: Sequence[int]) -> np.ndarray:
        """Teacher-forced head logits after every prefix of ``tokens`` (one causal pass; leaves the session's
        cache alone only if called before ``start``): for agreement checks and benchmarks."""
        t = len(tokens)
        mask = np.triu(np.full((t, t), NEG, dtype=np.float32), k=1)
        self.start([])
        return self._run(list(tokens), range(t), mask, 0, slice(None))

    # -- drafter protocol -----------------------------------------------------------------------------------------
    def start(self, prompt: Sequence[int]) -> None:
        """A new session on ``prompt``; the slots of the previous session's evaluated history that ``prompt`` starts
        with stay valid (the next turn of a chat evaluates only its new tokens)."""
        if self.live is not None:
            self._swap_head(self.live)
        keep = common_prefix(self.history[:self._n_kv], prompt)
        self.history = list(prompt)
        self._n_kv = self._top = keep
        self._root_logits = None
        self._slot, self._anc, self._spec = {}, {}, None

    def pending(self) -> int:
        return len(self.history) - self._n_kv

    def catch_up(self) -> None:
        if self.history and len(self.history) + self.max_nodes < self.n_ctx:  # else nothing to draft on
            self._root_logits = self._catch_up()

    def _catch_up(self) -> np.ndarray:
        logits, self._root_logits = self._root_logits, None
        if logits is not None and self._n_kv == len(self.history):
            return logits
        if self._n_kv >= len(self.history):  # the root's logits are gone (a discarded draft): redo it
            self._n_kv = len(self.history) - 1
        while True:
            lo = self._n_kv
            chunk = self.history[lo:lo + self.prefill_chunk]
            t = len(chunk)
            mask = np.zeros((t, lo + t), dtype=np.float32)
            mask[:, lo:] = np.triu(np.full((t, t), NEG, dtype=np.float32), k=1)  # causal within the chunk
            last = lo + t == len(self.history)
            out = self._run(chunk, range(lo, lo + t), mask, lo, slice(t - 1, t) if last else None)
            self._n_kv = lo + t
            if out is not None:  # (the last chunk's)
                return out[0]

    def draft(self, shape: TreeShape) -> BuiltTree:
        if shape.k * (shape.d - 1) > self.max_nodes:
            raise ValueError(f"tree shape {shape} evaluates more than the drafter's max_nodes={self.max_nodes}")
        room = self.n_ctx - len(self.history) - shape.k * shape.d  # slots: history + the tree's evaluated nodes
        if room < 1 or len(self.history) + self.max_nodes >= self.n_ctx:
            return BuiltTree(DraftTree(), (), (), full=True)
        root = self._catch_up()
        self._spec = None
        self._slot, self._anc = {}, {}
        self._top = self._n_kv
        return self._grow(root, shape, [], self._slot, self._anc)

    def _grow(self, root_logits: np.ndarray, shape: TreeShape, base_anc: list[int], slot: dict[int, int],
              anc_of: dict[int, list[int]]) -> BuiltTree:
        """A tree below a root whose logits are ``root_logits``: each level in one call, its nodes in the free
        slots from ``_top`` on, each attending to the committed slots, ``base_anc`` (the slots of tokens between
        the committed history and the root: a speculated path) and its own ancestors."""
        base = len(self.history) - 1  # position of the last committed token; a node's is base + its ancestors

        def expand(nodes: list[int], tokens: Sequence[int], parents: Sequence[int]) -> list[TopK]:
            n_past, t = self._top, len(nodes)
            mask = np.full((t, n_past + t), NEG, dtype=np.float32)
            mask[:, :self._n_kv] = 0.0
            positions = []
            for row, c in enumerate(nodes):
                anc = (base_anc if parents[c] < 0 else anc_of[parents[c]]) + [n_past + row]
                mask[row, anc] = 0.0
                anc_of[c] = anc
                slot[c] = n_past + row
                positions.append(base + len(anc))
            logits = self._run([tokens[c] for c in nodes], positions, mask, n_past, slice(None))
            self._top = n_past + t
            return [self._top_k(row, shape.k) for row in logits]

        return build_tree(self._top_k(root_logits, shape.k), expand, TreeShape(shape.k, shape.n, shape.d))

    def speculate(self, built: BuiltTree, path: Sequence[int], shape: TreeShape) -> BuiltTree | None:
        """While ``built`` is being verified: draft the next tree now, assuming the verifier accepts ``path``
        (node indices of ``built``, root's child first). The path's tokens the tree in flight did not evaluate, and
        the new tree, go into free slots after it, masked to see the committed prefix and the path, so the tree in
        flight is untouched; ``adopt`` makes the guess real, ``commit``/``draft`` discard it."""
        self._spec = None
        if not path or self._n_kv != len(self.history) or shape.k * (shape.d - 1) > self.max_nodes:
            return None
        tokens = [built.tree.tokens[i] for i in path]
        evaluated = [self._slot[built.candidate[n]] for n in path if built.candidate[n] in self._slot]
        if len(evaluated) == len(path):  # the path's last node was evaluated but its logits are gone: redo it
            evaluated.pop()
        pending = tokens[len(evaluated):]
        if self._top + len(pending) + shape.k * shape.d >= self.n_ctx:  # free slots for the path and the tree
            return None
        lo, t = self._top, len(pending)
        mask = np.full((t, lo + t), NEG, dtype=np.float32)
        mask[:, :self._n_kv] = 0.0
        mask[:, evaluated] = 0.0
        mask[:, lo:] = np.triu(np.full((t, t), NEG, dtype=np.float32), k=1)
        first = len(self.history) + len(evaluated)  # position of the first pending path token
        root = self._run(pending, range(first, first + t), mask, lo, slice(t - 1, t))[0]
        self._top = lo + t
        path_slots = evaluated + list(range(lo, lo + t))
        slot: dict[int, int] = {}
        anc: dict[int, list[int]] = {}
        spec = self._grow(root, shape, path_slots, slot, anc)
        self._spec = (tokens, path_slots, spec, slot, anc)
        return spec

    def adopt(self) -> BuiltTree:
        """The verifier accepted the speculated path: history grows by it (its slots move down behind the committed
        ones: every slot of the tree in flight is free now) and the speculative tree becomes the tree in flight."""
        if self._spec is None:
            raise RuntimeError("no speculation to adopt")
        tokens, path_slots, spec, slot, anc = self._spec
        self._spec = None
        for j, src in enumerate(path_slots):  # ascending and >= n_kv + j, below every slot of the new tree
            dst = self._n_kv + j
            if src != dst:
                self._k[:, :, dst] = self._k[:, :, src]
                self._v[:, :, dst] = self._v[:, :, src]
        moved = {src: self._n_kv + j for j, src in enumerate(path_slots)}
        self._n_kv += len(path_slots)
        self.history.extend(tokens)
        self._slot = slot
        self._anc = {c: [moved.get(x, x) for x in a] for c, a in anc.items()}
        self._root_logits = None
        return spec

    def commit(self, built: BuiltTree, accepted: Sequence[int], tokens: Sequence[int]) -> None:
        if self.live is not None:
            self.live.observe(tokens)
        self._root_logits = None
        self._spec = None
        evaluated = [self._slot[built.candidate[n]] for n in accepted if built.candidate[n] in self._slot]
        for j, slot in enumerate(evaluated):  # slots only move down (slot >= n_kv + j)
            dst = self._n_kv + j
            if slot != dst:
                self._k[:, :, dst] = self._k[:, :, slot]
                self._v[:, :, dst] = self._v[:, :, slot]
        self._n_kv += len(evaluated)
        self._top = self._n_kv
        self.history.extend(tokens)
        self._slot, self._anc = {}, {}
