"""Committed tokens to streamed text: incremental UTF-8 and stop strings.

A token's piece may end inside a multi-byte character, and a stop string may span several tokens, so text is
released only when it can no longer change: incomplete UTF-8 bytes and any tail that could still grow into a stop
string are held back until the next piece decides them.
"""
from __future__ import annotations

import codecs
from typing import Sequence


class TextStream:
    def __init__(self, stop: Sequence[str] = ()):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self.stopped = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now final (possibly empty)."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(piece)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return text[: min(hits)]
        hold = max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def finish(self) -> str:
        """End of generation: release what was held (a partial stop string that never completed is real text)."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return text
