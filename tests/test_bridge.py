"""The sync-to-async bridge: items and errors pass through in order; leaving early or being cancelled closes the
iterator on its own thread, and ``on_exit`` runs after that close, however the consumer ended (the gateway gives
a drafter back there: giving it back while the generation still ran handed a busy drafter to the next request)."""
import asyncio
import time
from contextlib import aclosing, nullcontext

import pytest

from tandem.edge.bridge import aiter_thread


def _slow(log, n=100, every_s=0.05):
    try:
        for i in range(n):
            time.sleep(every_s)
            yield i
    finally:
        log.append("closed")


def test_items_then_end_and_on_exit():
    log = []

    async def main():
        async with aclosing(aiter_thread(_slow(log, 5, 0.0), on_exit=lambda: log.append("exit"))) as it:
            return [x async for x in it]

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
    assert log == ["closed", "exit"]


def test_errors_are_raised_in_the_consumer():
    def failing():
        yield 1
        raise KeyError("boom")

    async def main():
        got = []
        async with aclosing(aiter_thread(failing())) as it:
            async for x in it:
                got.append(x)
        return got

    with pytest.raises(KeyError, match="boom"):
        asyncio.run(main())


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_leaving_early_closes_on_the_thread_before_on_exit(how):
    log = []

    async def consume():
        async with aclosing(aiter_thread(_slow(log, every_s=0.2), on_exit=lambda: log.append("exit"))) as it:
            async for x in it:
                if how == "break" and x == 1:
                    break
        log.append("left")

    async def main():
        task = asyncio.create_task(consume())
        if how == "cancel":
            await asyncio.sleep(0.3)
            task.cancel()
        with pytest.raises(asyncio.CancelledError) if how == "cancel" else nullcontext():
            await task
        log.append("done")

    asyncio.run(main())
    # on_exit after the close; the consumer's task ends only once both ran (cancelled or not)
    assert log[:2] == ["closed", "exit"] and log[-1] == "done"
    assert ("left" in log) == (how == "break")

