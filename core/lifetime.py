"""A process that starts another owns it: Tandem's children die with their parent, even when it is SIGKILLed.

``spawn`` starts a child with ``TANDEM_PARENT_PID`` set; every Tandem entry point calls ``bind_to_parent`` first,
which (on Linux) asks the kernel to send SIGTERM when the parent dies (``PR_SET_PDEATHSIG``), so the child shuts
down through its own handlers. A watchdog thread backs that up everywhere: once the parent is gone, the child gets
``grace_s`` to finish, then exits hard. Children of children are owned the same way by their own parent, which is
why the variable is consumed here and not inherited.

Processes Tandem does not start itself (a local Ray's raylet starts agents that poll for their parent and can
outlive it by minutes) are covered by ``reap_descendants_on_exit``: a small reaper process watches the caller, and
when it dies terminates its descendants. Two records find them, because neither is complete alone:

- the mark: the caller's environment carries it, and every descendant inherits it, however deep and whoever forks
  it; it catches processes forked at the last moment. But ``/proc/PID/environ`` is only the memory the process
  started with, and a process that rewrites its title (Ray's agents call ``setproctitle``) overwrites part of it:
  the mark can vanish from a live process.
- the tree: while the caller lives, the reaper snapshots its descendants (by parent pid, with each process's start
  time so a reused pid is never hit) every ``TRACK_S``. Orphans re-parented to init when their parent died are
  still in the snapshot.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence

PARENT_ENV = "TANDEM_PARENT_PID"
SWEEP_S = 0.5  # the reaper's sweep interval once the caller is gone
QUIET_S = 10.0  # the reaper stops once no marked process has been seen for this long (1.5 s let a late agent live)
TRACK_S = 1.0  # how often the reaper snapshots the living caller's process tree
PR_SET_PDEATHSIG = 1


def child_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's) plus the mark that makes a Tandem child die with this process."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def spawn(argv: Sequence[str], **popen) -> subprocess.Popen:
    """``subprocess.Popen`` for a Tandem entry point (``python -m ...``) that must not outlive this process."""
    return subprocess.Popen(list(argv), env=child_env(popen.pop("env", None)), **popen)


def bind_to_parent(grace_s: float = 5.0) -> None:
    """Die with the process that spawned this one (a no-op unless it used ``spawn`` / ``child_env``)."""
    value = os.environ.pop(PARENT_ENV, None)
    if not value:
        return
    parent = int(value)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the kernel was told: nobody would signal us
        os._exit(1)
    threading.Thread(target=_watch, args=(parent, grace_s), name="parent-watchdog", daemon=True).start()


REAP_ENV = "TANDEM_REAP_MARK"


def reap_descendants_on_exit(poll_s: float = 0.5) -> subprocess.Popen | None:
    """Start a reaper for every process started from here on (Linux; None elsewhere). Needs no cooperation from
    them: the mark is in the environment they inherit."""
    if not sys.platform.startswith("linux") or os.environ.get(REAP_ENV):
        return None
    mark = f"{os.getpid()}-{time.time_ns()}"
    reaper = subprocess.Popen(
        [sys.executable, "-m", "tandem.core.lifetime", "--reap", str(os.getpid()), mark, str(poll_s)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    os.environ[REAP_ENV] = mark  # after the reaper started: it does not carry the mark itself
    return reaper


def _marked(mark: str) -> list[int]:
    needle = f"{REAP_ENV}={mark}".encode()
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(d))
            except OSError:
                continue
    return pids


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks since boot) of every live process."""
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()  # the command name may hold spaces and ')'
            except (OSError, IndexError):
                continue
            if fields[0] != b"Z":  # a zombie is already dead
                table[int(d)] = (int(fields[1]), int(fields[19]))
    return table


def _descendants(roots: set[int], table: dict[int, tuple[int, int]]) -> set[int]:
    """Every process in ``table`` below one of ``roots`` (the roots themselves excluded)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found and child not in roots:
                found.add(child)
                todo.append(child)
    return found


def _reap(root: int, mark: str, poll_s: float) -> None:
    known: dict[int, int] = {}  # pid -> start time of every descendant seen while the caller lived
    tracked = 0.0
    while True:
        try:
            os.kill(root, 0)
        except ProcessLookupError:
            break
        if time.monotonic() - tracked >= TRACK_S:
            table = _processes()
            known = {p: start for p, start in known.items() if table.get(p, (0, -1))[1] == start}
            known.update({p: table[p][1] for p in _descendants({root}, table)})
            tracked = time.monotonic()
        time.sleep(poll_s)
    # sweep until no target has been seen for QUIET_S: SIGTERM on first sight, SIGKILL 1.5 s later; processes
    # forked while the first ones die (an agent restarting a child, a worker the raylet was starting, a raylet
    # shutting down slowly on a loaded host restarting its agents) are caught by a later sweep
    first_seen: dict[int, float] = {}
    deadline, quiet = time.monotonic() + 60.0, 0
    while time.monotonic() < deadline and quiet * SWEEP_S < QUIET_S:
        table = _processes()
        targets = {p for p, start in known.items() if table.get(p, (0, -1))[1] == start}
        targets |= set(_marked(mark)) & table.keys()
        targets |= _descendants(targets, table)
        targets.discard(os.getpid())
        known.update({p: table[p][1] for p in targets})
        quiet = 0 if targets else quiet + 1
        now = time.monotonic()
        for pid in targets:
            since = first_seen.setdefault(pid, now)
            try:
                os.kill(pid, signal.SIGTERM if now - since < 1.5 else signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(SWEEP_S)


def _watch(parent: int, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    if not sys.platform.startswith("linux"):  # no death signal was armed: ask for a clean shutdown first
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(1)  # the clean shutdown did not finish in time


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--reap":
        _reap(int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
