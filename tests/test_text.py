import pytest

from edge.text import TextStream


@pytest.mark.parametrize("pieces,stop,expected_chunks,stopped", [
    ([b"Hel", b"lo", b" world"], [], ["Hel", "lo", " world"], False),
    # a 3-byte character split over two tokens is released whole, once
    ([b"a\xe2\x82", b"\xac b"], [], ["a", "\u20ac b"], False),
    # stop string inside one piece: text before it only
    ([b"x = 1\n```", b"more"], ["```"], ["x = 1\n", ""], True),
    # stop string across pieces: the possible prefix is held, then dropped
    ([b"done`", b"`", b"` tail"], ["```"], ["done", "", ""], True),
    # a held prefix that does not complete is released
    ([b"a`", b"b"], ["```"], ["a", "`b"], False),
    # earliest of several stop strings wins
    ([b"one END two STOP"], ["STOP", "END"], ["one "], True),
])
def test_stream(pieces, stop, expected_chunks, stopped):
    s = TextStream(stop)
    chunks = [s.push(p) for p in pieces]
    assert chunks == expected_chunks
    assert s.stopped is stopped


def test_finish_releases_held_text_and_push_after_stop_is_empty():
    s = TextStream(["<|end|>"])
    assert s.push(b"ok <|en") == "ok "
    assert s.finish() == "<|en"
    t = TextStream(["!"])
    assert t.push(b"hi!") == "hi"
    assert t.push(b"more") == "" and t.finish() == ""


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        TextStream([""])
