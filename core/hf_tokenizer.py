"""A Hugging Face ``tokenizer.json`` as the edge's ``Tokenizer``: what a client needs of a target served by the
torch engine from a Hugging Face directory to translate its drafts (``edge.translate``), loaded with the
``tokenizers`` library.

Token texts and fingerprints follow the torch engine's (``cloud.engines.torch_engine``): the texts of the tokenizer's
ids, then empty texts up to the model's vocabulary size (embedding padding). A token renders as the bytes it stands
for: byte-level BPE (GPT-2, Llama 3, Qwen) maps each character of a token back to its byte; SentencePiece-style
vocabularies (Llama 2, Mistral) write a space as U+2581 and bytes as ``<0xNN>``. Special tokens render as nothing
unless asked for, as llama.cpp's do.
"""

from __future__ import annotations

from typing import Sequence

from .vocab import fingerprint

FORMAT = "hf-tokenizer-json"


def _gpt2_bytes() -> dict[str, int]:
    """The character byte-level BPE writes for each byte (GPT-2's table: printable bytes as themselves, the rest
    shifted past U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class HfTokenizer:
    def __init__(self, tokenizer_json: bytes | str, vocab_size: int = 0):
        """``vocab_size``: the model's (its embedding rows), when it pads past the tokenizer's ids."""
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(tokenizer_json.decode() if isinstance(tokenizer_json, bytes) else tokenizer_json)
        size = self._tok.get_vocab_size(with_added_tokens=True)
        self.n_vocab = max(size, vocab_size)
        self._texts = [self._tok.id_to_token(t) or "" for t in range(size)] + [""] * (self.n_vocab - size)
        self._special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        self._byte_level = "ByteLevel" in repr(self._tok.decoder) or "ByteLevel" in repr(self._tok.pre_tokenizer)
        self._bytes = _gpt2_bytes()
        self._fingerprints: dict[int, str] = {}

    @property
    def vocab_fingerprint(self) -> str:
        return self.vocab_fingerprint_of(self.n_vocab)

    def vocab_fingerprint_of(self, n: int) -> str:
        if not 0 < n <= self.n_vocab:
            raise ValueError(f"a vocabulary prefix of {n} ids is outside [1, {self.n_vocab}]")
        if n not in self._fingerprints:
            self._fingerprints[n] = fingerprint(t.encode("utf-8") for t in self._texts[:n])
        return self._fingerprints[n]

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """The ids of ``text`` (no BOS). Added special tokens spelled in the text are matched either way: the
        ``tokenizers`` library has no switch for it, and drafted text does not spell them."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def piece(self, token: int, special: bool = False) -> bytes:
        text = self._texts[token] if 0 <= token < self.n_vocab else ""
        if not text or text == f"[PAD{token}]":  # padding (core.vocab) renders as nothing
            return b""
        if text in self._special:
            return text.encode("utf-8") if special else b""
        if self._byte_level:
            if all(c in self._bytes for c in text):
                return bytes(self._bytes[c] for c in text)
            return text.encode("utf-8")  # an added (non-special) token, stored as plain text
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:5], 16)])
        return text.replace("\u2581", " ").encode("utf-8")

    def is_eog(self, token: int) -> bool:
        return False  # the verifier ends generation; the edge only renders

    def chat_prompt(self, messages: Sequence[dict]) -> str:
        raise NotImplementedError("render conversations with the verifier's chat template (EdgeClient does)")
