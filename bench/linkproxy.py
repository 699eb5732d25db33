"""A userspace link emulator: a TCP proxy that delays each direction of every connection, in order.

This kernel has no ``netem`` qdisc, so the test bed's latency, jitter and loss come from here (bandwidth comes from
``tbf`` on the veth devices, see deploy/netbed.sh). Per direction, each chunk read from one side is written to the
other at

    release = max(previous release, arrival + one_way_ms + U(-jitter_ms, +jitter_ms))

so jitter never reorders bytes (TCP would not either). Loss is modelled by what it costs a TCP stream, not by
dropping packets: a chunk of n segments is hit with probability 1 - (1 - loss)^n and then waits an extra
retransmission timeout (``rto_ms``, Linux's 200 ms minimum) plus another one-way delay (the retransmission); with
order kept, everything behind it waits too — the head-of-line stall a lost segment causes. That is the
approximation: real TCP sometimes recovers faster (fast retransmit, when later segments arrive to trigger it).

A control port answers every connection with one JSON line of byte counters (``up_bytes``: client -> server,
``down_bytes``) and closes; the counters are what the bench reports as bytes on the wire (payload as TCP carries
it: gRPC/HTTP2 framing included, TCP/IP headers not).

    python -m bench.linkproxy --listen 10.203.1.1:7000 --upstream 10.203.2.2:50051 --one-way-ms 40 --jitter-ms 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass

from tandem.core import lifetime

SEGMENT_BYTES = 1448  # TCP payload of one segment at a 1500-byte MTU


@dataclass(frozen=True)
class LinkProfile:
    one_way_ms: float = 0.0
    jitter_ms: float = 0.0  # uniform +-, per chunk, per direction
    loss: float = 0.0  # per-segment loss probability, turned into retransmission stalls
    rto_ms: float = 200.0
    rate_mbit: float = 0.0  # applied by tbf on the veth devices, not here; 0 = unlimited

    @property
    def rtt_ms(self) -> float:
        return 2 * self.one_way_ms


class _Direction:
    """One direction of one connection: read, stamp a release time, write in order."""

    def __init__(self, proxy: "LinkProxy", reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool):
        self.proxy, self.reader, self.writer, self.up = proxy, reader, writer, up
        self.queue: asyncio.Queue = asyncio.Queue()
        self.last_release = 0.0

    def release_time(self, n_bytes: int, now: float) -> float:
        p, rng = self.proxy.profile, self.proxy.rng
        delay = p.one_way_ms + (rng.uniform(-p.jitter_ms, p.jitter_ms) if p.jitter_ms else 0.0)
        if p.loss > 0:
            segments = max(1, math.ceil(n_bytes / SEGMENT_BYTES))
            if rng.random() < 1.0 - (1.0 - p.loss) ** segments:
                delay += p.rto_ms + p.one_way_ms
                self.proxy.stalls += 1
        self.last_release = max(self.last_release, now + max(0.0, delay) / 1000)
        return self.last_release

    async def pump(self) -> None:
        try:
            while data := await self.reader.read(1 << 16):
                await self.queue.put((self.release_time(len(data), time.monotonic()), data))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            await self.queue.put(None)

    async def deliver(self) -> None:
        try:
            while (item := await self.queue.get()) is not None:
                release, data = item
                if (wait := release - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                self.writer.write(data)
                await self.writer.drain()
                if self.up:
                    self.proxy.up_bytes += len(data)
                else:
                    self.proxy.down_bytes += len(data)
        except ConnectionError:
            pass
        finally:
            self.writer.close()


class LinkProxy:
    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], profile: LinkProfile,
                 control: tuple[str, int] | None = None, seed: int = 0):
        self.listen, self.upstream, self.profile, self.control = listen, upstream, profile, control
        self.rng = random.Random(seed)
        self.up_bytes = self.down_bytes = self.stalls = self.connections = 0
        self._servers: list[asyncio.AbstractServer] = []

    def counters(self) -> dict:
        return {"up_bytes": self.up_bytes, "down_bytes": self.down_bytes, "stalls": self.stalls,
                "connections": self.connections, "profile": asdict(self.profile)}

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self.connections += 1
        up = _Direction(self, reader, up_writer, up=True)
        down = _Direction(self, up_reader, writer, up=False)
        await asyncio.gather(up.pump(), up.deliver(), down.pump(), down.deliver())

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write((json.dumps(self.counters()) + "\n").encode())
        await writer.drain()
        writer.close()

    async def start(self) -> int:
        """Start listening; returns the bound port of the proxy (``listen`` may use port 0)."""
        server = await asyncio.start_server(self._client, *self.listen)
        self._servers.append(server)
        if self.control:
            self._servers.append(await asyncio.start_server(self._control, *self.control))
        return server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for s in self._servers:
            s.close()


def read_counters(control: tuple[str, int], timeout_s: float = 5.0) -> dict:
    """The proxy's byte counters, from its control port."""
    import socket
    with socket.create_connection(control, timeout=timeout_s) as s:
        return json.loads(s.makefile().readline())


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", required=True, type=_addr)
    ap.add_argument("--upstream", required=True, type=_addr)
    ap.add_argument("--control", type=_addr, default=None)
    ap.add_argument("--one-way-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--rto-ms", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    lifetime.bind_to_parent()
    proxy = LinkProxy(args.listen, args.upstream, LinkProfile(args.one_way_ms, args.jitter_ms, args.loss,
                                                              args.rto_ms), args.control, args.seed)

    async def run():
        port = await proxy.start()
        print(f"link proxy on {args.listen[0]}:{port} -> {args.upstream[0]}:{args.upstream[1]}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
