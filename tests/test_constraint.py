"""Structured output on the verifier (cloud/constraint.py): grammar masks over the real target vocabulary, tree
rows masked along their own paths, resumes, and greedy output token-identical to constrained target-only decoding
and valid against its schema, through the SDK and the REST endpoint."""
import json

import pytest

from tandem.cloud import reference
from tandem.cloud.constraint import ConstraintError, GrammarMask
from tandem.cloud.session import DraftRequest, Limits, open_session
from tandem.core.messages import Constraint
from tandem.core.sampling import Sampling
from tandem.core.tree import DraftTree, TreeShape
from tandem.edge.client import EdgeClient

pytestmark = pytest.mark.models

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person called Ann, aged 31, as JSON with keys name and age."}]


def test_tree_rows_are_masked_along_their_own_paths(engine):
    m = engine.model
    g = GrammarMask(engine, Constraint(json_schema=json.dumps(PERSON)))
    opening, name = m.tokenize('{"'), m.tokenize("name")
    # root -> '{"' -> 'name', and a sibling 'hello' the grammar forbids at the root
    hello = m.tokenize("hello")[0]
    tree = DraftTree(tokens=(opening[0], hello, name[0]), parents=(-1, -1, 0))
    rows = g.masks(tree)
    assert rows[0][opening[0]] and not rows[0][hello]  # the output must start an object
    assert rows[1][name[0]] and not rows[1][opening[0]]  # after '{"': a key, not another '{"'
    assert rows[2].all()  # below a forbidden node: never used, left unmasked
    assert (g.masks(tree) == rows).all()  # the matcher is back where it started
    eos = m.tokenize("<|im_end|>")[0]
    assert not rows[0][eos]  # nothing complete yet: no end of generation


@pytest.mark.parametrize("constraint, fragment", [
    (Constraint(json_schema="{not json"), "not JSON"),
    (Constraint(json_schema="[1]"), "JSON object"),
    (Constraint(json_schema=json.dumps({"type": "objectx"})), "objectx"),
    (Constraint(), "empty constraint"),
])
def test_constraints_that_cannot_compile(engine, constraint, fragment):
    with pytest.raises(ConstraintError, match=fragment):
        GrammarMask(engine, constraint)


def test_a_resumed_session_continues_the_grammar(engine):
    """Open with earlier output in the prompt (prior_output): the grammar has consumed it, so the next token
    continues the object instead of starting a new one."""
    m = engine.model
    prompt = m.tokenize(m.chat_prompt(ASK))
    prefix = m.tokenize('{"name": "Ann", "age": ')
    s = open_session(engine, prompt + prefix, Sampling(), Limits(8, 8, 4), Limits(0, 16, 8),
                     prior_output=len(prefix), constraint=GrammarMask(engine, Constraint(json_schema=json.dumps(
                         PERSON))))
    try:
        v = s.verify(DraftRequest(len(prompt) + len(prefix)))
        assert m.piece(v.bonus).decode().strip()[:1].isdigit()  # the integer the schema wants next
    finally:
        s.close()


@pytest.mark.parametrize("constraint", [Constraint(json_schema=json.dumps(PERSON)), Constraint(json_object=True)],
                         ids=["json_schema", "json_object"])
def test_greedy_structured_output_is_the_constrained_targets(engine, make_drafter, verifier, noise, constraint):
    m = engine.model
    prompt = m.tokenize(m.chat_prompt(ASK))
    ref = reference.decode(engine, prompt, 48, constraint=constraint)
    client = EdgeClient(make_drafter(), verifier[0], TreeShape(2, 8, 4), stream=False)
    try:
        gen = client.generate(prompt, max_new_tokens=48, constraint=constraint).result()
    finally:
        client.close()
    verdict = reference.classify(gen.tokens, ref, noise)
    assert verdict.ok, str(verdict)
    assert gen.finish_reason == "stop", gen.text  # the object closed, then end of generation
    obj = json.loads(gen.text)
    if constraint.json_schema:
        assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int)
    assert gen.stats.tau > 1.0  # drafts still land under the grammar
    plain = reference.greedy(engine, prompt, 48)
    with pytest.raises(ValueError):  # unconstrained, the model wraps its JSON in prose or a code fence
        json.loads(b"".join(m.piece(t) for t in plain.tokens).decode())


def test_masks_on_the_walk_equal_masks_of_the_whole_tree(engine):
    """The lazy rows (cloud/shaping.py) read the grammar along one path at a time, in any order: every row equals
    the row of the depth-first walk over the whole tree, and the matcher ends where it started."""
    import numpy as np
    from tandem.cloud.shaping import ShapedRows
    m = engine.model
    g = GrammarMask(engine, Constraint(json_schema=json.dumps(PERSON)))
    opening, name, age = m.tokenize('{"')[0], m.tokenize("name")[0], m.tokenize("age")[0]
    quote, hello = m.tokenize('"')[0], m.tokenize("hello")[0]
    eos = m.tokenize("<|im_end|>")[0]
    # root -> {" -> name -> "     root -> hello (forbidden) -> name     {" -> age     root -> eos
    tree = DraftTree(tokens=(opening, name, quote, hello, name, age, eos), parents=(-1, 0, 1, -1, 3, 0, -1))
    logits = np.random.default_rng(0).normal(size=(len(tree) + 1, engine.vocab_size)).astype(np.float32)
    eager = g.apply(logits, tree)
    rows = ShapedRows(logits, tree, Sampling(), None, g)
    for r in (3, 0, 5, 2, 1, 4, 7, 6, 3):  # out of walk order, back and forth
        assert np.array_equal(rows[r], eager[r]), r
    rows.close()
    assert (g.masks(tree) == np.isfinite(eager)).all()  # rewound: the matcher is back at the committed tokens
