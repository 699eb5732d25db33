"""A process that starts another owns it (core/lifetime.py): no Tandem process outlives its parent, even when the
parent is SIGKILLed mid-generation (`tandem demo`'s verifier, `tandem serve`'s Ray workers)."""
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def marked(mark: str) -> list[int]:
    """Live processes whose environment carries ``mark`` (inherited by every descendant)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if f"TANDEM_TEST_MARK={mark}".encode() not in (d / "environ").read_bytes().split(b"\0"):
                continue
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
                continue
        except OSError:
            continue
        found.append(int(d.name))
    return found


def describe(pid: int) -> str:
    """A process's command line and state, for failure messages."""
    try:
        cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        return f"{pid} {state} {cmd[:200]}"
    except OSError:
        return f"{pid} (gone)"


def wait_gone(mark: str, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def start(argv: list[str], mark: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, TANDEM_TEST_MARK=mark, PYTHONUNBUFFERED="1", **kw.pop("env", {}))
    return subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True, **kw)


def kill_tree(mark: str) -> None:
    for pid in marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_spawned_child_dies_with_its_sigkilled_parent():
    mark = uuid.uuid4().hex
    child = "from core import lifetime; lifetime.bind_to_parent(); import time; time.sleep(120)"
    parent = ("import sys, time; from core import lifetime; "
              f"p = lifetime.spawn([sys.executable, '-c', {child!r}]); print(p.pid, flush=True); time.sleep(120)")
    proc = start([sys.executable, "-c", parent], mark, stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(proc.stdout.readline())
        time.sleep(1.0)  # the child is armed
        assert child_pid in marked(mark)
        proc.kill()
        proc.wait()
        assert wait_gone(mark) == []
    finally:
        kill_tree(mark)


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# Ray's agents rewrite their title (setproctitle), which overwrites the start of the memory /proc/PID/environ reads:
# the reaper's environment mark can vanish from a live process. This one zeroes all of it, then is orphaned.
CLOBBERED = """
import ctypes, time
stat = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
env_start, env_end = int(stat[47]), int(stat[48])
ctypes.memset(env_start, 0, env_end - env_start)
print(open("/proc/self/environ", "rb").read().count(b"TANDEM_REAP_MARK"), flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_reaper_ends_an_orphan_whose_environment_mark_was_overwritten():
    mark = uuid.uuid4().hex
    middle = ("import subprocess, sys, time; "
              f"g = subprocess.Popen([sys.executable, '-c', {CLOBBERED!r}], stdout=subprocess.PIPE, text=True); "
              "marks = g.stdout.readline().strip(); print(g.pid, marks, flush=True); time.sleep(2.5)")
    root = ("import subprocess, sys, time; from core import lifetime; lifetime.reap_descendants_on_exit(); "
            f"m = subprocess.Popen([sys.executable, '-c', {middle!r}], stdout=subprocess.PIPE, text=True); "
            "print(m.stdout.readline().strip(), flush=True); m.wait(); print('orphaned', flush=True); time.sleep(120)")
    proc = start([sys.executable, "-c", root], mark, stdout=subprocess.PIPE, text=True)
    try:
        pid, marks = map(int, proc.stdout.readline().split())
        assert marks == 0  # the mark is gone from what /proc shows
        assert proc.stdout.readline().strip() == "orphaned"  # its parent exited: it is no longer below root
        assert alive(pid)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10.0
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(pid), describe(pid)
    finally:
        kill_tree(mark)


@pytest.mark.models
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkilled_demo_leaves_no_verifier_behind(target_path, drafter_path):
    mark = uuid.uuid4().hex
    proc = start([sys.executable, "-m", "tandem.orchestrator.cli", "demo", "Write a long story about a robot.",
                  "--max-tokens", "400", "--tree", "1,3,3", "--n-ctx", "1024"], mark, stdout=subprocess.DEVNULL,
                 stderr=subprocess.PIPE, text=True)
    try:
        # its first generation (a warm-up) has begun: mid-session (its answers stream only after four of them)
        assert any("warming up" in line for line in proc.stderr), "the demo ended before generating"
        assert len(marked(mark)) >= 2  # the demo and its verifier
        proc.kill()
        proc.wait()
        assert wait_gone(mark) == []
    finally:
        kill_tree(mark)


@pytest.mark.models
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkilled_serve_leaves_no_ray_workers_behind(target_path):
    pytest.importorskip("ray")
    mark = uuid.uuid4().hex
    proc = start([sys.executable, "-m", "tandem.orchestrator.cli", "serve", "--replicas", "1", "--port", "0",
                  "--http-port", "0", "--threads", "1", "--n-ctx", "512", "--max-sessions", "1",
                  "--target", str(target_path)], mark, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "verifier ready" in proc.stdout.readline()
        assert len(marked(mark)) >= 3  # serve, Ray's own processes, the replica's worker
        proc.kill()
        proc.wait()
        # the raylet shares serve's fate; the agents it starts would poll for it for minutes: the reaper ends them
        # (the reaper itself lingers QUIET_S = 10 s after the last one; on a loaded 2-core machine Ray's teardown
        # has taken longer); Ray's agents overwrite the mark in their environment: the reaper's tree snapshot finds them
        left = wait_gone(mark, timeout_s=30.0)
        assert left == [], [describe(p) for p in left]
    finally:
        kill_tree(mark)
