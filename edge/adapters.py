"""Drafter adapters the verifier distils from a partition's traffic (cloud/online.py), picked up by the edge.

An Opened names the latest adapter of the session's partition; when the drafter is the adapter's base (its model
file's sha256) and it is new, a background thread fetches it (``DrafterAdapter``), checks its sha256, and keeps
it in the adapter cache; the next generation *of that partition* drafts with it, and a generation of another
partition drafts with that partition's adapter or none: an adapter learnt from one tenant's text never drafts for
another. Swapping happens between generations (the drafter is idle then) and drops the drafter's kept cells.
Drafts change, the output never does: the verifier decides every token.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Callable

from tandem.core.cache import cache_dir
from tandem.core.messages import AdapterInfo

log = logging.getLogger("tandem.edge.adapters")


def adapter_path(sha: str) -> Path:
    return cache_dir() / "adapters" / f"{sha}.gguf"


class DrafterAdapters:
    """Which adapter each partition's generations draft with, for one drafter that has ``set_adapter`` and
    ``base_sha256`` (``edge.llama_drafter.LlamaDrafter``; ``edge.onnx_drafter.OnnxDrafter`` also has
    ``prepare_adapter``, which merges the adapter into an export of its own)."""

    def __init__(self, drafter, fetch: Callable[[AdapterInfo, str], bytes]):
        """``fetch(info, cache_salt)``: the adapter's bytes from the verifier, as the partition's caller."""
        self.drafter, self._fetch = drafter, fetch
        self._lock = threading.Lock()
        self._ready: dict[str, tuple[str, Path]] = {}  # cache salt -> (sha256, file) of its latest adapter
        self._fetching: set[str] = set()
        self.applied: tuple[str, str] | None = None  # (cache salt, sha256) the drafter drafts with now
        self.failures = 0  # fetches that failed or did not match their sha256

    @staticmethod
    def supported(drafter) -> bool:
        return hasattr(drafter, "set_adapter") and hasattr(type(drafter), "base_sha256")  # (not computed here)

    def offer(self, info: AdapterInfo, cache_salt: str) -> None:
        """An Opened of partition ``cache_salt`` named ``info``: fetch it in the background if it is new and made
        for this drafter."""
        with self._lock:
            have = self._ready.get(cache_salt)
            if (have is not None and have[0] == info.sha256) or info.sha256 in self._fetching:
                return
            self._fetching.add(info.sha256)
        threading.Thread(target=self._get, args=(info, cache_salt), name="adapter-fetch", daemon=True).start()

    def _get(self, info: AdapterInfo, cache_salt: str) -> None:
        try:
            if info.base != self.drafter.base_sha256:
                log.info("adapter %s is for another drafter: not used", info.sha256[:12])
                return
            path = adapter_path(info.sha256)
            if not path.is_file():
                data = self._fetch(info, cache_salt)
                if hashlib.sha256(data).hexdigest() != info.sha256:
                    raise ValueError("the adapter fetched does not have the sha256 its Opened named")
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_bytes(data)
                tmp.replace(path)
            # (an ONNX drafter merges it into an export of its own, here, off the drafting thread)
            prepare = getattr(self.drafter, "prepare_adapter", None)
            ready = prepare(path) if prepare is not None else path
            with self._lock:
                self._ready[cache_salt] = (info.sha256, ready)
        except Exception as e:  # drafting goes on without it: the adapter only changes proposals
            self.failures += 1
            log.warning("drafter adapter %s not fetched: %s", info.sha256[:12], e)
        finally:
            with self._lock:
                self._fetching.discard(info.sha256)

    def before_generation(self, cache_salt: str, quiesce: Callable[[], None] = lambda: None) -> bool:
        """Make the drafter draft with ``cache_salt``'s adapter (or none); ``quiesce`` is called first when that
        changes anything, and must leave the drafter idle. True when it changed (its kept cells are gone)."""
        with self._lock:
            ready = self._ready.get(cache_salt)
        want = (cache_salt, ready[0]) if ready else None
        if want == self.applied:
            return False
        if want is not None and self.applied is not None and want[1] == self.applied[1]:
            self.applied = want  # (the same file under another salt: nothing to load)
            return False
        quiesce()
        try:
            self.drafter.set_adapter(ready[1] if ready else None)
        except Exception as e:  # a file the drafter refuses: forget it, draft without
            self.failures += 1
            log.warning("drafter adapter %s refused: %s", want[1][:12] if want else "", e)
            with self._lock:
                self._ready.pop(cache_salt, None)
            self.drafter.set_adapter(None)
            want = None
        self.applied = want
        return True

    def path(self, sha: str) -> Path | None:
        """The file of a fetched adapter (None when it is not here)."""
        p = adapter_path(sha)
        return p if p.is_file() else None

    def wait(self, timeout_s: float = 60.0) -> None:
        """Until no fetch is in flight (tests, benches)."""
        import time
        deadline = time.monotonic() + timeout_s
        while self._fetching and time.monotonic() < deadline:
            time.sleep(0.02)
