"""TCP store specifics: authentication, hostile input, server death, multiplexing."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from aiocollect.errors import AuthenticationError, StoreError, StoreTimeout
from aiocollect.store import TCPStore, TCPStoreServer, _wire
from tests.support.store import settle

pytestmark = pytest.mark.timeout(30)


async def _client(server: TCPStoreServer, **kwargs: object) -> TCPStore:
    store = TCPStore("127.0.0.1", server.port, timeout=20, **kwargs)  # type: ignore[arg-type]
    await store.connect()
    return store


async def test_port_zero_and_address(tcp_server: TCPStoreServer) -> None:
    assert tcp_server.port > 0
    assert tcp_server.address == f"127.0.0.1:{tcp_server.port}"


async def test_wrong_secret_rejected_server_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with TCPStoreServer("127.0.0.1", 0, secret=b"right") as server:
        good = await _client(server, secret=b"right")
        await good.set("k", b"v")
        with caplog.at_level(logging.WARNING, logger="aiocollect.store.tcp"):
            bad = TCPStore("127.0.0.1", server.port, secret=b"wrong")
            with pytest.raises(AuthenticationError):
                await bad.connect()
            await bad.close()
        assert any("failed authentication" in r.getMessage() for r in caplog.records)
        assert await good.get("k") == b"v"
        other = await _client(server, secret="right")  # str secrets are UTF-8
        assert await other.get("k") == b"v"
        await good.close()
        await other.close()


async def test_missing_secret_on_either_side() -> None:
    async with TCPStoreServer("127.0.0.1", 0, secret=b"s") as server:
        with pytest.raises(AuthenticationError, match="requires a secret"):
            await TCPStore("127.0.0.1", server.port).connect()
    async with TCPStoreServer("127.0.0.1", 0) as server:
        with pytest.raises(AuthenticationError, match="does not require a secret"):
            await TCPStore("127.0.0.1", server.port, secret=b"s").connect()


async def _raw_connection(
    server: TCPStoreServer,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection past the handshake of an open server (a secret server: at its proof)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    hello = await _wire.read_frame(reader, _wire.MAX_HANDSHAKE_FRAME)
    assert hello[0] == _wire.MAGIC
    if hello[2] is None:
        writer.writelines(_wire.encode(_wire.NO_PROOF))
    return reader, writer


async def _assert_closed_by_server(reader: asyncio.StreamReader, secret: bytes | None) -> None:
    """The server closes the connection (a secret server first says the proof failed)."""
    try:
        rest = await asyncio.wait_for(reader.read(), 10)  # returns only at end of stream
    except ConnectionResetError:
        return
    if secret is None:
        assert rest == b""
    elif rest:
        assert _wire.decode(rest[4:])[0] is False


GARBAGE = {
    "not-msgpack": b"\x00\x00\x00\x03\xc1\xc1\xc1",
    "trailing-bytes": b"\x00\x00\x00\x02\x01\x02",
    "not-a-list": b"\x00\x00\x00\x01\x05",
    "unknown-op": b"".join(_wire.encode([1, "explode", "k"])),
    "bad-arg-types": b"".join(_wire.encode([1, "set", 5, "not bytes"])),
    "huge-length": b"\xff\xff\xff\xff" + b"x" * 100,
    "plain-text": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
}


@pytest.mark.parametrize("payload", list(GARBAGE.values()), ids=list(GARBAGE))
@pytest.mark.parametrize("secret", [None, b"s"], ids=["open", "secret"])
async def test_garbage_closes_only_that_connection(payload: bytes, secret: bytes | None) -> None:
    async with TCPStoreServer("127.0.0.1", 0, secret=secret) as server:
        good = await _client(server, secret=secret)
        pending = asyncio.create_task(good.get("later", timeout=20))
        await settle(good)
        reader, writer = await _raw_connection(server)
        writer.write(payload)
        await _assert_closed_by_server(reader, secret)
        writer.close()
        await good.set("later", b"ok")
        assert await pending == b"ok"
        fresh = await _client(server, secret=secret)
        assert await fresh.get("later") == b"ok"
        await good.close()
        await fresh.close()


async def test_server_limits_message_size() -> None:
    async with TCPStoreServer("127.0.0.1", 0, max_frame=4096) as server:
        store = await _client(server)
        await store.set("small", b"x" * 100)
        with pytest.raises(StoreError) as info:
            await store.set("big", b"x" * 8192)
        assert not isinstance(info.value, StoreTimeout)
        with pytest.raises(StoreError):  # that connection is gone for good
            await store.get("small")
        other = await _client(server)
        assert await other.get("small") == b"x" * 100
        await store.close()
        await other.close()


async def test_client_refuses_oversized_request(tcp_server: TCPStoreServer) -> None:
    store = await _client(tcp_server, max_frame=1024)
    with pytest.raises(StoreError, match="exceeds the limit"):
        await store.set("big", b"x" * 2048)
    await store.set("small", b"fine")  # nothing was sent; the connection is intact
    assert await store.get("small") == b"fine"
    await store.close()


async def test_server_close_fails_pending_promptly() -> None:
    server = TCPStoreServer("127.0.0.1", 0)
    await server.start()
    store = await _client(server)
    pending = [asyncio.create_task(store.get(f"never-{i}", timeout=25)) for i in range(5)]
    pending.append(asyncio.create_task(store.wait(["a", "b"], timeout=25)))  # type: ignore[arg-type]
    await settle(store)
    start = time.monotonic()
    await server.close()
    for task in pending:
        with pytest.raises(StoreError, match="lost") as info:
            await asyncio.wait_for(task, 10)
        assert not isinstance(info.value, StoreTimeout)
    assert time.monotonic() - start < 5
    with pytest.raises(StoreError, match="lost"):
        await store.set("k", b"v")
    await store.close()


async def test_many_concurrent_requests_are_multiplexed(tcp_server: TCPStoreServer) -> None:
    reader_side = await _client(tcp_server)
    writer_side = await _client(tcp_server)
    keys = [f"key-{i}" for i in range(200)]
    getters = [asyncio.create_task(reader_side.get(k)) for k in keys]
    await settle(reader_side)
    assert not any(t.done() for t in getters)
    for i, k in reversed(list(enumerate(keys))):
        await writer_side.set(k, str(i).encode())
    assert await asyncio.gather(*getters) == [str(i).encode() for i in range(200)]
    await reader_side.close()
    await writer_side.close()


async def test_cancelled_get_leaves_client_usable(tcp_server: TCPStoreServer) -> None:
    store = await _client(tcp_server)
    task = asyncio.create_task(store.get("cancelled", timeout=20))
    await settle(store)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await store.set("cancelled", b"v")
    assert await store.get("cancelled") == b"v"
    assert await store.add("n", 2) == 2
    await store.close()


async def test_lazy_connect_and_refused_connection(tcp_server: TCPStoreServer) -> None:
    store = TCPStore("127.0.0.1", tcp_server.port)
    await store.set("lazy", b"1")  # connects on first use
    assert await store.get("lazy") == b"1"
    await store.close()
    port = tcp_server.port
    await tcp_server.close()
    with pytest.raises(StoreError, match=f"127.0.0.1:{port}"):
        await TCPStore("127.0.0.1", port).connect()


async def test_not_a_store() -> None:
    async def fake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.writelines(_wire.encode(["something-else", 1, None]))
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(fake, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = TCPStore("127.0.0.1", port)
    with pytest.raises(StoreError, match="not an aiocollect TCP store"):
        await store.connect()
    await store.close()
    server.close()
    await server.wait_closed()


async def test_multi_get_answer_is_bounded_by_the_frame_limit() -> None:
    async with TCPStoreServer("127.0.0.1", 0, max_frame=256 * 1024) as server:
        store = await _client(server)
        try:
            for i in range(3):
                await store.set(f"v{i}", bytes(100 * 1024))
            assert await store.multi_get(["v0", "v1"]) == [bytes(100 * 1024)] * 2
            with pytest.raises(StoreError, match="ask for fewer keys"):
                await store.multi_get(["v0", "v1", "v2"])
            assert await store.get("v2") == bytes(100 * 1024)  # the connection goes on
        finally:
            await store.close()


async def test_multi_get_from_a_version_2_server_uses_wait_and_get(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_wire, "VERSION", 2)  # the server's hello says 2
    async with TCPStoreServer("127.0.0.1", 0) as server:
        store = await _client(server)
        monkeypatch.setattr(_wire, "OPS", _wire.OPS - {"multi_get"})  # and it lacks the op
        try:
            waiter = asyncio.ensure_future(store.multi_get(["a", "b"], timeout=10))
            await settle(store)
            await store.set("a", b"1")
            await store.set("b", b"2")
            assert await waiter == [b"1", b"2"]
            with pytest.raises(StoreTimeout) as err:
                await store.multi_get(["a", "never"], timeout=0.1)
            assert err.value.keys == ["never"]
        finally:
            await store.close()
