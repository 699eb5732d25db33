import pytest

from tandem.edge.text import TextStream


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


@pytest.mark.parametrize("pieces,stop,chunks,stopped,tail", [
    ([b"aab", b"ab"], ["abab"], ["a", ""], True, ""),  # found through a failure link of "abab"
    ([b"ab", b"aab"], ["aab"], ["ab", ""], True, ""),  # "ab" cannot grow into "aab": released at once
    ([b"xa", b"aaa"], ["aaab"], ["x", "a"], False, "aaa"),  # the hold is the longest prefix the text ends with
])
def test_overlapping_prefixes(pieces, stop, chunks, stopped, tail):
    s = TextStream(stop)
    assert [s.push(p) for p in pieces] == chunks
    assert s.stopped is stopped and s.finish() == tail


def test_long_stop_strings_cost_linear_time_and_are_capped():
    import time
    s = TextStream(["x" * 1000 + "y"])
    t0 = time.perf_counter()
    out = "".join(s.push(b"x" * 4) for _ in range(2000))  # 8000 characters, each could start the stop string
    assert time.perf_counter() - t0 < 1.0 and len(out) == 8000 - 1000 and not s.stopped
    with pytest.raises(ValueError, match="limited to 1024"):
        TextStream(["z" * 1025])
