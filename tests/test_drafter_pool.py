"""The gateway's drafter pool on literal prompts: a request goes to the free drafter whose last request was of its
partition with the longest shared prefix (the next turn of a chat, to the drafter that kept the last), else to the
one free the longest; another partition's history never attracts a request."""
import pytest

from tandem.orchestrator.gateway.drafter_pool import DrafterPool

TURN1 = list(range(100, 160))
TURN2 = TURN1 + list(range(500, 540))  # turn 1, its answer, the next message
TURN3 = TURN2 + list(range(700, 720))


class Client:
    def __init__(self, name):
        self.name, self.closed = name, False

    def close(self):
        self.closed = True

    def __repr__(self):
        return self.name


@pytest.fixture
def pool():
    return DrafterPool([Client("a"), Client("b"), Client("c")])


def test_the_next_turn_goes_to_the_drafter_that_has_the_last(pool):
    a = pool.acquire("alice", TURN1)
    b = pool.acquire("bob", [9] * 80)
    pool.release(a)
    pool.release(b)
    c = pool.acquire("carol", [7] * 10)  # no history of carol's anywhere: the one free the longest
    assert c.name == "c"
    assert pool.acquire("alice", TURN2) is a  # not b, free longer
    pool.release(a)
    assert pool.acquire("bob", [9] * 80 + [1]) is b
    pool.release(b)
    pool.release(c)
    # turn 3: a kept turn 2 (the longer shared prefix) against c's carol history and b's bob history
    assert pool.acquire("alice", TURN3) is a and pool.free() == 2


def test_only_a_partitions_own_history_counts(pool):
    a = pool.acquire("alice", TURN1)
    pool.release(a)
    first = pool.acquire("mallory", TURN2)  # alice's prefix, another partition: the one free the longest
    assert first is not a and first.name == "b"
    pool.release(first)
    # the drafter last lent to mallory is mallory's now; alice's turn goes to a still
    assert pool.acquire("alice", TURN2) is a


def test_the_longest_prefix_wins_among_a_partitions_drafters(pool):
    a = pool.acquire("alice", TURN1)
    b = pool.acquire("alice", TURN2)  # a second conversation turn while a is busy
    pool.release(b)
    pool.release(a)
    assert pool.acquire("alice", TURN3) is b  # b has 100 tokens of it, a 60
    assert pool.acquire("alice", TURN3) is a  # b lent: the next best


def test_all_lent_is_none_and_close_closes_every_client(pool):
    lent = [pool.acquire("p", [i]) for i in range(3)]
    assert pool.acquire("p", [0]) is None and pool.free() == 0
    pool.release(lent[1])
    assert pool.acquire("q", [5]) is lent[1]
    pool.close()
    assert all(c.closed for c in pool.clients)
