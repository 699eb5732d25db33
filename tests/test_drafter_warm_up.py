"""load_drafter warms the engine up at load: one small draft on a short text, then an empty history, so the first
request's first draft is not the engine's cold one and no warm-up text leaks into a session."""
import pytest

from tandem.core.tree import TreeShape
from tandem.edge import drafter as drafters


class _Tokenizer:
    def __init__(self, ids):
        self.ids = ids

    def tokenize(self, text, special=True):
        return list(self.ids)


class _Recorder:
    def __init__(self, ids):
        self.tokenizer, self.calls, self.history = _Tokenizer(ids), [], None

    def start(self, prompt):
        self.calls.append(("start", tuple(prompt)))
        self.history = list(prompt)

    def draft(self, shape):
        self.calls.append(("draft", shape))


@pytest.fixture
def registry(monkeypatch):
    made = []

    def factory(ids=(5, 6, 7), **kw):
        made.append(_Recorder(ids))
        return made[-1]
    monkeypatch.setitem(drafters.DRAFTERS, "recorder", factory)
    return made


def test_a_loaded_drafter_has_drafted_once_and_holds_no_history(registry):
    d = drafters.load_drafter("recorder")
    assert d.calls == [("start", (5, 6, 7)), ("draft", TreeShape(1, 2, 2)), ("start", ())]
    assert d.history == []


def test_warm_up_can_be_skipped_and_an_empty_tokenization_drafts_nothing(registry):
    assert drafters.load_drafter("recorder", warm=False).calls == []
    assert drafters.load_drafter("recorder", ids=()).calls == [("start", ())]
