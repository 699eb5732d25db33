"""VocabTrim maths and bookkeeping on literal data: K by held-out coverage, the live head learner, the calibration
corpus counting and merging, the quantized row tables heads are built from, and the execution-provider choice."""
from collections import Counter

import numpy as np
import pytest

from tandem.edge import vocabtrim
from tandem.edge.export.onnx_export import RowTable, save_table
from tandem.orchestrator import calibration

COUNTS = Counter({5: 10, 7: 3, 9: 3, 2: 1})  # ranking: 5, 7, 9, 2


@pytest.mark.parametrize("heldout,target,expected", [
    ([5, 5, 7, 2], 0.5, 1),  # two of four inside the top 1
    ([5, 5, 7, 2], 0.75, 2),
    ([5, 5, 7, 2], 1.0, 4),  # 2 is ranked last
    ([5, 42], 0.5, 1),
    ([5, 42], 1.0, None),  # 42 was never counted: no K reaches full coverage
    ([], 0.98, 1),
    ([9, 9, 9], 0.01, 3),  # ties broken by smaller id: 7 before 9
])
def test_k_for_coverage(heldout, target, expected):
    assert vocabtrim.k_for_coverage(COUNTS, heldout, target) == expected


def test_k_for_coverage_is_what_choose_then_covers():
    rng = np.random.default_rng(1)
    counts = Counter(rng.zipf(1.3, 20000).tolist())
    heldout = [t for t in rng.zipf(1.3, 3000).tolist() if t in counts]
    k = vocabtrim.k_for_coverage(counts, heldout, 0.9)
    assert vocabtrim.coverage(vocabtrim.choose(counts, k=k), heldout) >= 0.9
    assert vocabtrim.coverage(vocabtrim.choose(counts, k=k - 1), heldout) < 0.9  # and it is the smallest
    with pytest.raises(ValueError, match="coverage target"):
        vocabtrim.k_for_coverage(counts, heldout, 0)


def test_live_vocab_refreshes_only_when_traffic_leaves_the_head():
    ids = vocabtrim.choose(COUNTS, k=2, always=(99,))  # [5, 7, 99]
    live = vocabtrim.LiveVocab(COUNTS, ids, target=0.9, window=8, live_weight=4.0, always=(99,))
    live.observe([5, 7, 5, 7, 5, 7, 5])
    assert live.miss_rate == 0 and not live.due
    live.observe([11])  # 1 of 8 outside: 12.5 % > 10 %, and the window is full
    assert live.miss_rate == pytest.approx(1 / 8) and live.due
    live.observe([11, 11, 11])  # the window slides: 4 of the last 8 outside
    assert live.miss_rate == pytest.approx(4 / 8)
    new = live.vocab().tolist()
    assert new == [5, 11, 99]  # 11's 4 x 4 live beats 7's 3 + 3 x 4; the size stays
    live.set_ids(np.array(new))
    assert live.miss_rate == 0 and not live.due  # a new head starts a new window


def test_live_vocab_keeps_the_head_size_and_fills_unseen_slots():
    live = vocabtrim.LiveVocab(Counter({3: 5}), np.array([1, 3, 4, 8]), n_vocab=10)
    assert live.vocab().tolist() == [0, 1, 2, 3]  # 3 first, then the lowest unseen ids (BPE merge order)


def test_count_tokens_and_merge():
    texts = ["abca", "bb", "c"]
    counts = calibration.count_tokens(lambda s: [ord(ch) for ch in s], texts, chunk_chars=3)
    # chunks joined by blank lines: "abca" | "bb\n\nc" (newlines count too)
    assert counts == Counter({97: 2, 98: 3, 99: 2, 10: 2})
    merged = calibration.merge(Counter({1: 60, 2: 20}), Counter({3: 5}), target_share=0.2)
    assert sum(merged.values()) == pytest.approx(100) and merged[3] == pytest.approx(20)
    assert calibration.merge(Counter({1: 3}), Counter(), 0.5) == Counter({1: 3.0})
    with pytest.raises(ValueError):
        calibration.merge(Counter(), Counter(), 1.0)


def test_stdlib_corpus_has_no_tests_and_respects_its_budget():
    texts = calibration.stdlib_sources(max_bytes=300_000)
    assert texts and sum(map(len, texts)) <= 300_000
    assert not any("import unittest" in t and "class Test" in t for t in texts)


@pytest.mark.parametrize("bits,tol", [(None, 0.0), (8, 0.5 / 127), (4, 0.5 / 7 + 1e-3)])
def test_row_tables_round_trip_within_half_a_step(tmp_path, bits, tol):
    w = np.random.default_rng(2).normal(size=(40, 64)).astype(np.float32)
    w[3] = 0.0  # an all-zero row (or block) must not divide by zero
    save_table(tmp_path, "t", w, bits)
    table = RowTable(tmp_path, "t")
    full = table.rows(None)
    assert len(table) == 40 and full.shape == w.shape and full.dtype == np.float32
    np.testing.assert_array_equal(table.rows([7, 3, 7]), full[[7, 3, 7]])  # a lookup is the same rows
    # error per element at most half a quantization step of its row (8 bits) or block of 32 (4 bits)
    if bits == 4:
        step = np.abs(w.reshape(40, 2, 32)).max(axis=2, keepdims=True) * np.ones((1, 1, 32))
        step = step.reshape(40, 64)
    else:
        step = np.abs(w).max(axis=1, keepdims=True) * np.ones((1, 64))
    assert np.all(np.abs(full - w) <= step * tol + 1e-6)
    assert not full[3].any()


@pytest.mark.parametrize("system,machine,quant,available,expected", [
    ("Linux", "x86_64", "int4", ["CPUExecutionProvider"], ["CPUExecutionProvider"]),
    ("Android", "aarch64", "int4", ["XnnpackExecutionProvider", "NnapiExecutionProvider", "CPUExecutionProvider"],
     ["XnnpackExecutionProvider", "CPUExecutionProvider"]),
    ("Android", "aarch64", "int4", ["CPUExecutionProvider"], ["CPUExecutionProvider"]),  # not in this build
    ("Darwin", "arm64", "int4", ["CoreMLExecutionProvider", "CPUExecutionProvider"], ["CPUExecutionProvider"]),
    ("Darwin", "arm64", "fp32", ["CoreMLExecutionProvider", "CPUExecutionProvider"],
     ["CoreMLExecutionProvider", "CPUExecutionProvider"]),
    ("Linux", "aarch64", "int8", ["XnnpackExecutionProvider", "CPUExecutionProvider"],
     ["XnnpackExecutionProvider", "CPUExecutionProvider"]),
    ("Windows", "AMD64", "int4", ["DmlExecutionProvider", "CPUExecutionProvider"], ["CPUExecutionProvider"]),
])
def test_execution_providers_by_platform(system, machine, quant, available, expected):
    pytest.importorskip("onnxruntime")
    from tandem.edge.onnx_drafter import providers_for
    assert providers_for(system, machine, quant, available) == expected


def test_k_by_coverage_cross_validates_over_prompts():
    corpus = Counter({1: 100, 2: 50, 3: 10})
    # prompt outputs alternate between the folds: [0, 2] -> fold A, [1] -> fold B
    outputs = [[1, 1, 7], [1, 2, 2, 7], [3, 1]]
    # fold A = [1, 1, 7, 3, 1], ranked by corpus + fold B: 1, 2, 7 (13.3), 3 (10) -> all of A needs K = 4
    # fold B = [1, 2, 2, 7], ranked by corpus + fold A: 1, 2, 3 (20.7), 7 (10.7) -> all of B needs K = 4
    assert calibration.k_by_coverage(corpus, outputs, 1.0) == 4
    # half: A needs 3 of 5 inside (1 x 3: K = 1), B 2 of 4 (1 and a 2: K = 2); the larger
    assert calibration.k_by_coverage(corpus, outputs, 0.5) == 2
    assert calibration.k_by_coverage(corpus, [[9], [1]], 1.0) is None  # 9 is in no ranking but its own fold's
