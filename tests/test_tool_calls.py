"""Tool calls in generated text (Hermes / Qwen2.5 format): parsing whole answers and streams split anywhere."""
import json

import pytest

from tandem.orchestrator.gateway.tool_calls import ToolCall, ToolCallStream, parse

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("text, content, calls", [
    ("no calls here", "no calls here", []),
    (CALL, "", [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + CALL, "Let me check.", [("get_weather", {"city": "Paris"})]),
    (CALL + "\n" + CALL.replace("Paris", "Oslo"), "", [("get_weather", {"city": "Paris"}),
                                                       ("get_weather", {"city": "Oslo"})]),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "", [("f", {"a": 1})]),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),  # stays the model's text
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ("<tool_call>\n{\"name\": \"f\"", '<tool_call>\n{"name": "f"', []),  # cut off: content
    ("a < b and <tool", "a < b and <tool", []),  # a held prefix that never completed
])
def test_parse_table(text, content, calls):
    got_content, got = parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("text", ["Let me check.\n" + CALL + " done", CALL + CALL, "a <tool_cal b" + CALL])
def test_a_stream_split_anywhere_gives_the_same_answer(text):
    whole_content, whole_calls = parse(text)
    for cut in range(len(text) + 1):
        for step in (1, 3):
            s = ToolCallStream()
            pieces = [text[:cut]] + [text[i:i + step] for i in range(cut, len(text), step)]
            parts = [p for piece in pieces for p in s.push(piece)] + s.finish()
            content = "".join(p for p in parts if isinstance(p, str))
            calls = [p for p in parts if isinstance(p, ToolCall)]
            assert content.strip() == whole_content
            assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
            assert not any(isinstance(p, str) and "<tool_call>" in p for p in parts) or "not" in text
