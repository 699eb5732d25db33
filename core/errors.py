"""The one base class of every error Tandem raises on purpose, so an application can catch them all at once
(``except TandemError``). Each subclass keeps its standard base too (``ValueError`` for bad input,
``RuntimeError`` for a failure at run time), so code catching those still works."""

from __future__ import annotations


class TandemError(Exception):
    """An error Tandem raised on purpose; the message says what was wrong and what to do."""
