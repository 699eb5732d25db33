import pytest

from tandem.orchestrator.placement import NoCapacity, Placement


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
