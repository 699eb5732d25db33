"""History-dependent logit shaping (core/penalties.py): table tests on literal rows, each tree row shaped by its own
path, and the verifier session accepting along those rows."""
import numpy as np
import pytest

from tandem.cloud.session import DraftRequest, Limits, open_session
from tandem.core.penalties import History
from tandem.core.sampling import Sampling, SamplingError
from tandem.core.tree import DraftTree

from scripted import ScriptedEngine

ROW = np.array([2.0, -1.0, 0.5, 3.0, 0.0])


@pytest.mark.parametrize("prompt, prior, output, path, sampling, expected", [
    # presence/frequency: output tokens only (the prompt's 1 is not output); 3 appears twice in the output
    ((1,), 0, (3, 3, 0), (), Sampling(presence_penalty=0.5), [1.5, -1.0, 0.5, 2.5, 0.0]),
    ((1,), 0, (3, 3, 0), (), Sampling(frequency_penalty=0.5), [1.5, -1.0, 0.5, 2.0, 0.0]),
    ((1,), 0, (3, 3), (), Sampling(presence_penalty=1.0, frequency_penalty=0.5), [2.0, -1.0, 0.5, 1.0, 0.0]),
    # the tree path counts as output too
    ((1,), 0, (3,), (3, 2), Sampling(frequency_penalty=1.0), [2.0, -1.0, -0.5, 1.0, 0.0]),
    # a resume: the prompt's last prior tokens are earlier output
    ((1, 3), 1, (), (), Sampling(presence_penalty=1.0), [2.0, -1.0, 0.5, 2.0, 0.0]),
    # repetition: prompt and output, positive logits divided, negative multiplied
    ((1,), 0, (0,), (3,), Sampling(repetition_penalty=2.0), [1.0, -2.0, 0.5, 1.5, 0.0]),
    # logit bias, after the penalties
    ((1,), 0, (0,), (), Sampling(presence_penalty=1.0, logit_bias=((0, -100.0), (4, 5.0))),
     [-99.0, -1.0, 0.5, 3.0, 5.0]),
])
def test_shape_table(prompt, prior, output, path, sampling, expected):
    h = History(prompt, prior)
    h.extend(output)
    assert h.shape(ROW, sampling, path).tolist() == pytest.approx(expected)
    assert ROW.tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]  # the engine's row is never modified


def test_each_tree_row_is_shaped_by_its_own_path():
    tree = DraftTree(tokens=(3, 0, 3), parents=(-1, -1, 0))  # root -> 3 -> 3, and root -> 0
    rows = History((1,)).shape_tree(np.tile(ROW, (4, 1)), tree, Sampling(frequency_penalty=1.0))
    assert rows[0].tolist() == ROW.tolist()  # the root: nothing generated yet
    assert rows[1][3] == 2.0 and rows[2][0] == 1.0 and rows[3][3] == 1.0  # path (3,), (0,), (3, 3)


@pytest.mark.parametrize("bad, field", [
    (Sampling(presence_penalty=2.5), "presence_penalty"), (Sampling(frequency_penalty=float("nan")), "frequency"),
    (Sampling(repetition_penalty=0.0), "repetition_penalty"), (Sampling(logit_bias=((3, 101.0),)), "logit_bias"),
    (Sampling(logit_bias=((99, 1.0),)), "outside the vocabulary"),
])
def test_values_that_cannot_be_honoured(bad, field):
    with pytest.raises(SamplingError, match=field):
        bad.check(vocab_size=50)


def test_the_session_accepts_along_shaped_rows():
    """A target that always prefers token 7 (logit 10, every other 0), biased down to 1: the first 7 of a chain is
    accepted (nothing generated yet), the second rejected (its path already holds a 7: 1 - 2 - 2 < 0), in the same
    forward; the next forward's root row sees the committed tokens too."""
    eng = ScriptedEngine(lambda t: 7)
    s = open_session(eng, [1, 2, 3], Sampling(presence_penalty=2.0, frequency_penalty=2.0,
                                              logit_bias=((7, -9.0),)), Limits(20, 8, 4), Limits(0, 16, 8))
    v = s.verify(DraftRequest(3, DraftTree.chain([7, 7, 7]), 1))
    assert v.accepted == (0,) and v.bonus == 0 and s.committed == [1, 2, 3, 7, 0]  # 0: the first of the ties
    v = s.verify(DraftRequest(5, DraftTree.chain([7]), 2))
    assert v.accepted == () and v.bonus == 1  # the committed 7 and 0 are penalised now: 1 is the best left
    plain = open_session(eng, [1, 2, 3], Sampling(), Limits(20, 8, 4), Limits(0, 16, 8))
    assert plain.verify(DraftRequest(3, DraftTree.chain([7, 7, 7]), 1)).accepted == (0, 1, 2)


class WideEngine(ScriptedEngine):
    """A scripted target over 2,048 ids (room for a 1,024-entry logit bias)."""
    vocab_size, max_tree_nodes = 2048, 64

    def forward_tree(self, seq, root, tree):
        rows = np.zeros((len(tree) + 1, self.vocab_size), dtype=np.float32)
        for r, tok in enumerate((root, *tree.tokens)):
            rows[r, self.nxt(tok)] = 10.0
        seq["pending"] = (root, tree)
        return rows


def test_only_the_rows_the_acceptance_walk_reads_are_shaped(monkeypatch):
    """A 64-node tree (8 levels of 8 siblings) under a 1,024-entry logit bias: the walk reads one row per level it
    reaches, so at most depth + 1 rows are shaped (every row used to be, inside everyone's batch)."""
    shaped = []
    real = History.shape
    monkeypatch.setattr(History, "shape", lambda self, row, sampling, path=(): shaped.append(path) or real(
        self, row, sampling, path))
    eng = WideEngine(lambda t: t + 1)
    bias = tuple((t, 0.5) for t in range(1000, 2024))
    s = open_session(eng, [1, 2, 3], Sampling(logit_bias=bias), Limits(50, 64, 8), Limits(0, 64, 8))
    tokens, parents = [], []
    for level in range(8):  # the target's token first at every level, then 7 siblings it rejects
        first = len(tokens)
        tokens += [4 + level] + [500 + 8 * level + j for j in range(7)]
        parents += [first - 8 if level else -1] * 8
    v = s.verify(DraftRequest(3, DraftTree(tuple(tokens), tuple(parents)), 1))
    assert len(v.accepted) == 8 and len(shaped) <= 8 + 1
    assert [tuple(p) for p in shaped] == [tuple(range(4, 4 + d)) for d in range(9)]  # root, then each path


@pytest.mark.parametrize("seed", range(40))
def test_shaping_on_the_walk_accepts_what_shaping_every_row_accepts(seed):
    """Random trees and penalties, greedy and sampled: the lazy rows give the very acceptance of the eager ones."""
    from tandem.cloud.acceptance import accept
    from tandem.cloud.shaping import ShapedRows
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 24))
    parents = tuple(int(rng.integers(-1, i)) for i in range(n))
    tokens: list[int] = []
    for i, p in enumerate(parents):  # distinct siblings (at most 24 children: there are 24 ids)
        taken = {tokens[j] for j in range(i) if parents[j] == p}
        tokens.append(int(rng.choice([t for t in range(24) if t not in taken])))
    tree = DraftTree(tuple(tokens), parents)
    logits = rng.normal(0, 2, size=(n + 1, 24))
    logits[:, :4] += 3.0  # a few likely ids, so walks go deep
    sampling = Sampling(temperature=float(rng.choice([0.0, 0.8])), presence_penalty=float(rng.uniform(-1, 1)),
                        frequency_penalty=float(rng.uniform(-1, 1)), repetition_penalty=float(rng.uniform(0.5, 2)),
                        logit_bias=((int(rng.integers(24)), float(rng.uniform(-3, 3))),))
    history = History((1, 2, 3), 1)
    history.extend([int(t) for t in rng.integers(0, 4, size=3)])
    u = lambda d: float(np.random.default_rng([seed, d]).random())  # noqa: E731
    eager = accept(tree, history.shape_tree(logits, tree, sampling), sampling, u)
    rows = ShapedRows(logits, tree, sampling, history, None)
    assert accept(tree, rows, sampling, u) == eager
    assert rows.shaped == len(eager.accepted) + 1
