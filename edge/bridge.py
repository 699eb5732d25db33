"""Blocking iterators consumed from asyncio: the one bridge the SDK's async client and the REST gateway share.

A generation is a blocking iterator (it waits on the verifier and the drafter). ``aiter_thread`` runs it on a
worker thread, started at once, and hands its items to the event loop as they come. ``aclose`` (leaving an
``async with aclosing(...)`` early: ``break``, an exception, a task cancelled because the HTTP client went away)
stops the iterator at its next item and closes it on its own thread, which for a ``Generation`` closes the
verifier session.

``on_exit`` runs on the worker thread after the iterator is closed, however it ended: the place to give back
what the iteration borrowed (the gateway returns the drafter to its pool there). Giving it back from the event
loop instead would be wrong when the closing task is cancelled: the loop moves on while the thread still
generates, and the next request would get a drafter that is still busy.
"""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")
_END = object()


class aiter_thread(Generic[T]):  # noqa: N801 -- used like a function: async for x in aiter_thread(it)
    def __init__(self, iterator: Iterator[T], on_exit: Callable[[], None] | None = None):
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue = asyncio.Queue()
        self._stop = threading.Event()
        self._iterator, self._on_exit = iterator, on_exit
        self._worker = threading.Thread(target=self._run, name="aiter-thread", daemon=True)
        self._worker.start()

    def _hand_over(self, kind, value) -> None:
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self._stop.set()

    def _run(self) -> None:
        try:
            for item in self._iterator:
                if self._stop.is_set():
                    break
                self._hand_over("item", item)
            self._hand_over("end", _END)
        except BaseException as e:
            self._hand_over("error", e)
        finally:
            try:
                close = getattr(self._iterator, "close", None)
                if close is not None:
                    close()
            finally:
                if self._on_exit is not None:
                    self._on_exit()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        if self._stop.is_set():
            raise StopAsyncIteration
        kind, value = await self._items.get()
        if kind == "end":
            self._stop.set()
            raise StopAsyncIteration
        if kind == "error":
            self._stop.set()
            raise value
        return value

    async def aclose(self) -> None:
        """Stop the iterator at its next item and wait until it is closed (at most until that item). If the
        waiting task is cancelled meanwhile, the thread still finishes the close and runs ``on_exit``."""
        self._stop.set()
        await asyncio.shield(asyncio.to_thread(self._worker.join))
