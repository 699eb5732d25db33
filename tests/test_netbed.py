"""The link emulator (a delaying TCP proxy) on localhost, and the namespace bed where this machine permits it."""
import asyncio
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from bench import netbed
from bench.linkproxy import LinkProfile, LinkProxy


def echo_server():
    """A TCP echo server on a free localhost port (thread)."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(65536), b"")],
                             daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


class ProxyThread:
    def __init__(self, upstream_port, profile, seed=0):
        self.loop = asyncio.new_event_loop()
        self.proxy = LinkProxy(("127.0.0.1", 0), ("127.0.0.1", upstream_port), profile, seed=seed)
        self.port = None
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.port = self.loop.run_until_complete(self.proxy.start())
            ready.set()
            self.loop.run_forever()
            tasks = asyncio.all_tasks(self.loop)  # connections still pumping: cancel them, then close cleanly
            for t in tasks:
                t.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.close()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(5)

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def echo():
    srv, port = echo_server()
    yield port
    srv.close()


def round_trips(port, n, payload=b"x" * 100):
    times = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(payload)
            got = b""
            while len(got) < len(payload):
                got += s.recv(65536)
            times.append((time.perf_counter() - t0) * 1000)
            assert got == payload
    return times


def test_delay_applies_per_direction(echo):
    p = ProxyThread(echo, LinkProfile(one_way_ms=25))
    try:
        rtts = round_trips(p.port, 5)
    finally:
        p.stop()
    assert all(50 <= r < 50 + 40 for r in rtts), rtts
    assert p.proxy.up_bytes == p.proxy.down_bytes == 500


def test_jitter_never_reorders_bytes(echo):
    p = ProxyThread(echo, LinkProfile(one_way_ms=10, jitter_ms=9), seed=3)
    try:
        with socket.create_connection(("127.0.0.1", p.port)) as s:
            sent = b"".join(i.to_bytes(4, "big") for i in range(2000))
            for k in range(0, len(sent), 40):  # many small writes: many chunks with their own jitter
                s.sendall(sent[k:k + 40])
                time.sleep(0.0005)
            got = b""
            while len(got) < len(sent):
                got += s.recv(65536)
    finally:
        p.stop()
    assert got == sent


def test_loss_becomes_retransmission_stalls(echo):
    p = ProxyThread(echo, LinkProfile(one_way_ms=5, loss=1.0, rto_ms=100))
    try:
        rtts = round_trips(p.port, 2)
    finally:
        p.stop()
    # every chunk in both directions waits an RTO plus a second one-way delay
    assert all(r >= 2 * (5 + 100 + 5) for r in rtts), rtts
    assert p.proxy.stalls == 4


def test_refuses_clearly_where_namespaces_are_not_permitted(tmp_path, monkeypatch):
    fake_ip = tmp_path / "ip"
    fake_ip.write_text("#!/bin/sh\necho 'mount --make-shared /run/netns failed: Operation not permitted' >&2\n"
                       "exit 1\n")
    fake_ip.chmod(fake_ip.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(netbed.NetBedUnavailable, match="not permitted here.*Operation not permitted"):
        netbed.check()


def _namespaces_permitted() -> bool:
    try:
        netbed.check()
        return True
    except netbed.NetBedUnavailable:
        return False


@pytest.mark.skipif(not _namespaces_permitted(), reason="network namespaces are not permitted on this machine")
def test_bed_carries_traffic_only_through_the_delayed_link():
    with netbed.NetBed() as bed:
        echo_code = ("import socket;s=socket.create_server(('%s',9000))\nwhile True:\n c,_=s.accept()\n"
                     " for d in iter(lambda:c.recv(65536),b''):c.sendall(d)" % netbed.CLOUD_ADDR)
        bed.spawn("cloud", [sys.executable, "-c", echo_code])
        netbed.wait_port((netbed.CLOUD_ADDR, 9000), "cloud")
        bed.start_proxy(LinkProfile(one_way_ms=20), upstream_port=9000)
        probe = ("import socket,time;s=socket.create_connection(('%s',%d));t=time.perf_counter();s.sendall(b'hi');"
                 "s.recv(10);print((time.perf_counter()-t)*1000)" % (netbed.EDGE_SIDE, netbed.PROXY_PORT))
        rtt = float(subprocess.run(bed.command("edge", [sys.executable, "-c", probe]), capture_output=True,
                                   text=True, check=True).stdout)
        assert 40 <= rtt < 40 + 50, rtt
        # no route around the proxy: the cloud address is unreachable from the edge namespace
        reach = "import socket;socket.create_connection(('%s',9000),timeout=1)" % netbed.CLOUD_ADDR
        direct = subprocess.run(bed.command("edge", [sys.executable, "-c", reach]), capture_output=True, text=True)
        assert direct.returncode != 0
        # one bed per machine: a second one is refused and leaves this one's namespaces alone
        with pytest.raises(netbed.NetBedUnavailable, match="in use by another process"):
            netbed.NetBed().__enter__()
        assert "tdm-edge" in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tdm-edge" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
