"""Committed tokens to streamed text: incremental UTF-8 and stop strings.

A token's piece may end inside a multi-byte character, and a stop string may span several tokens, so text is
released only when it can no longer change: incomplete UTF-8 bytes and any tail that could still grow into a stop
string are held back until the next piece decides them.

Stop strings are matched as a stream: each keeps a Knuth-Morris-Pratt automaton whose state is the longest prefix
of it that the text ends with, advanced one character at a time. Matching costs O(1) amortised per generated
character whatever the stop strings' length (searching the text at every token costs O(L^2) per token for a
string of length L: 60 ms a token at 60k characters), and the state is also exactly how much text must be held.
"""
from __future__ import annotations

import codecs
from typing import Sequence

MAX_STOP_CHARS = 1024  # per stop string: longer ones are refused (a request field we cannot honour sensibly)


def _failure(s: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper prefix of s[:i+1] that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class TextStream:
    def __init__(self, stop: Sequence[str] = ()):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stop):
            raise ValueError(f"stop strings are limited to {MAX_STOP_CHARS} characters")
        self.stop = tuple(stop)
        self.stopped = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._fail = [_failure(s) for s in self.stop]
        self._state = [0] * len(self.stop)
        self._held = ""

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now final (possibly empty)."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(piece)
        start = len(self._held)  # characters before this were already fed to the automata
        for i in range(start, len(text)):
            ch = text[i]
            for j, s in enumerate(self.stop):
                k = self._state[j]
                while k and s[k] != ch:
                    k = self._fail[j][k - 1]
                if s[k] == ch:
                    k += 1
                if k == len(s):  # a stop string ends here: release what precedes it, nothing after
                    self.stopped = True
                    self._held = ""
                    return text[: i + 1 - len(s)]
                self._state[j] = k
        hold = max(self._state, default=0)  # the longest stop-string prefix the text currently ends with
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def finish(self) -> str:
        """End of generation: release what was held (a partial stop string that never completed is real text)."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return text
