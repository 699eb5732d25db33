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
