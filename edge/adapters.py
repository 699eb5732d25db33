"""Drafter adapters the verifier distils from a partition's traffic (cloud/learning/online.py), picked up by the edge.

An Opened names the latest adapter of the session's partition; when the drafter is the adapter's base (its model
file's sha256) and it is new, a background thread fetches it (``DrafterAdapter``), checks its sha256, and keeps
it in the adapter cache; the next generation *of that partition* drafts with it, and a generation of another
partition drafts with that partition's adapter or none: an adapter learnt from one tenant's text never drafts for
another. Swapping happens between generations (the drafter is idle then) and drops the drafter's kept cells.
Drafts change, the output never does: the verifier decides every token.

The verifier names the file: a name that is not a sha256 (64 lowercase hex digits) is refused before it touches
the file system. A cached file is hashed again whenever it is taken (an Opened names it) and before the drafter
loads it; one that does not match is deleted, and fetched again. The cache keeps copies, not adapters' lives (the
verifier's ``--teacher-age-h`` is not known here): a copy goes when its partition's next adapter replaces it here,
when no process sharing the cache has taken it for ``max_age_s`` (its file's time is its last take), and past the
``max_files`` most recently taken; pruned when the cache is opened and after every take, never a copy this process
may load next or is fetching.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable, Collection, Sequence

from tandem.core.cache import cache_dir
from tandem.core.messages import AdapterInfo

log = logging.getLogger("tandem.edge.adapters")

MAX_AGE_S = 24 * 3600.0  # a copy not taken for this long goes (the verifier's default adapter lifetime)
MAX_FILES = 16  # copies kept in the cache at most, the most recently taken

_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE = re.compile(r"[0-9a-f]{64}\.gguf")  # a copy (``adapter_path``)
_TMP = re.compile(r"\.[0-9a-f]{64}\.gguf\.[0-9]+\.[0-9]+\.tmp")  # one being written (or left by a crash)


def adapters_dir() -> Path:
    return cache_dir() / "adapters"


def adapter_path(sha: str) -> Path:
    """Where the adapter ``sha`` is cached (``sha``: from the verifier, so checked before it names a file)."""
    if not _SHA256.fullmatch(sha):
        raise ValueError(f"not an adapter sha256 (64 lowercase hex digits): {sha[:80]!r}")
    return adapters_dir() / f"{sha}.gguf"


def intact(path: Path, sha: str) -> bool:
    """Whether the file at ``path`` hashes to ``sha``; one that does not is deleted (False too when it is absent)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except FileNotFoundError:
        return False
    if h.hexdigest() == sha:
        return True
    log.warning("cached adapter %s does not have its sha256: deleted", sha[:12])
    path.unlink(missing_ok=True)
    return False


def stale(files: Sequence[tuple[str, float]], now: float, max_age_s: float, max_files: int,
          keep: Collection[str] = ()) -> list[str]:
    """``files``: (name, last taken) in the adapter cache; the names to delete: a copy or a temporary file not
    taken for ``max_age_s``, and the copies past the ``max_files`` most recently taken; never a name in ``keep``,
    never a name that is neither a copy nor a temporary file."""
    copies = sorted((f for f in files if _FILE.fullmatch(f[0])), key=lambda f: -f[1])  # most recently taken first
    out = [name for i, (name, at) in enumerate(copies) if now - at >= max_age_s or i >= max_files]
    out += [name for name, at in files if _TMP.fullmatch(name) and now - at >= max_age_s]
    return [name for name in out if name not in keep]


def _times(d: Path) -> list[tuple[str, float]]:
    """Each regular file in ``d``: (name, modification time); one that goes meanwhile is left out."""
    out = []
    with os.scandir(d) as entries:
        for e in entries:
            try:
                if e.is_file(follow_symlinks=False):
                    out.append((e.name, e.stat(follow_symlinks=False).st_mtime))
            except FileNotFoundError:
                continue
    return out


class DrafterAdapters:
    """Which adapter each partition's generations draft with, for one drafter that has ``set_adapter`` and
    ``base_sha256`` (``edge.llama_drafter.LlamaDrafter``; ``edge.onnx_drafter.OnnxDrafter`` also has
    ``prepare_adapter``, which merges the adapter into an export of its own)."""

    def __init__(self, drafter, fetch: Callable[[AdapterInfo, str], bytes], max_age_s: float = MAX_AGE_S,
                 max_files: int = MAX_FILES, clock: Callable[[], float] = time.time):
        """``fetch(info, cache_salt)``: the adapter's bytes from the verifier, as the partition's caller;
        ``max_age_s``, ``max_files``: the cache's pruning (the module's docstring); ``clock``: Unix seconds, as
        files' times are."""
        self.drafter, self._fetch = drafter, fetch
        self.max_age_s, self.max_files, self.clock = max_age_s, max_files, clock
        self._lock = threading.Lock()
        self._ready: dict[str, tuple[str, Path]] = {}  # cache salt -> (sha256, file) of its latest adapter
        self._fetching: set[str] = set()
        self.applied: tuple[str, str] | None = None  # (cache salt, sha256) the drafter drafts with now
        self.failures = 0  # fetches that failed or did not match their sha256, names refused, files refused
        self.prune()

    @staticmethod
    def supported(drafter) -> bool:
        return hasattr(drafter, "set_adapter") and hasattr(type(drafter), "base_sha256")  # (not computed here)

    def offer(self, info: AdapterInfo, cache_salt: str) -> None:
        """An Opened of partition ``cache_salt`` named ``info``: fetch it in the background if it is new and made
        for this drafter."""
        if not _SHA256.fullmatch(info.sha256):  # (never a file name, never a fetch)
            self.failures += 1
            log.warning("the verifier named an adapter whose sha256 is not 64 lowercase hex digits (%r): not used",
                        info.sha256[:80])
            return
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
            if intact(path, info.sha256):
                os.utime(path)  # (taken: its time is its last take, what pruning reads)
            else:
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
                old = self._ready.get(cache_salt)
                self._ready[cache_salt] = (info.sha256, ready)
                superseded = old[0] if old is not None and old[0] != info.sha256 else None
            self.prune(superseded)
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
            if ready is not None and ready[1] == adapter_path(ready[0]) and not intact(ready[1], ready[0]):
                raise ValueError("the cached file no longer has its sha256 (deleted: fetched again when named)")
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

    def prune(self, superseded: str | None = None) -> None:
        """Delete the cache's stale copies (``stale``) and ``superseded``'s, unless this process drafts with or
        fetches them. Never fails: a copy left is only disk."""
        try:
            with self._lock:
                # (not the one applied: the drafter loaded it whole, and loads only what ``_ready`` names)
                keep = {f"{sha}.gguf" for sha in {s for s, _ in self._ready.values()} | self._fetching}
            d = adapters_dir()
            if not d.is_dir():
                return
            names = stale(_times(d), self.clock(), self.max_age_s, self.max_files, keep)
            if superseded is not None and f"{superseded}.gguf" not in keep:
                names.append(f"{superseded}.gguf")
            for name in names:
                (d / name).unlink(missing_ok=True)
                log.info("cached adapter %s pruned", name[:12])
        except OSError as e:
            log.warning("adapter cache not pruned: %s", e)

    def wait(self, timeout_s: float = 60.0) -> None:
        """Until no fetch is in flight (tests, benches)."""
        import time
        deadline = time.monotonic() + timeout_s
        while self._fetching and time.monotonic() < deadline:
            time.sleep(0.02)
