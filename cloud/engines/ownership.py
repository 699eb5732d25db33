"""One thread at a time inside an engine: what llama.cpp's context needs and what nothing else enforced.

A llama.cpp context is not thread-safe, and ``forward_tree`` returns a view of its logits that the next forward
overwrites: two threads using one engine (a scheduler's loop and a test decoding a reference, two schedulers on a
shared engine) can compute a row against the wrong cells or read another forward's logits, and commit a wrong token
with no error. So the engine has an owner. Whoever runs a sequence of calls takes ownership for it (``owned``:
blocking, reentrant; the scheduler's loop for each step, ``cloud.reference`` for a whole decode); every engine call
checks that no other thread owns the engine at that moment (``check``) and raises, naming both threads, if one
does. Misuse is an error, never a silently wrong token.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class EngineBusy(RuntimeError):
    """An engine call from a thread that does not own the engine while another thread does."""


class Ownership:
    def __init__(self, name: str):
        self.name = name
        self._cond = threading.Condition()
        self._owner: threading.Thread | None = None
        self._depth = 0

    @contextlib.contextmanager
    def owned(self) -> Iterator[None]:
        """Own the engine for the block (waits while another thread owns it; reentrant)."""
        me = threading.current_thread()
        with self._cond:
            while self._owner is not None and self._owner is not me:
                self._cond.wait()
            self._owner = me
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    self._cond.notify_all()

    def check(self) -> None:
        """Raise ``EngineBusy`` when another thread owns the engine now."""
        owner = self._owner
        if owner is not None and owner is not threading.current_thread():
            raise EngineBusy(f"{self.name} called from thread {threading.current_thread().name!r} while thread "
                             f"{owner.name!r} owns it: use the engine from one thread at a time (its scheduler's "
                             f"call(), or `with engine.owned():`)")


def owned(engine) -> contextlib.AbstractContextManager:
    """``engine.owned()`` for engines that have an owner, else a no-op."""
    own = getattr(engine, "owned", None)
    return own() if own is not None else contextlib.nullcontext()
