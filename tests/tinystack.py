"""A whole Tandem stack on a tiny random-weight Qwen2 (torch verifier engine, gRPC, edge client), fast enough to run
thousands of generations in a test: the target is the tiny model, the drafter drafts from the same model's
top-k (exact scores, no cache: the model is tiny)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import transformers

from tandem.core.tree import TreeShape
from tandem.edge.drafting import BuiltTree, TopK, build_tree

V = 12


def tiny_model(seed: int = 0, sharpness: float = 15.0):
    """Random Qwen2 with a sharpened head, so distributions have a few likely tokens (drafts get accepted)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


class TinyTokenizer:
    n_vocab = V
    vocab_fingerprint = ""

    def piece(self, token: int) -> bytes:
        return f"<{token}>".encode()


class TinyDrafter:
    """Implements edge.drafter.Drafter (with speculate/adopt) by running the tiny model on every prefix."""
    name = "tiny"

    def __init__(self, model, n_ctx: int = 128):
        self.model, self.n_ctx, self.tokenizer = model, n_ctx, TinyTokenizer()
        self.history: list[int] = []
        self._spec: tuple[list[int], BuiltTree] | None = None

    def _top_k(self, seq: Sequence[int], k: int) -> TopK:
        with torch.inference_mode():
            row = torch.log_softmax(self.model(torch.tensor([list(seq)])).logits[0, -1].double(), -1).numpy()
        order = np.argsort(-row, kind="stable")[:k]
        return [(int(t), float(row[t])) for t in order]

    def _draft_on(self, base: list[int], shape: TreeShape) -> BuiltTree:
        def expand(nodes, tokens, parents):
            out = []
            for c in nodes:
                path, i = [], c
                while i >= 0:
                    path.append(tokens[i])
                    i = parents[i]
                out.append(self._top_k(base + path[::-1], shape.k))
            return out
        return build_tree(self._top_k(base, shape.k), expand, shape)

    def start(self, prompt: Sequence[int]) -> None:
        self.history, self._spec = list(prompt), None

    def pending(self) -> int:
        return 0

    def catch_up(self) -> None:
        pass

    def draft(self, shape: TreeShape) -> BuiltTree:
        self._spec = None
        return self._draft_on(self.history, shape)

    def commit(self, built: BuiltTree, accepted: Sequence[int], tokens: Sequence[int]) -> None:
        self._spec = None
        self.history.extend(tokens)

    def speculate(self, built: BuiltTree, path: Sequence[int], shape: TreeShape) -> BuiltTree | None:
        tokens = [built.tree.tokens[i] for i in path]
        spec = self._draft_on(self.history + tokens, shape)
        self._spec = (tokens, spec)
        return spec

    def adopt(self) -> BuiltTree:
        tokens, spec = self._spec
        self.history.extend(tokens)
        self._spec = None
        return spec
