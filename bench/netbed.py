"""The network test bed from Python: namespaces (deploy/netbed.sh), the link proxy, commands run inside a
namespace pinned to CPU cores.

    with NetBed() as bed:                 # refuses with NetBedUnavailable where namespaces are not permitted
        bed.rate(20)                      # tbf, both directions
        server = bed.spawn("cloud", [...], cpus="1")
        proxy = bed.start_proxy(LinkProfile(40, 5), upstream_port=50051)
        ...
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.core import lifetime

from .linkproxy import LinkProfile

SCRIPT = Path(__file__).resolve().parent.parent / "deploy" / "netbed.sh"
NAMESPACES = {"edge": "tdm-edge", "link": "tdm-link", "cloud": "tdm-cloud"}
EDGE_SIDE, CLOUD_ADDR = "10.203.1.1", "10.203.2.2"  # the proxy listens on EDGE_SIDE; the verifier binds CLOUD_ADDR
PROXY_PORT, CONTROL_PORT = 7000, 7001
# The namespaces have fixed names: one bed per machine. Held for the bed's life, so that a second user (a test
# while a bench runs) is refused instead of tearing the first one's namespaces down under it.
LOCK = Path("/run/lock/tandem-netbed.lock") if Path("/run/lock").is_dir() else Path("/tmp/tandem-netbed.lock")


class NetBedUnavailable(RuntimeError):
    """Namespaces cannot be created here (not root, or no CAP_NET_ADMIN / CAP_SYS_ADMIN, e.g. an unprivileged
    container)."""


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True)


def check() -> None:
    r = _script("check")
    if r.returncode != 0:
        raise NetBedUnavailable((r.stderr or r.stdout).strip() or f"{SCRIPT} check failed ({r.returncode})")


@dataclass
class Proxy:
    process: subprocess.Popen
    address: str  # what the edge connects to
    control: tuple[str, int]  # byte counters (bench.linkproxy.read_counters), reachable from the edge namespace

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()


def wait_port(address: tuple[str, int], namespace: str | None = None, timeout_s: float = 30.0) -> None:
    """Wait until something listens at ``address`` (seen from ``namespace``)."""
    probe = ("import socket,sys;s=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=1);s.close()")
    deadline = time.monotonic() + timeout_s
    while True:
        cmd = [sys.executable, "-c", probe, address[0], str(address[1])]
        if namespace:
            cmd = ["ip", "netns", "exec", NAMESPACES[namespace], *cmd]
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens at {address[0]}:{address[1]} after {timeout_s:.0f} s")
        time.sleep(0.2)


class NetBed:
    def __init__(self):
        self._procs: list[subprocess.Popen] = []
        self._lock = None

    def __enter__(self) -> "NetBed":
        check()
        self._lock = open(LOCK, "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise NetBedUnavailable(f"the network bed is in use by another process (lock {LOCK})") from None
        r = _script("up")
        if r.returncode != 0:
            _script("down")
            self._release()
            raise NetBedUnavailable(f"setting up the bed failed: {r.stderr.strip()}")
        return self

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file drops the lock
            self._lock = None

    def __exit__(self, *exc) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        _script("down")
        self._release()

    def rate(self, mbit: float) -> None:
        r = _script("rate", str(int(mbit)))
        if r.returncode != 0:
            raise RuntimeError(f"tbf failed: {r.stderr.strip()}")

    @staticmethod
    def command(namespace: str, argv: list[str], cpus: str | None = None) -> list[str]:
        """``argv`` run inside ``namespace`` (edge | link | cloud), pinned to ``cpus`` (taskset list) if given."""
        pin = ["taskset", "-c", cpus] if cpus else []
        return ["ip", "netns", "exec", NAMESPACES[namespace], *pin, *argv]

    def spawn(self, namespace: str, argv: list[str], cpus: str | None = None, **popen) -> subprocess.Popen:
        env = lifetime.child_env(dict(os.environ, PYTHONUNBUFFERED="1"))  # dies with this process
        p = subprocess.Popen(self.command(namespace, argv, cpus), env=env, **popen)
        self._procs.append(p)
        return p

    def start_proxy(self, profile: LinkProfile, upstream_port: int, seed: int = 0) -> Proxy:
        p = self.spawn("link", [sys.executable, "-m", "bench.linkproxy", "--listen", f"{EDGE_SIDE}:{PROXY_PORT}",
                                "--upstream", f"{CLOUD_ADDR}:{upstream_port}",
                                "--control", f"{EDGE_SIDE}:{CONTROL_PORT}",
                                "--one-way-ms", str(profile.one_way_ms), "--jitter-ms", str(profile.jitter_ms),
                                "--loss", str(profile.loss), "--rto-ms", str(profile.rto_ms), "--seed", str(seed)],
                       stdout=subprocess.DEVNULL)
        wait_port((EDGE_SIDE, CONTROL_PORT), "link")
        return Proxy(p, f"{EDGE_SIDE}:{PROXY_PORT}", (EDGE_SIDE, CONTROL_PORT))
