"""The scripted verifier engine (cloud/engines/scripted_engine.py) at the small sizes the pure-logic tests use: greedy
next token after t is ``nxt(t)`` over V ids, EOS the last."""
from tandem.cloud.engines.scripted_engine import ScriptedEngine as RuleEngine

V, EOS = 50, 49


class ScriptedEngine(RuleEngine):
    """Target whose greedy next token after t is ``nxt(t)``; records the cache operations it is asked for. Sizes are
    class attributes, so a test's subclass can change them."""
    vocab_size, n_ctx, max_tree_nodes, max_batch_tokens, model_id = V, 64, 32, 64, "m"

    def __init__(self, nxt):
        cls = type(self)
        super().__init__(nxt, cls.vocab_size, cls.n_ctx, cls.max_tree_nodes, cls.max_batch_tokens, cls.model_id)
        self.eos, self.vocab_fingerprint = EOS, "fp"


def succ(t):  # 1 -> 2 -> 3 ... -> 48 -> EOS
    return min(t + 1, EOS)
