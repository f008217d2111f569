"""A hand-driven fake peer for the failure tests, and frame headers with any field values.

``FakePeer`` plays one rank of a group whose other ranks are real: it publishes its own
rendezvous record, connects to the real rank with plain asyncio streams, completes the
handshake with the library's own sans-IO :class:`ConnectorHandshake`, and can then write any
bytes it likes on the established link and read what the real rank sends back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

import aiocollect as ac
from aiocollect._deadline import Deadline
from aiocollect.rendezvous import claims
from aiocollect.rendezvous.handshake import PROTOCOL_VERSION, ConnectorHandshake
from aiocollect.store import MemoryStore, Store
from aiocollect.testing import links_settled
from aiocollect.transport.wire import (
    ABORT,
    DATA,
    HEADER,
    HEADER_SIZE,
    LENGTH_PREFIX,
    MAGIC,
    Header,
    parse_header,
)

CHUNK = 64  # bytes: the fake link's chunk size, so frames are small and many
GROUP_TIMEOUT = 20.0  # the real rank's deadline: every error below must come well before it
PROMPT = 5.0  # "promptly", generous for a noisy 2-core machine; far below GROUP_TIMEOUT


def header(
    kind: int = DATA,
    *,
    magic: int = MAGIC,
    coll: int = 0,
    op: int = 0,
    dtype: int = 0,
    gid: int = 0,
    chunk: int = 0,
    seq: int = 0,
    slot: int = 0,
    root: int = -1,
    elems: int = 0,
    length: int = 0,
) -> bytes:
    """A frame header with any field values (valid or not)."""
    return HEADER.pack(magic, kind, coll, op, dtype, gid, chunk, seq, slot, root, elems, length)


def echo_header(h: Header, **changes: Any) -> bytes:
    """``h`` (a header the real rank sent) with some fields replaced."""
    return HEADER.pack(MAGIC, *h._replace(**changes))


class FakePeer:
    """Rank ``rank`` of group ``name``, driven by hand over a raw TCP stream."""

    def __init__(
        self,
        store: Store,
        name: str,
        *,
        rank: int = 1,
        world_size: int = 2,
        chunk_bytes: int,
        secret: bytes | None = None,
    ) -> None:
        self.store, self.name, self.rank, self.world_size = store, name, rank, world_size
        self.chunk_bytes = chunk_bytes
        self.secret = secret
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def join(self, peer: int = 0, timeout: float = 20.0, rcvbuf: int | None = None) -> None:
        """Publish this rank's record and link to rank ``peer`` (which accepts from us);
        ``rcvbuf`` shrinks our socket's receive buffer (to fill the peer's queue sooner)."""
        record = {
            "v": PROTOCOL_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "transport": "tcp",
            "address": "127.0.0.1",
            "port": 9,
            "hostname": socket.gethostname(),
            "boot_id": "",
            "pid": os.getpid(),
            "chunk_bytes": self.chunk_bytes,
        }
        # Claim the rank and publish like a real rank, so the real ones accept us as theirs.
        claim = await claims.claim(
            self.store, self.name, self.rank, self.world_size, Deadline.after(timeout)
        )
        await claim.publish(record)
        await claim.wait_records(Deadline.after(timeout))
        theirs = await claim.read_record(peer)
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (theirs["address"], theirs["port"]))
        except BaseException:
            sock.close()
            raise
        self.reader, self.writer = await asyncio.open_connection(sock=sock)
        hs = ConnectorHandshake(
            self.name, self.rank, peer, self.world_size, self.secret, job=claim.job
        )
        async with asyncio.timeout(timeout):
            while True:
                replies, done = hs.on_message(await self.read_message())
                for reply in replies:
                    self.write_message(reply)
                if done is not None:
                    return

    async def read_message(self) -> dict[str, Any]:
        assert self.reader is not None
        (n,) = LENGTH_PREFIX.unpack(await self.reader.readexactly(LENGTH_PREFIX.size))
        msg: dict[str, Any] = msgpack.unpackb(await self.reader.readexactly(n), raw=False)
        return msg

    def write_message(self, msg: dict[str, Any]) -> None:
        data = msgpack.packb(msg, use_bin_type=True)
        self.write(LENGTH_PREFIX.pack(len(data)) + data)

    def write(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)

    async def drain(self) -> None:
        assert self.writer is not None
        await self.writer.drain()

    async def read_frame(self) -> tuple[Header, bytes]:
        """The next frame the real rank sent."""
        assert self.reader is not None
        h = parse_header(await self.reader.readexactly(HEADER_SIZE), 1 << 62)
        return h, await self.reader.readexactly(h.length)

    async def read_until_eof(self) -> list[tuple[Header, bytes]]:
        """Every frame until the real rank closes the link (a partial frame is dropped)."""
        frames = []
        try:
            while True:
                frames.append(await self.read_frame())
        except asyncio.IncompleteReadError:
            return frames

    async def aborts(self) -> list[dict[str, Any]]:
        """Read to EOF and decode the ABORT frames received."""
        return [
            msgpack.unpackb(p, raw=False) for h, p in await self.read_until_eof() if h.kind == ABORT
        ]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    async def aclose(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()


def u32(n: int) -> bytes:
    """``n`` as four little-endian bytes (a length prefix)."""
    return struct.pack("<I", n)


# -- a real rank 0 linked to a fake rank 1 --------------------------------------------------


async def linked(
    store: MemoryStore, name: str, fake_peer: Callable[..., FakePeer], **options: Any
) -> tuple[ac.Group, FakePeer]:
    """A real rank 0 and a fake rank 1, linked."""
    fake = fake_peer(store, name, chunk_bytes=CHUNK)
    opening = asyncio.ensure_future(
        ac.open_group(
            0,
            2,
            store=store,
            transport="tcp",
            timeout=GROUP_TIMEOUT,
            name=name,
            chunk_bytes=CHUNK,
            **options,
        )
    )
    try:
        await fake.join()
    except BaseException:
        opening.cancel()
        raise
    return await opening, fake


async def expect_failure(
    handle: asyncio.Future[Any], exc_type: type[BaseException], started: float
) -> BaseException:
    """Await ``handle`` (a real rank's operation) and return what it raised.

    Raises:
        AssertionError: it did not raise ``exc_type`` within ``PROMPT`` s of ``started``
            (a timeout, not a detected failure).
    """
    with pytest.raises(exc_type) as info:
        async with asyncio.timeout(GROUP_TIMEOUT + 5):
            await handle
    elapsed = time.monotonic() - started
    assert elapsed < PROMPT, f"took {elapsed:.2f}s: a timeout, not a detected failure"
    assert not isinstance(info.value, TimeoutError), info.value
    return info.value


async def group_is_broken_by(g: ac.Group, cause: BaseException) -> None:
    """``g`` is broken with ``cause`` as the reason; then abort it and let its links end."""
    with pytest.raises(ac.GroupBrokenError) as info:
        g.barrier()
    assert info.value.__cause__ is cause
    g.abort()
    await links_settled([g])
