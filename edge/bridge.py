"""Blocking iterators consumed from asyncio: the one bridge the SDK's async client and the REST gateway share.

A generation is a blocking iterator (it waits on the verifier and the drafter). ``aiter_thread`` runs it on a
worker thread and hands its items to the event loop as they come. Leaving early (``break``, an exception, a task
cancelled because the HTTP client went away) stops the iterator at its next item and closes it on its own thread,
which for a ``Generation`` closes the verifier session; the async generator's close waits for that.
"""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Iterator, TypeVar

T = TypeVar("T")
_END = object()


async def aiter_thread(iterator: Iterator[T]) -> AsyncIterator[T]:
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()

    def hand_over(kind, value) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            stop.set()

    def run() -> None:
        try:
            for item in iterator:
                if stop.is_set():
                    break
                hand_over("item", item)
            hand_over("end", _END)
        except BaseException as e:
            hand_over("error", e)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    worker = threading.Thread(target=run, name="aiter-thread", daemon=True)
    worker.start()
    try:
        while True:
            kind, value = await items.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        # leaving early returns once the iterator is closed (for a generation: its session and its client are
        # free again), which takes at most until its next item
        await asyncio.shield(asyncio.to_thread(worker.join))
