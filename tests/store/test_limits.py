"""A TCP store a client cannot exhaust: bounded decoding, first-frame and idle timeouts, a
shared budget for large frames in flight, a quota of stored bytes and keys, a connection
cap. Attacks go over real sockets to a real server; the server's loop is watched by a
ticker in the same loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import msgpack
import pytest

from aiocollect import _protect
from aiocollect.errors import ProtocolError, StoreError, UsageError
from aiocollect.store import TCPStore, TCPStoreServer, _wire
from tests.support.store import Ticker, settle

pytestmark = pytest.mark.timeout(60)


async def _client(server: TCPStoreServer) -> TCPStore:
    store = TCPStore("127.0.0.1", server.port, timeout=20)
    await store.connect()
    return store


async def _raw(server: TCPStoreServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection past the (no-secret) handshake."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    await _wire.read_frame(reader, _wire.MAX_HANDSHAKE_FRAME)
    writer.writelines(_wire.encode(_wire.NO_PROOF))
    return reader, writer


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> float:
    """Seconds until the server closed the connection (fails past ``seconds``)."""
    start = time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        await asyncio.wait_for(reader.read(), seconds)
    return time.monotonic() - start


def _bomb() -> bytes:
    """One 8 MiB frame of 8 Mi empty arrays (decoded naively: seconds, ~600 MiB)."""
    n = 8 * 1024 * 1024
    body = b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    return _wire.HEADER.pack(len(body)) + body


def _nested_bomb() -> bytes:
    """The same amount as 128 arrays of 65535 empty arrays (passes per-array limits)."""
    inner = b"\xdc" + (65535).to_bytes(2, "big") + b"\x90" * 65535
    body = b"\xdc" + (128).to_bytes(2, "big") + inner * 128
    return _wire.HEADER.pack(len(body)) + body


def _send_blocking(port: int, data: bytes) -> None:
    """Send ``data`` after the handshake from a thread (the loop only serves it)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        (size,) = _wire.HEADER.unpack(sock.recv(4, socket.MSG_WAITALL))
        sock.recv(size, socket.MSG_WAITALL)
        sock.sendall(b"".join(_wire.encode(_wire.NO_PROOF)))
        try:
            sock.sendall(data)
            while sock.recv(65536):
                pass
        except OSError:
            pass  # reset by the server: what we expect


@pytest.mark.parametrize("frame", [_bomb, _nested_bomb], ids=["flat", "nested"])
async def test_amplification_frame_is_refused_without_blocking_the_loop(
    tcp_server: TCPStoreServer, frame: object
) -> None:
    data = frame()  # type: ignore[operator]
    good = await _client(tcp_server)
    await good.set("k", b"v")
    ticker = Ticker()
    await asyncio.to_thread(_send_blocking, tcp_server.port, data)
    worst = await ticker.stop()
    assert worst < 0.050, f"the loop was busy for {worst * 1000:.1f} ms in one go"
    assert await good.get("k") == b"v"  # the others are served as before
    await good.close()


def test_decode_bounds_what_a_frame_expands_to() -> None:
    for body in (
        _bomb()[4:],
        _nested_bomb()[4:],
        msgpack.packb([[[1]]]),
        msgpack.packb({"a": 1}),
        msgpack.packb(msgpack.ExtType(1, b"x")),
        msgpack.packb([1, "wait", ["k"] * (_wire.MAX_KEYS + 17), 1.0]),
        msgpack.packb(["x" * (_wire.MAX_KEY_BYTES + 1)]),
    ):
        started = time.thread_time()
        with pytest.raises(ProtocolError):
            _wire.decode(body)
        assert time.thread_time() - started < 0.1
    legit = [7, "wait", [f"k{i}" for i in range(_wire.MAX_KEYS)], 2.5]
    assert _wire.decode(msgpack.packb(legit)) == legit
    # A frame still arriving is refused on its first bytes, accepted while it may be fine.
    with pytest.raises(ProtocolError):
        _wire.check_shape(_bomb()[4:4096], partial=True)
    _wire.check_shape(msgpack.packb(legit)[:1000], partial=True)


async def test_silent_and_stalled_connections_are_closed() -> None:
    """Connections that never finish their first frame, or stop mid-frame, are closed
    after the timeouts; a client idle between requests is not."""
    async with TCPStoreServer("127.0.0.1", 0, handshake_timeout=0.5, idle_timeout=0.5) as server:
        idle = await _client(server)
        silent_r, silent_w = await asyncio.open_connection("127.0.0.1", server.port)
        stalled = []
        for _ in range(50):  # 2 bytes of a header, then nothing
            reader, writer = await _raw(server)
            writer.write(b"\x00\x00")
            stalled.append((reader, writer))
        half_r, half_w = await _raw(server)  # a large frame, half sent
        half_w.write(_wire.HEADER.pack(1 << 20) + b"\x94" + b"\x00" * 1000)
        assert await _closed_within(silent_r, 5) < 5
        for reader, _ in stalled:
            assert await _closed_within(reader, 5) < 5
        assert await _closed_within(half_r, 5) < 5
        assert server._budget.used == 0
        await asyncio.sleep(0.7)  # longer than both timeouts, between two requests
        await idle.set("still", b"here")
        assert await idle.get("still") == b"here"
        for _, writer in [*stalled, (silent_r, silent_w), (half_r, half_w)]:
            writer.close()
        await idle.close()


async def test_large_frames_in_flight_share_a_budget() -> None:
    """Four half-sent large frames hold at most ``max_inflight``; small requests pass them;
    a legitimate large one waits its turn and completes once the stalled ones are cut."""
    async with TCPStoreServer("127.0.0.1", 0, max_inflight=2 << 20, idle_timeout=1.0) as server:
        hogs = []
        for _ in range(4):
            reader, writer = await _raw(server)
            writer.write(_wire.HEADER.pack(1 << 20) + b"\x94\x01\xa3set" + b"\x00" * 4096)
            hogs.append((reader, writer))
        good = await _client(server)
        await good.set("small", b"s")  # never waits behind large frames
        assert server._budget.used <= 2 << 20
        big = asyncio.create_task(good.set("big", b"b" * (1 << 20)))
        await asyncio.wait_for(big, 10)  # the hogs are cut after 1 s of silence
        assert await good.get("big") == b"b" * (1 << 20)
        for reader, writer in hogs:
            assert await _closed_within(reader, 5) < 5
            writer.close()
        assert server._budget.used == 0
        await good.close()


async def test_quota_refuses_the_client_that_exceeds_it() -> None:
    async with TCPStoreServer("127.0.0.1", 0, max_bytes=1000, max_keys=3) as server:
        a = await _client(server)
        b = await _client(server)
        await a.set("a", b"x" * 600)
        with pytest.raises(StoreError, match=r"quota exceeded.*1000 bytes"):
            await b.set("b", b"y" * 600)
        await b.set("b", b"y" * 100)  # the connection is still good
        await a.set("a", b"x" * 300)  # overwriting counts the new size only
        await b.set("c", b"z" * 500)
        with pytest.raises(StoreError, match=r"quota exceeded.*3 keys"):
            await b.add("counter", 1)
        assert await a.delete("c")
        assert await b.add("counter", 5) == 5
        with pytest.raises(StoreError, match="quota exceeded"):
            await a.set("d", b"")
        assert await a.get("a") == b"x" * 300
        await a.close()
        await b.close()


async def test_connection_cap_refuses_with_a_message() -> None:
    async with TCPStoreServer("127.0.0.1", 0, max_connections=2) as server:
        first, second = await _client(server), await _client(server)
        with pytest.raises(StoreError, match="at most 2 connections"):
            await _client(server)
        await first.close()
        await settle(second)
        third = await _client(server)  # room again
        await third.set("k", b"v")
        await second.close()
        await third.close()


async def test_client_refuses_requests_beyond_the_wire_limits(tcp_server: TCPStoreServer) -> None:
    store = await _client(tcp_server)
    with pytest.raises(UsageError, match="at most 16384 keys"):
        await store.wait([f"k{i}" for i in range(_wire.MAX_KEYS + 1)], timeout=1)
    with pytest.raises(UsageError, match="at most 65536 bytes"):
        await store.set("k" * (_wire.MAX_KEY_BYTES + 1), b"v")
    await store.set("k", b"fine")  # nothing was sent
    assert await store.get("k") == b"fine"
    await store.close()


def test_is_local() -> None:
    assert _protect.is_local(("127.0.0.5", 1), ("127.0.0.1", 2))
    assert _protect.is_local(("::1", 1, 0, 0), ("::1", 2, 0, 0))
    assert _protect.is_local(("::ffff:127.0.0.1", 1, 0, 0), ("::", 2, 0, 0))
    assert _protect.is_local(("10.1.2.3", 1), ("10.1.2.3", 2))  # this host's own address
    assert not _protect.is_local(("10.1.2.4", 1), ("10.1.2.3", 2))
    assert not _protect.is_local(("fe80::1%eth0", 1, 0, 2), ("fe80::2%eth0", 2, 0, 2))
    assert not _protect.is_local(("0.0.0.0", 1), ("0.0.0.0", 2))
    assert not _protect.is_local(("not an ip", 1), ("10.1.2.3", 2))
    message = _protect.refusal("the store", ("10.1.2.4", 1))
    assert "10.1.2.4" in message
    assert "AIOCOLLECT_SECRET" in message
    assert "AIOCOLLECT_INSECURE=1" in message
    assert _protect.insecure_from_env({"AIOCOLLECT_INSECURE": "1"})
    assert not _protect.insecure_from_env({"AIOCOLLECT_INSECURE": "0"})
    assert not _protect.insecure_from_env({})


async def test_stranger_address_is_refused_and_told_how_to_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refusal path end to end on loopback (a stand-in for another host: is_local
    says no); with insecure=True the same connection is served."""
    monkeypatch.setattr(_protect, "is_local", lambda peer, local: False)
    async with TCPStoreServer("127.0.0.1", 0) as server:
        with pytest.raises(StoreError, match=r"protected mode.*AIOCOLLECT_SECRET"):
            await _client(server)
        assert len(server._table) == 0
    async with TCPStoreServer("127.0.0.1", 0, insecure=True) as server:
        store = await _client(server)
        await store.set("k", b"v")
        await store.close()
    async with TCPStoreServer("127.0.0.1", 0, secret=b"s") as server:  # a secret: served
        store = TCPStore("127.0.0.1", server.port, secret=b"s", timeout=20)
        await store.set("k", b"v")
        await store.close()


async def test_pending_waits_per_connection_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiocollect.store import tcp_server

    monkeypatch.setattr(tcp_server, "MAX_PENDING_WAITS", 3)
    async with TCPStoreServer("127.0.0.1", 0) as server:
        store = await _client(server)
        waits = [asyncio.create_task(store.get(f"later-{i}", timeout=20)) for i in range(3)]
        await settle(store)
        with pytest.raises(StoreError, match="too many waits pending"):
            await store.get("one-more", timeout=20)
        await store.set("later-0", b"x")
        assert await waits[0] == b"x"
        await store.set("now", b"y")
        assert await store.get("now") == b"y"  # answered at once, no wait needed
        again = asyncio.create_task(store.get("later-3", timeout=20))  # a slot is free
        await settle(store)
        await store.set("later-3", b"z")
        assert await again == b"z"
        for task in waits[1:]:
            task.cancel()
        await asyncio.gather(*waits[1:], return_exceptions=True)
        await store.close()
