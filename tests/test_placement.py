import pytest

from tandem.orchestrator.pool.placement import NoCapacity, Placement


@pytest.mark.parametrize("capacity,opens,expected", [
    ({"a": 2, "b": 2}, ["s1", "s2", "s3", "s4"], ["a", "b", "a", "b"]),  # least loaded, ties by name
    ({"a": 1, "b": 3}, ["s1", "s2", "s3"], ["a", "b", "b"]),  # a full after one
    ({"b": 2, "a": 2}, ["s1"], ["a"]),  # name order, not dict order
])
def test_least_loaded_on_open(capacity, opens, expected):
    p = Placement(capacity)
    assert [p.place(s) for s in opens] == expected


def test_sticky_after_open_and_release_frees_capacity():
    p = Placement({"a": 1, "b": 1})
    assert p.place("s1") == "a"
    assert p.place("s2") == "b"
    assert p.place("s1") == "a"  # sticky, no capacity check for a placed session
    with pytest.raises(NoCapacity, match="full"):
        p.place("s3")
    p.release("s1")
    assert p.place("s3") == "a"


def test_dead_replica_sessions_move():
    p = Placement({"a": 2, "b": 2})
    for s in ("s1", "s2", "s3"):
        p.place(s)
    assert sorted(p.mark_dead("a")) == ["s1", "s3"]
    assert p.place("s1") == "b"  # b now holds s2 and s1: full
    with pytest.raises(NoCapacity, match="1 live verifier replicas are full"):
        p.place("s3")


SYS = tuple(range(1000, 1040))  # a 40-token system prompt every conversation starts with
CONV_A = SYS + tuple(range(1, 81))  # turn 1 of conversation A
CONV_B = SYS + tuple(range(101, 181))


def turn2(conv):
    return conv + tuple(range(500, 540))  # the answer and the next user message appended


@pytest.mark.parametrize("name,steps,expected", [
    # (op, session, prompt): "open" places and opens, "close" releases; expected: the replica of each open
    ("the next turn follows its conversation, though another replica is less loaded",
     [("open", "a1", CONV_A), ("close", "a1", ()), ("open", "x", SYS + (7,) * 80), ("open", "a2", turn2(CONV_A))],
     ["a", "a", "a"]),
    ("a new conversation sharing only the system prompt: least loaded",
     [("open", "a1", CONV_A), ("open", "b1", CONV_B)],
     ["a", "b"]),
    ("a prefix shorter than min_prefix_tokens: least loaded",
     [("open", "a1", tuple(range(20))), ("open", "a2", tuple(range(20)) + (5,) * 40)],
     ["a", "b"]),
    ("locality gives way past balance_slack: parallel requests on one long prompt",
     [("open", "a1", CONV_A), ("open", "a2", turn2(CONV_A)), ("open", "a3", turn2(CONV_A) + (1,)),
      ("open", "a4", turn2(CONV_A) + (2,))],
     ["a", "a", "a", "b"]),
    ("two conversations, each back to its own replica",
     [("open", "a1", CONV_A), ("open", "b1", CONV_B), ("close", "a1", ()), ("close", "b1", ()),
      ("open", "b2", turn2(CONV_B)), ("open", "a2", turn2(CONV_A))],
     ["a", "b", "b", "a"]),
])
def test_cache_aware_routing(name, steps, expected):
    p = Placement({"a": 8, "b": 8}, balance_slack=2)
    got = []
    for op, session, prompt in steps:
        if op == "open":
            got.append(p.place(session, prompt))
            p.opened(got[-1], prompt)
        else:
            p.release(session)
    assert got == expected, name


def test_routing_counts_moves_and_a_dead_replica_attracts_nothing():
    p = Placement({"a": 8, "b": 8})
    p.opened(p.place("a1", CONV_A), CONV_A)
    p.release("a1")
    p.place("x", (7,) * 50)  # a (by name), so b is now the least loaded
    assert p.place("a2", turn2(CONV_A)) == "a" and p.prefix_routed == 1
    p.mark_dead("a")
    p.add("c", 8)  # the replacement
    assert p.place("a3", turn2(CONV_A) + (1,)) == "b" and p.prefix_routed == 1  # by load, then name


def test_routing_off():
    p = Placement({"a": 8, "b": 8}, remember=0)
    p.opened(p.place("a1", CONV_A), CONV_A)
    p.release("a1")
    p.place("x", (7,) * 50)
    assert p.place("a2", turn2(CONV_A)) == "b"  # least loaded: no record is kept
