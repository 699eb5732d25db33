"""A process that starts another owns it: Tandem's children die with their parent, even when it is SIGKILLed.

``spawn`` starts a child with ``TANDEM_PARENT_PID`` set; every Tandem entry point calls ``bind_to_parent`` first,
which (on Linux) asks the kernel to send SIGTERM when the parent dies (``PR_SET_PDEATHSIG``), so the child shuts
down through its own handlers. A watchdog thread backs that up everywhere: once the parent is gone, the child gets
``grace_s`` to finish, then exits hard. Children of children are owned the same way by their own parent, which is
why the variable is consumed here and not inherited.

Processes Tandem does not start itself (a local Ray's raylet starts agents that poll for their parent and can
outlive it by minutes) are covered by ``reap_descendants_on_exit``: a small reaper process marks the caller's
environment (inherited by every descendant, however deep and whoever forks it), and when the caller dies it
terminates every process carrying the mark, including those already re-parented and those forked at the last
moment.
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


def _reap(root: int, mark: str, poll_s: float) -> None:
    while True:
        try:
            os.kill(root, 0)
        except ProcessLookupError:
            break
        time.sleep(poll_s)
    # sweep until the mark has been gone for QUIET_S: SIGTERM on first sight, SIGKILL 1.5 s later; processes
    # forked while the first ones die (an agent restarting a child, a worker the raylet was starting, a raylet
    # shutting down slowly on a loaded host restarting its agents) are caught by a later sweep
    first_seen: dict[int, float] = {}
    deadline, quiet = time.monotonic() + 60.0, 0
    while time.monotonic() < deadline and quiet * SWEEP_S < QUIET_S:
        pids = _marked(mark)
        quiet = 0 if pids else quiet + 1
        now = time.monotonic()
        for pid in pids:
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
