"""The socket of ``auto`` and ``shm`` links between ranks on one host is a Unix socket
(aiocollect.transport.unix): what uses it, what does not, the fallback to TCP loopback when
it cannot connect, strangers at it, and its end with the group.

Real processes (``spawn_ranks``) and real sockets; ranks on one loop (``run_ranks``) where
a test rewrites the records they read (``RecordView``, the fault proxy's store view)."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import msgpack
import numpy as np
import pytest

import aiocollect as ac
from aiocollect.store import MemoryStore
from aiocollect.testing import run_ranks, spawn_ranks
from aiocollect.testing.proxynet import RecordView
from aiocollect.transport import unix
from tests.support.fakepeer import u32
from tests.support.targets import shm as targets

pytestmark = pytest.mark.timeout(60)


def _ranks_sums(world: int) -> list[float]:
    total = float(sum(range(1, world + 1)))
    return [total]


@pytest.mark.parametrize("uvloop", [False, True])
@pytest.mark.parametrize("transport", ["auto", "shm"])
async def test_links_on_one_host_use_unix_sockets(uvloop: bool, transport: str) -> None:
    """Three processes: every link's socket is a Unix socket, the link names the peer's
    pid as the kernel reports it, shared memory runs over it, and results are right."""
    res = await spawn_ranks(3, targets.link_sockets, timeout=60, uvloop=uvloop, transport=transport)
    pids = [r["pid"] for r in res]
    for rank, r in enumerate(res):
        assert r["sums"] == _ranks_sums(3), r
        assert sorted(r["links"]) == [p for p in range(3) if p != rank]
        for peer, (family, described, in_shm) in r["links"].items():
            assert family == "AF_UNIX", (rank, peer, described)
            assert f"unix socket, pid {pids[peer]}" in described, (rank, peer, described)
            assert in_shm, (rank, peer, described)


async def test_unix_sockets_off_keeps_tcp_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """AIOCOLLECT_UNIX_SOCKET=0 (inherited by the ranks): TCP loopback, shared memory
    still."""
    monkeypatch.setenv(unix.UNIX_ENV, "0")
    res = await spawn_ranks(2, targets.link_sockets, timeout=60, transport="auto")
    for r in res:
        assert r["sums"] == _ranks_sums(2), r
        for family, described, in_shm in r["links"].values():
            assert family == "AF_INET", r
            assert "127.0.0.1:" in described, r
            assert in_shm, r


async def test_the_tcp_transport_never_uses_unix_sockets() -> None:
    res = await spawn_ranks(2, targets.link_sockets, timeout=60, transport="tcp")
    for r in res:
        assert r["sums"] == _ranks_sums(2), r
        for family, _, in_shm in r["links"].values():
            assert family == "AF_INET", r
            assert not in_shm, r


async def _with_records(value: object, transport: str = "auto") -> list[dict[str, Any]]:
    """Two ranks on this loop whose records' ``unix`` read back as ``value`` (removed when
    None): the links they made and an allreduce's result."""
    inner = MemoryStore(f"unix-rewrite-{id(value)}")

    async def rewrite(key: str, raw: bytes) -> bytes:
        rec = msgpack.unpackb(raw, raw=False)
        if "unix" in rec:
            if value is None:
                del rec["unix"]
            else:
                rec["unix"] = value
        return bytes(msgpack.packb(rec, use_bin_type=True))

    return await run_ranks(
        2,
        targets.link_sockets,
        transport=transport,
        store=lambda rank: RecordView(inner, rewrite),
        timeout=30,
    )


@pytest.mark.both_loops
@pytest.mark.parametrize(
    "value",
    [f"{unix.PREFIX}0-0123456789abcdef", None],
    ids=["nobody-listens", "not-offered"],
)
async def test_a_unix_socket_that_does_not_connect_falls_back_to_tcp(value: object) -> None:
    """A peer on this host whose Unix socket cannot be reached (another network
    namespace has other abstract names; here: a name nobody listens on) or which offers
    none: the link is made over TCP loopback and moves to shared memory as before."""
    for r in await _with_records(value):
        assert r["sums"] == _ranks_sums(2), r
        for family, _, in_shm in r["links"].values():
            assert family == "AF_INET", r
            assert in_shm, r


@pytest.mark.both_loops
@pytest.mark.parametrize(
    "value", [12345, "", "../../tmp/x", f"{unix.PREFIX}\n", unix.PREFIX + "x" * 200, b"\0abc"]
)
async def test_a_malformed_unix_field_is_ignored(value: object) -> None:
    """A record's ``unix`` that this library would not have made is never dialled."""
    for r in await _with_records(value):
        assert r["sums"] == _ranks_sums(2), r
        for family, _, _ in r["links"].values():
            assert family == "AF_INET", r


async def _unix_stranger(name: str, data: bytes) -> bytes:
    """Connect to the abstract Unix socket ``name``, send ``data``, half-close and read
    until the rank closes the connection."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    await loop.sock_connect(sock, "\0" + name)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        writer.write(data)
        writer.write_eof()
        async with asyncio.timeout(10):
            return await reader.read()
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


STRANGERS = {
    "garbage": u32(5) + b"\xc1" * 5,
    "an HTTP request": b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "huge length prefix": u32(0xFFFFFFFF) + b"x" * 64,
}


@pytest.mark.both_loops
@pytest.mark.parametrize("kind", sorted(STRANGERS))
async def test_a_stranger_at_the_unix_socket_is_closed_and_the_group_forms(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A process of this host connecting to a rank's Unix socket gets what a stranger at
    its TCP port gets: the handshake refuses it, the rank logs it, the group forms."""
    caplog.set_level(logging.WARNING, "aiocollect")
    name = f"unix-stranger-{kind.replace(' ', '-')}"
    store = MemoryStore(name)

    async def rank(r: int) -> float:
        async with ac.open_group(r, 2, store=store, transport="auto", timeout=20, name=name) as g:
            buf = np.full(4, r + 1.0)
            await g.allreduce(buf)
            return float(buf[0])

    rank0 = asyncio.ensure_future(rank(0))
    try:
        rec = msgpack.unpackb(await store.get(f"aiocollect/{name}/rank/0", timeout=20))
        assert unix.valid_name(rec.get("unix")), rec
        await _unix_stranger(rec["unix"], STRANGERS[kind])
        assert await asyncio.gather(rank0, rank(1)) == [3.0, 3.0]
    finally:
        rank0.cancel()
    rejected = [r for r in caplog.records if "rejected an incoming connection" in r.message]
    assert len(rejected) == 1, [r.message for r in caplog.records]


@pytest.mark.both_loops
async def test_the_unix_socket_ends_with_the_group() -> None:
    """Once the group is closed its listener's abstract name is gone: connecting is
    refused (nothing to clean up, nothing left listening)."""
    store = MemoryStore("unix-ends")
    found: list[object] = []

    async def body(g: ac.Group) -> None:
        rec = msgpack.unpackb(await store.get(f"aiocollect/unix-ends/rank/{g.rank}", timeout=5))
        found.append(rec.get("unix"))
        await g.barrier()

    await run_ranks(2, body, transport="auto", store=store, name="unix-ends", timeout=30)
    assert all(unix.valid_name(n) for n in found), found
    loop = asyncio.get_running_loop()
    for name in found:
        assert isinstance(name, str)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            with pytest.raises(ConnectionRefusedError):
                await loop.sock_connect(sock, "\0" + name)
        finally:
            sock.close()


def test_unix_sockets_setting() -> None:
    assert unix.enabled({}) == unix.enabled({unix.UNIX_ENV: "1"})
    assert unix.describe({}) == "unix sockets"
    for off in ("0", "false", "No", " off "):
        assert not unix.enabled({unix.UNIX_ENV: off})
        assert unix.describe({unix.UNIX_ENV: off}) == f"tcp sockets: {unix.UNIX_ENV}={off.strip()}"
    assert unix.valid_name(f"{unix.PREFIX}12-ab")
    for bad in (None, 3, "", "x", f"{unix.PREFIX}\0", unix.PREFIX + "y" * 100):
        assert not unix.valid_name(bad)
