"""A drafter for a target with another tokenizer: drafts in its own ids, speaks the target's.

``TranslatingDrafter`` wraps a drafter and presents the ``Drafter`` protocol in the target's ids (its tokenizer is
the target's, fetched from the verifier: ``EdgeClient.target_tokenizer``), so the round loop, the wire and the
verifier are unchanged: the verifier only ever verifies target ids, and the output is exactly the target's.

Text is the common ground. The committed target tokens are rendered (special tokens spelled out, as a prompt
spells them) and re-tokenised into the drafter's ids; a draft is the drafter's greedy chain, rendered and
re-tokenised into the target's ids. Two boundaries need care:

- Where committed text meets the drafter's ids: a new token can merge with the text before it (" Hel" + "lo"),
  so the last ``RETOKENISE`` drafter tokens are re-tokenised with every commit, from a point that is also a UTF-8
  character boundary (a byte-level token can end inside a character; so can the committed text itself, whose
  incomplete tail waits for the next token). The drafter keeps the KV of the ids that did not change (``start``
  keeps a common prefix).
- Where committed text meets the drafted text: the draft is tokenised together with the last committed tokens
  (``ANCHOR``) and sent only if that re-tokenisation reproduces them, so the tokens after are what the target's
  tokenizer makes of the continuation; otherwise the drafted text is tokenised alone. Only whole, stable target
  tokens are sent: those the text spells with and without its last drafter token, less the last one (more text
  could still grow it into a longer token).

Text in the middle of the conversation is tokenised as a continuation (``Continuation``): a SentencePiece
tokenizer with a dummy prefix (Llama 2, Mistral) would otherwise write a space before every piece of text it is
given, a space the conversation does not have.

Only chains are drafted: the drafter's alternatives would be trees in its own ids, whose branches re-tokenise into
paths of different lengths. Acceptance is what the drafter's text earns; correctness never depends on it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tandem.core.cache import cache_dir
from tandem.core.tree import DraftTree, TreeShape, common_prefix
from tandem.core.vocab import is_fingerprint

from .drafter import Drafter
from .drafting import BuiltTree

RETOKENISE = 2  # drafter ids re-tokenised at every commit: a new token merges with at most the one before it
ANCHOR = 4  # committed target tokens re-tokenised with a draft, to find where the draft's tokens start


SUFFIX = {"gguf-vocab": ".gguf", "hf-tokenizer-json": ".json"}  # the tokenizer file formats a verifier sends


def tokenizer_cache(fingerprint: str, kind: str = "gguf-vocab") -> Path:
    """Where the edge keeps a target's tokenizer, fetched once from a verifier publishing ``fingerprint``. The
    fingerprint comes from the verifier: anything but a sha256 in lowercase hex is refused before it names a file."""
    if not is_fingerprint(fingerprint):
        raise ValueError(f"not a vocabulary fingerprint (64 lowercase hex digits): {fingerprint[:80]!r}")
    if kind not in SUFFIX:
        raise ValueError(f"not a tokenizer file format: {kind[:40]!r} (one of {', '.join(SUFFIX)})")
    return cache_dir() / "edge" / "target-tokenizers" / f"{fingerprint[:32]}{SUFFIX[kind]}"


def load_tokenizer(path: Path, vocab_size: int = 0):
    """A target tokenizer file as the edge's ``Tokenizer`` (its format by its suffix)."""
    if path.suffix == SUFFIX["hf-tokenizer-json"]:
        from tandem.core.hf_tokenizer import HfTokenizer
        return HfTokenizer(path.read_bytes(), vocab_size)
    from tandem.core.llama_runtime import LlamaModel
    return LlamaModel(path, vocab_only=True)


def _complete_utf8(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII): does its character fit in what follows it?
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return len(data) if back >= need else len(data) - back
    return len(data)


SENTINEL = "\n"  # what a continuation is tokenised after: SentencePiece vocabularies leave it to a byte token


class Continuation:
    """``tokenizer.tokenize`` for text that continues other text. A tokenizer that writes a space before the text
    it is given (SentencePiece's dummy prefix: llama.cpp's ``add_space_prefix``, Hugging Face's ``Prepend``) is
    given ``SENTINEL`` first, whose own tokens are then taken off; a newline merges with nothing in those
    vocabularies, so what follows it is tokenised as it is. (llama.cpp also writes that space after each special
    token it parses: ``ends`` allows for it.)"""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        probe = b"".join(tokenizer.piece(t) for t in tokenizer.tokenize("a", special=False))
        self._head = tokenizer.tokenize(SENTINEL, special=False) if probe == b" a" else []

    def __call__(self, text: str, special: bool) -> list[int]:
        if self._head and text:
            ids = self.tokenizer.tokenize(SENTINEL + text, special=special)
            if ids[:len(self._head)] == self._head:
                return ids[len(self._head):]
        return self.tokenizer.tokenize(text, special=special)

    def ends(self, text: bytes, start: int, ids: Sequence[int]) -> list[int]:
        """Where in ``text`` each of ``ids`` (its tokens from ``start``) ends; a piece that spells one space more
        than the text holds there is a space the tokenizer added (after a special token) and covers none."""
        out, at = [], start
        for t in ids:
            piece = self.tokenizer.piece(t, special=True)
            if piece[:1] == b" " and not text.startswith(piece, at) and text.startswith(piece[1:], at):
                piece = piece[1:]
            at += len(piece)
            out.append(at)
        return out


class TranslatingDrafter:
    def __init__(self, inner: Drafter, target_tokenizer):
        """``target_tokenizer``: the target's vocabulary (``core.llama_runtime.LlamaModel``, vocabulary only)."""
        self.inner = inner
        self.tokenizer = target_tokenizer
        self.name = f"{inner.name} (translated)"
        self.n_ctx = inner.n_ctx
        self._own = inner.tokenizer
        self._own_text = Continuation(inner.tokenizer)
        self._target_text = Continuation(target_tokenizer)
        self._text = b""  # the committed target tokens rendered, special tokens spelled
        self._ids: list[int] = []  # the drafter's ids of a prefix of ``_text``
        self._ends: list[int] = []  # where in ``_text`` each of them ends
        self._committed: list[int] = []

    # -- committed history ------------------------------------------------------------------------------------------
    def _render(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self.tokenizer.piece(t, special=True) for t in tokens)

    def _sync(self) -> None:
        """Re-tokenise the committed text's tail into the drafter's ids and hand the drafter its new history."""
        keep = max(0, len(self._ids) - RETOKENISE)
        while keep and self._ends[keep - 1] < len(self._text) and self._text[self._ends[keep - 1]] & 0xC0 == 0x80:
            keep -= 1  # the re-tokenised text would start inside a character: back up a token
        start = self._ends[keep - 1] if keep else 0
        tail = self._text[start:_complete_utf8(self._text)]
        new = self._own_text(tail.decode("utf-8", errors="replace"), special=True) if tail else []
        self._ids = self._ids[:keep] + new
        self._ends = self._ends[:keep] + self._own_text.ends(self._text, start, new)
        self.inner.start(self._ids)

    def start(self, prompt: Sequence[int]) -> None:
        self._committed = list(prompt)
        self._text = self._render(prompt)
        self._ids, self._ends = [], []
        self._sync()

    def commit(self, built: BuiltTree, accepted: Sequence[int], tokens: Sequence[int]) -> None:
        if not tokens:
            return
        self._committed += tokens
        self._text += self._render(tokens)
        self._sync()

    def pending(self) -> int:
        return self.inner.pending()

    def catch_up(self) -> None:
        self.inner.catch_up()

    # -- drafts -----------------------------------------------------------------------------------------------------
    def draft(self, shape: TreeShape) -> BuiltTree:
        depth = min(shape.n, shape.d)
        # two more: what the last drafter token spells is held back (see ``translate``)
        built = self.inner.draft(TreeShape(1, depth + 2, depth + 2))
        if built.full:
            return built
        chain = []
        for t in built.tree.tokens:  # a chain: node i is the child of node i - 1
            if self._own.is_eog(t):
                break
            chain.append(t)
        tokens = self.translate(chain)[:depth]
        return BuiltTree(DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1))), (), ())

    def translate(self, drafted: Sequence[int]) -> list[int]:
        """The target tokens that the drafter's ``drafted`` continuation of the committed text spells and that
        more text would not change: those it spells with and without its last drafter token, less the last (a
        token that ends where the text ends could still grow)."""
        full = self._spell(drafted)[:-1]
        return full[:common_prefix(full, self._spell(drafted[:-1]))]

    def _spell(self, drafted: Sequence[int]) -> list[int]:
        """The target's tokens for the drafter's ``drafted`` after the committed text (module docstring)."""
        text = b"".join(self._own.piece(t) for t in drafted)
        text = text[:_complete_utf8(text)]
        try:
            drafted_text = text.decode("utf-8")
        except UnicodeDecodeError as e:  # bytes that never form a character: the draft ends before them
            drafted_text = text[:e.start].decode("utf-8")
        if not drafted_text:
            return []
        anchor = self._committed[-ANCHOR:]
        anchor_bytes = self._render(anchor)
        # the drafter reads the committed text up to its last whole character: the bytes committed past it (a
        # character the target's tokens split) begin the draft too, and are the anchor's already
        data = drafted_text.encode("utf-8")
        pending = self._text[_complete_utf8(self._text):]
        if pending:
            if not data.startswith(pending):
                return []  # the draft goes another way than the committed bytes
            data = data[len(pending):]
        if anchor:
            try:
                both = self._target_text((anchor_bytes + data).decode("utf-8"), special=True)
            except UnicodeDecodeError:  # the anchor starts inside a character
                both = []
            if both[:len(anchor)] == anchor:
                return both[len(anchor):]
        return [] if pending else self._target_text(drafted_text, special=False)
