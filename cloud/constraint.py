"""Structured output on the verifier: the target's distribution restricted to what a grammar allows.

A ``Constraint`` (JSON matching a schema, or any JSON object) is compiled into an llguidance grammar over the
target's own vocabulary. At every verified position the target's logits keep only the tokens that can continue a
valid output (end-of-generation once it is complete); in a draft tree each row is masked for the prefix along
its own path: ``path_mask`` moves the matcher to a path below the committed tokens (rolling back what the last path
does not share, consuming the rest) and ``rewind`` returns it to the committed tokens, so the acceptance walk masks
only the rows it reads (cloud/shaping.py). Acceptance then runs on the masked rows unchanged, so the output is
exactly the constrained target's: token-identical to constrained target-only decoding when greedy, the same
distribution when sampling. A draft node the grammar forbids can never be accepted; rows below it are left
unmasked (never used).

llguidance was chosen over xgrammar and llama.cpp's GBNF sampler: it needs no other package (xgrammar pulls torch,
transformers and triton into the verifier image), builds its tokenizer straight from the GGUF vocabulary
(~1 s, once per engine), compiles a schema in about 1 ms and masks a tree row of the 152k-token vocabulary in
about 0.1 ms on this CPU (``python -m bench.structured``), with rollback for tree walks.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from tandem.core.messages import Constraint
from tandem.core.tree import DraftTree
from tandem.core.errors import TandemError


class ConstraintError(TandemError, ValueError):
    """A constraint that cannot be compiled (the message says why)."""


def grammar(c: Constraint) -> str:
    """The llguidance grammar of a constraint (raises ``ConstraintError`` for a schema that is not JSON)."""
    from llguidance import LLMatcher
    if c.json_schema:
        try:
            schema = json.loads(c.json_schema)
        except ValueError as e:
            raise ConstraintError(f"json_schema is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ConstraintError("json_schema must be a JSON object (a schema)")
    elif c.json_object:
        schema = {"type": "object"}
    else:
        raise ConstraintError("empty constraint: set json_schema or json_object")
    try:
        return LLMatcher.grammar_from_json_schema(schema)
    except ValueError as e:
        raise ConstraintError(f"json_schema: {e}") from None


def tokenizer(engine):
    """The engine's vocabulary as llguidance sees it, built once per engine (about a second)."""
    cached = getattr(engine, "_llg_tokenizer", None)
    if cached is not None:
        return cached
    model: Any = getattr(engine, "model", None)
    if hasattr(model, "vocab_handle"):  # llama.cpp: straight from the GGUF vocabulary
        import warnings

        from llguidance.llamacpp import lltokenizer_from_vocab
        with warnings.catch_warnings():  # it reads token attributes through a call llama-cpp-python deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            tok = lltokenizer_from_vocab(model.vocab_handle, n_vocab=engine.vocab_size)
    elif getattr(engine, "tokenizer", None) is not None:  # an HF tokenizer (torch engine)
        from llguidance.hf import from_tokenizer
        tok = from_tokenizer(engine.tokenizer, n_vocab=engine.vocab_size)
    else:
        raise ConstraintError(f"the {engine.name} engine has no tokenizer here: structured output needs one")
    engine._llg_tokenizer = tok
    return tok


class GrammarMask:
    """One session's grammar state at its committed position."""

    def __init__(self, engine, constraint: Constraint):
        from llguidance import LLMatcher
        self.vocab_size = engine.vocab_size
        self._is_eog = engine.is_eog
        self.matcher = LLMatcher(tokenizer(engine), grammar(constraint), log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"constraint does not compile: {self.matcher.get_error()}")
        self._words = (self.vocab_size + 31) // 32
        self._path: list[int] = []  # tokens consumed past the committed ones (path_mask)

    def _allowed(self) -> np.ndarray:
        from llguidance.numpy import fill_next_token_bitmask
        bits = np.zeros((1, self._words), dtype=np.int32)
        fill_next_token_bitmask(self.matcher, bits, 0)
        return np.unpackbits(bits[0].view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)

    def masks(self, tree: DraftTree) -> np.ndarray:
        """Allowed tokens for every row of a tree forward: row 0 after the committed tokens, row i + 1 after
        the path to node i. The matcher ends where it started. Rows below a forbidden or end-of-generation node
        stay all-allowed: they can never be used."""
        out = np.ones((len(tree) + 1, self.vocab_size), dtype=bool)

        def visit(node: int) -> None:
            out[node + 1] = self._allowed()
            for child in tree.children[node + 1]:
                token = tree.tokens[child]
                # an end-of-generation node ends the output: nothing below it is ever used, and a complete
                # grammar does not count it as a token (a rollback would then undo the token before it)
                if out[node + 1][token] and not self._is_eog(token) and self.matcher.consume_token(token):
                    visit(child)
                    self.matcher.rollback(1)

        visit(-1)
        return out

    def path_mask(self, path) -> np.ndarray | None:
        """Allowed tokens after the committed tokens plus ``path``; None when the path leaves the grammar (or
        passes an end-of-generation token): such a row is never used. Call ``rewind`` before committing."""
        path = list(path)
        keep = 0
        while keep < min(len(path), len(self._path)) and path[keep] == self._path[keep]:
            keep += 1
        if len(self._path) > keep:
            self.matcher.rollback(len(self._path) - keep)
            del self._path[keep:]
        for token in path[keep:]:
            # checked first: consuming a token the grammar forbids would put the matcher in its error state
            if self._is_eog(token) or self.matcher.validate_tokens([token]) != 1 or \
                    not self.matcher.consume_token(token):
                return None
            self._path.append(token)
        return self._allowed()

    def rewind(self) -> None:
        """Back to the committed tokens after ``path_mask``."""
        if self._path:
            self.matcher.rollback(len(self._path))
            self._path = []

    def apply(self, logits: np.ndarray, tree: DraftTree) -> np.ndarray:
        """The rows with forbidden tokens at -inf (a new array; the engine's stays untouched)."""
        return np.where(self.masks(tree), logits, -np.inf)

    def commit(self, tokens) -> None:
        """Advance over committed tokens (an end-of-generation token ends the output: not fed to the grammar)."""
        tokens = [t for t in tokens if not self._is_eog(t)]
        if tokens and not self.matcher.consume_tokens(tokens):
            raise ConstraintError(f"committed tokens the grammar does not allow: {self.matcher.get_error()}")
