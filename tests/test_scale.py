"""bench.scale: the trace drafter drafts what the traces say, as the scripted target's tokens; a short real run
against ``tandem serve --engine scripted`` writes the validation its interface promises, every answer the
target's own."""
import json
import random

import pytest

from tandem.core.tree import TreeShape
from tandem.edge.rounds import NO_TREE

from bench.capsim.physics import Device
from bench.capsim.traces import Text
from bench.scale import MISS, TraceDrafter, link_of, main

FAST = Device("test", 0.0, 0.0, "derived")


@pytest.mark.parametrize("runs, at, depth, held", [
    ((3, 2, 1, 0, 3, 2, 1), 0, 4, 3),  # a chain of 4 at position 0 holds L[0] = 3
    ((3, 2, 1, 0, 3, 2, 1), 1, 4, 2),
    ((3, 2, 1, 0, 3, 2, 1), 3, 2, 0),  # the drafter's first choice misses at 3
    ((3, 2, 1, 0, 3, 2, 1), 4, 2, 2),  # deeper than the chain it holds: cut at its depth
])
def test_a_chain_holds_min_of_the_trace_and_its_depth(runs, at, depth, held):
    d = TraceDrafter(FAST, 1.0, agree=0.9)
    d.replay(Text("humaneval", 3, runs), random.Random(0))
    d.start([0, 0, 0])
    d.commit(NO_TREE, (), list(range(1, at + 1)))  # the target's first ``at`` tokens: 1, 2, ...
    built = d.draft(TreeShape(1, depth, depth))
    want = [at + 1 + j for j in range(held)]
    assert list(built.tree.tokens[:held]) == want  # the target's next tokens (it counts up from the prompt's 0)
    assert all(t >= MISS for t in built.tree.tokens[held:])  # then tokens the target never emits
    assert list(built.tree.parents) == list(range(-1, depth - 1))


def test_the_link_spans_the_measured_round_overheads():
    link = link_of([1.0] * 10 + [2.0] * 80 + [3.0] * 10)
    assert link.one_way_ms == 1.0 and 0 < link.jitter_ms < 1.0
    assert link_of([]).one_way_ms == 0.0


def test_a_short_run_validates_and_every_answer_is_the_targets(tmp_path):
    out = tmp_path / "scale.json"
    rc = main(["--clients", "4", "--warmup-s", "1", "--duration-s", "2", "--cost-scale", "2", "--seeds", "1",
               "--answer-tokens", "24", "--max-error-pct", "1000", "--json", str(out)])
    d = json.loads(out.read_text())
    assert rc == 0 and d["ok"] and d["lossless_ok"]
    assert {p["metric"] for p in d["validation"]} == {"itl_p50_ms", "itl_p99_ms", "server_tokens_per_s"}
    row = d["rows"][0]
    assert row["clients"] == 4 and row["real"]["tokens"] > 0 and row["real"]["wrong_length"] == 0
    assert row["host_ms_per_verdict"] > 0 and row["round_loop"]["tokens_per_verify"] > 1  # drafts were accepted


def test_three_devices_each_get_at_least_plain_decoding(tmp_path):
    """bench.devices on a short run: a thin client, a browser tab and a laptop share one verifier whose host
    drafts for those that ask; the policy gives each at least plain decoding's tokens/s (the bench's check), every
    answer the target's own, and the thin client, which cannot draft, gets the host's drafts."""
    from bench.devices import main as devices

    out = tmp_path / "devices.json"
    rc = devices(["--requests", "1", "--warmup-requests", "1", "--answer-tokens", "24", "--cost-scale", "1",
                  "--min-vs-plain", "0.9", "--min-vs-best", "0", "--json", str(out)])
    d = json.loads(out.read_text())
    assert d["lossless_ok"] and set(d["arms"]) == {"adaptive", "plain", "rounds", "draft", "host"}
    laptop, thin = d["devices_verdicts"]["laptop"], d["devices_verdicts"]["thin-client"]
    assert laptop["tokens_per_s"]["draft"] > 1.5 * laptop["tokens_per_s"]["plain"]  # drafting pays on a laptop
    assert thin["tokens_per_s"]["host"] > 1.5 * thin["tokens_per_s"]["plain"]  # and on the host, for a thin client
    assert "host" in thin["modes"] and thin["vs_plain"] > 1.2  # which its policy hands its runs to
    assert rc == (0 if all(v["ok"] for v in d["devices_verdicts"].values()) else 1)
