"""The smallest pure-Python 4-byte allreduce over TCP: what Python and uvloop cost alone.

    python scripts/minimal_exchange.py              # 5000 exchanges, no busy-wait
    SPIN_US=50 python scripts/minimal_exchange.py   # poll the loop up to 50 µs first

Two processes (a fork), one TCP connection on loopback with TCP_NODELAY, one
``asyncio.BufferedProtocol`` each on uvloop. Per operation each side writes a 16-byte
header and 4 bytes, waits for the peer's 20 bytes, checks the sequence number and adds
the peer's value with numpy: no library, no checks, no deadlines, no failure handling.
Each side prints the mean, p50 and p99 of its per-operation time and its user and system
CPU per operation. docs/benchmarks.md (*Twelfth session*) compares it with
``scripts/op_latency.py`` in the same hour; it is a yardstick, not part of aiocollect.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import struct
import time
from typing import cast

import numpy as np
import uvloop

ITERS = 5000
WARMUP = 300
HEADER = struct.Struct("<QII")  # sequence number, kind, length
FRAME = HEADER.size + 4


class Peer(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.buf = bytearray(1 << 16)
        self.view = memoryview(self.buf)
        self.filled = 0
        self.waiter: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connected.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        waiter = self.waiter
        if self.filled >= FRAME and waiter is not None and not waiter.done():
            waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        pass


async def run(rank: int, port: int) -> None:
    loop = asyncio.get_running_loop()
    if rank == 0:
        accepted: asyncio.Future[Peer] = loop.create_future()

        def factory() -> Peer:
            made = Peer()
            if not accepted.done():
                accepted.set_result(made)
            return made

        server = await loop.create_server(factory, "127.0.0.1", port)
        peer = await accepted
    else:
        for _ in range(200):
            try:
                _, peer = await loop.create_connection(Peer, "127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.01)
        else:
            raise SystemExit("could not connect")
    await peer.connected
    transport = peer.transport
    assert transport is not None
    value = np.zeros(1, np.float32)
    spin = float(os.environ.get("SPIN_US", "0")) * 1e-6

    async def exchange(seq: int) -> None:
        transport.write(HEADER.pack(seq, 1, 4) + value.tobytes())
        if peer.filled < FRAME:
            peer.waiter = loop.create_future()
            if spin:
                end = time.perf_counter() + spin
                # the busy-wait being measured: poll the loop, then sleep on the future
                while not peer.waiter.done() and time.perf_counter() < end:  # noqa: ASYNC110
                    await asyncio.sleep(0)
            await peer.waiter
        got, _, _ = HEADER.unpack_from(peer.buf, 0)
        assert got == seq, (got, seq)
        np.add(value, np.frombuffer(peer.buf, np.float32, 1, HEADER.size), out=value)
        rest = peer.filled - FRAME
        peer.buf[:rest] = peer.buf[FRAME : peer.filled]
        peer.filled = rest

    for i in range(WARMUP):
        await exchange(i)
    lat = np.empty(ITERS)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for i in range(ITERS):
        t = time.perf_counter()
        await exchange(WARMUP + i)
        lat[i] = time.perf_counter() - t
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    us = 1e6 / ITERS
    print(
        f"minimal exchange, side {rank}: mean {wall * us:.1f} us, p50 "
        f"{np.median(lat) * 1e6:.1f}, p99 {np.percentile(lat, 99) * 1e6:.1f}; CPU per op: "
        f"user {(r1.ru_utime - r0.ru_utime) * us:.1f} us, sys "
        f"{(r1.ru_stime - r0.ru_stime) * us:.1f} us",
        flush=True,
    )
    transport.close()
    if rank == 0:
        server.close()


def main() -> None:
    with socket.socket() as probe:  # a free port, picked by the kernel
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    child = os.fork()
    if child == 0:
        try:
            uvloop.run(run(1, port))
        finally:
            os._exit(0)
    uvloop.run(run(0, port))
    os.waitpid(child, 0)


if __name__ == "__main__":
    main()
