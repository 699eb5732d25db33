"""Tool calls in generated text: the Hermes / Qwen2.5 format, ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``, which the target's chat template asks for when a request carries ``tools``.

``ToolCallStream`` splits streamed text into content and complete calls as tokens commit: text that could still be
the start of ``<tool_call>`` is held back (as stop strings are), a block is released as one call when it closes.
A block that is not a JSON object with a string ``name`` stays content, as the model wrote it.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI carries it
    id: str

    def wire(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], arguments, f"call_{uuid.uuid4().hex[:24]}")


class ToolCallStream:
    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> list[str | ToolCall]:
        """Add generated text; returns what is now final: content strings and complete calls, in order."""
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                block, self._buf, self._in_call = self._buf[:end], self._buf[end + len(CLOSE):], False
                call = _call(block.strip())
                if call is None:
                    out.append(OPEN + block + CLOSE)
                else:
                    self.calls.append(call)
                    out.append(call)
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                if start:
                    out.append(self._buf[:start])
                self._buf, self._in_call = self._buf[start + len(OPEN):], True
                continue
            # hold back a tail that may still grow into OPEN
            hold = next((k for k in range(min(len(OPEN) - 1, len(self._buf)), 0, -1)
                         if OPEN.startswith(self._buf[-k:])), 0)
            if len(self._buf) > hold:
                out.append(self._buf[: len(self._buf) - hold])
                self._buf = self._buf[len(self._buf) - hold:]
            return out

    def finish(self) -> list[str | ToolCall]:
        """End of generation: an unterminated block or a held tail is content."""
        rest = (OPEN if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return [rest] if rest else []


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer: its content (outside the calls, stripped) and its calls."""
    s = ToolCallStream()
    parts = s.push(text) + s.finish()
    return "".join(p for p in parts if isinstance(p, str)).strip(), s.calls
