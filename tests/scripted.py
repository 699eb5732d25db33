"""A scripted verifier engine for pure-logic tests: greedy next token after t is ``nxt(t)``."""
import numpy as np

from tandem.cloud.engine import TreeJob

V, EOS = 50, 49


class ScriptedEngine:
    """Target whose greedy next token after t is NEXT[t]; records the cache operations it is asked for."""
    name, model_id, vocab_size, vocab_fingerprint, n_ctx, max_tree_nodes = "scripted", "m", V, "fp", 64, 32
    max_batch_tokens = 64

    def __init__(self, nxt):
        self.nxt = nxt
        self.released = 0
        self.batches: list[int] = []  # sessions per forward_batch call

    def new_sequence(self):
        return {"cache": []}

    def prefill(self, seq, tokens, generated=0, partition=""):
        seq["cache"] = list(tokens)

    def forward_batch(self, jobs: list[TreeJob]):
        if sum(j.n_tokens for j in jobs) > self.max_batch_tokens:  # what llama.cpp does past n_batch
            raise ValueError(f"{sum(j.n_tokens for j in jobs)} tokens do not fit one batch")
        self.batches.append(len(jobs))
        return [self.forward_tree(j.seq, j.root, j.tree) for j in jobs]

    def forward_tree(self, seq, root, tree):
        rows = np.zeros((len(tree) + 1, V), dtype=np.float32)
        for r, tok in enumerate((root, *tree.tokens)):
            rows[r, self.nxt(tok)] = 10.0
        seq["pending"] = (root, tree)
        return rows

    def keep_path(self, seq, tree, path):
        root, _ = seq.pop("pending")
        seq["cache"] += [root] + [tree.tokens[i] for i in path]

    def is_eog(self, token):
        return token == EOS

    def release(self, seq):
        self.released += 1


def succ(t):  # 1 -> 2 -> 3 ... -> 48 -> EOS
    return min(t + 1, EOS)
