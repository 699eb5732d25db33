"""Where Tandem keeps what is expensive to make: model files, ONNX exports, datasets, llama.cpp probe verdicts."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$TANDEM_CACHE``, else ``$XDG_CACHE_HOME/tandem``, else ``~/.cache/tandem``."""
    if os.environ.get("TANDEM_CACHE"):
        return Path(os.environ["TANDEM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem"
