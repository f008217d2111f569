"""The fault proxy on its own, against an echo server: byte order under jitter, delay,
emulated loss, stall/resume at a byte offset, cut by reset or by close."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import pytest

from aiocollect.testing.faultproxy import FaultProxy, LinkFaults

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def echo() -> AsyncIterator[tuple[str, int]]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[:2]
    server.close()
    await server.wait_closed()


async def _roundtrip(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes
) -> bytes:
    async def send() -> None:
        writer.write(payload)
        await writer.drain()

    sender = asyncio.ensure_future(send())
    got = await reader.readexactly(len(payload))
    await sender
    return got


async def test_order_kept_under_jitter_and_loss(echo: tuple[str, int]) -> None:
    faults = LinkFaults(delay=0.002, jitter=0.010, loss=0.2, rto=0.02)
    async with FaultProxy(*echo, faults=faults, seed=5, segment_bytes=4096) as proxy:
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        payload = os.urandom(2 << 20)
        assert await _roundtrip(reader, writer, payload) == payload
        stats = proxy.statistics()
        assert stats["forwarded"] == {"forward": len(payload), "reverse": len(payload)}
        assert stats["lost"]["forward"] > 0
        assert stats["lost"]["reverse"] > 0
        writer.close()


async def test_delay_applies_per_direction(echo: tuple[str, int]) -> None:
    async with FaultProxy(
        *echo, faults=LinkFaults(delay=0.040), reverse=LinkFaults(delay=0.010)
    ) as proxy:
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        await _roundtrip(reader, writer, b"warm")
        start = time.monotonic()
        await _roundtrip(reader, writer, b"x")
        rtt = time.monotonic() - start
        assert 0.050 <= rtt < 0.050 + 0.5, rtt
        proxy.set_faults(LinkFaults())
        rtts = []
        for _ in range(5):  # the best of a few: the machine may be busy
            start = time.monotonic()
            await _roundtrip(reader, writer, b"y")
            rtts.append(time.monotonic() - start)
        assert min(rtts) < 0.040, rtts
        writer.close()


async def test_stall_at_a_byte_offset_then_resume(echo: tuple[str, int]) -> None:
    async with FaultProxy(*echo) as proxy:
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        proxy.stall("forward", after_bytes=1000)
        writer.write(b"a" * 5000)
        assert await reader.readexactly(1000) == b"a" * 1000
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(1), 0.2)
        assert proxy.forwarded["forward"] == 1000
        proxy.resume()
        assert await reader.readexactly(4000) == b"a" * 4000
        assert [what for _, what in proxy.fired] == ["stall forward", "resume both"]
        writer.close()


@pytest.mark.parametrize("reset", [True, False])
async def test_cut_resets_or_closes_both_sides(echo: tuple[str, int], reset: bool) -> None:
    async with FaultProxy(*echo) as proxy:
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        await _roundtrip(reader, writer, b"hello")
        proxy.cut(reset=reset, after_bytes=10)
        writer.write(b"z" * 100)
        got = b""

        async def read_to_end() -> None:
            nonlocal got
            while chunk := await reader.read(65536):
                got += chunk

        if reset:
            with pytest.raises(ConnectionResetError):
                await read_to_end()
        else:
            await read_to_end()
        assert len(got) <= 10
        assert sum(proxy.forwarded.values()) == 2 * 5 + 10  # hello both ways, then 10 bytes
        assert proxy.active == 0
        assert proxy.fired[0][1] == ("reset" if reset else "close")
        writer.close()


async def test_refused_target_resets_the_client() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()  # nothing listens there any more
    async with FaultProxy("127.0.0.1", port) as proxy:
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        with pytest.raises(ConnectionResetError):
            await reader.read(1)
        writer.close()
