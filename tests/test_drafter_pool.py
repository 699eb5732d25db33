"""The gateway's drafter pool on literal prompts: a request goes to the free drafter whose last request was of its
partition with the longest shared prefix (the next turn of a chat, to the drafter that kept the last), else to the
one free the longest; another partition's history never attracts a request. With every drafter lent, requests
wait in a bounded line and are served first come, first served; a drafter is never lost to a waiter that gave up."""
import asyncio

import pytest

from tandem.orchestrator.gateway.drafter_pool import DrafterPool, Gone, PoolFull, QueueTimeout

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


# -- the queue: every drafter lent, requests wait their turn -------------------------------------------------------
def run(coro):
    return asyncio.run(coro)


def test_waiting_requests_get_drafters_first_come_first_served():
    pool = DrafterPool([Client("a")])

    async def main():
        a = await pool.lend("p", [1], max_waiting=8, timeout_s=5)
        served = []

        async def wait(name, partition, prompt):
            client = await pool.lend(partition, prompt, max_waiting=8, timeout_s=5)
            served.append(name)
            await asyncio.sleep(0.01)
            pool.release(client)

        tasks = []
        for i, name in enumerate(["first", "second", "third", "fourth"]):
            tasks.append(asyncio.create_task(wait(name, "p", [1] if name == "fourth" else [i + 10])))
            await asyncio.sleep(0.01)  # arrive in this order
        assert pool.waiting() == 4 and pool.free() == 0
        pool.release(a)
        await asyncio.gather(*tasks)
        return served

    assert run(main()) == ["first", "second", "third", "fourth"]
    assert pool.free() == 1 and pool.waiting() == 0


def test_a_drafter_handed_to_a_waiter_remembers_that_waiters_prompt():
    pool = DrafterPool([Client("a"), Client("b")])

    async def main():
        a, b = pool.acquire("x", [5] * 10), pool.acquire("y", [6] * 10)
        waiter = asyncio.create_task(pool.lend("alice", TURN1, max_waiting=1, timeout_s=5))
        await asyncio.sleep(0.01)
        pool.release(b)
        got = await waiter
        pool.release(a)
        pool.release(got)
        return got

    b = run(main())
    assert b.name == "b" and pool.acquire("alice", TURN2) is b  # the next turn follows the drafter it was handed


@pytest.mark.parametrize("max_waiting", [0, 2])
def test_a_full_queue_is_refused_at_once(max_waiting):
    pool = DrafterPool([Client("a")])

    async def main():
        await pool.lend("p", [], max_waiting=max_waiting, timeout_s=5)
        waiters = [asyncio.create_task(pool.lend("p", [], max_waiting=max_waiting, timeout_s=5))
                   for _ in range(max_waiting)]
        await asyncio.sleep(0.01)
        with pytest.raises(PoolFull):
            await pool.lend("p", [], max_waiting=max_waiting, timeout_s=5)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)

    run(main())
    assert pool.waiting() == 0 and pool.free() == 0  # the lent one is still lent, nobody else holds one


def test_a_wait_times_out_and_a_caller_that_left_leaves_the_line():
    pool = DrafterPool([Client("a")])
    asked = []

    async def gone():
        asked.append(1)
        return len(asked) >= 2

    async def main():
        held = await pool.lend("p", [], max_waiting=4, timeout_s=5)
        with pytest.raises(QueueTimeout):
            await pool.lend("p", [], max_waiting=4, timeout_s=0.05, poll_s=0.01)
        assert pool.waiting() == 0
        with pytest.raises(Gone):
            await pool.lend("p", [], max_waiting=4, timeout_s=5, gone=gone, poll_s=0.01)
        assert pool.waiting() == 0 and len(asked) == 2
        pool.release(held)

    run(main())
    assert pool.free() == 1


def test_a_drafter_handed_over_as_its_waiter_gives_up_goes_back():
    """The release and the waiter's cancellation race: the drafter handed to a waiter that is no longer there must
    not be lost."""
    pool = DrafterPool([Client("a")])

    async def main():
        held = await pool.lend("p", [], max_waiting=4, timeout_s=5)
        waiter = asyncio.create_task(pool.lend("p", [], max_waiting=4, timeout_s=5))
        await asyncio.sleep(0.01)
        pool.release(held)  # handed over (the waiter has not run yet) ...
        waiter.cancel()  # ... and the waiter is cancelled before it takes it
        with pytest.raises(asyncio.CancelledError):
            await waiter

    run(main())
    assert pool.free() == 1 and pool.waiting() == 0


def test_a_drafter_released_from_another_thread_wakes_the_waiter():
    import threading
    pool = DrafterPool([Client("a")])

    async def main():
        held = await pool.lend("p", [], max_waiting=1, timeout_s=5)
        threading.Timer(0.05, pool.release, args=(held,)).start()  # as a generation's thread gives it back
        return await pool.lend("p", [], max_waiting=1, timeout_s=5)

    assert run(main()).name == "a"
