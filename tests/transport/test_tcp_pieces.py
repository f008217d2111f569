"""Plain TCP links write large payloads in pieces, one per loop turn, each once the
transport has handed the previous one to the kernel (transport/stream_send.py, ``PIECE``):
a 1-2 MiB write on loopback held the event loop for milliseconds (the loop lag column of
``aiocollect bench allreduce -n 2 --transport tcp --sizes 16M``). Where ranks share cores
the fabric turns the pieces off for plain TCP (``Link.pace_writes``; engine/fabric.py). Real
loopback connections throughout; the
only thing held back is the receiving side's reading, so that the kernel's buffers fill.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from aiocollect.engine.spin import core_each, usable_cores
from aiocollect.group import Group
from aiocollect.testing import run_ranks
from aiocollect.testing.certs import make_certs
from aiocollect.testing.link_suite import Recorder, frame, payload, tcp_pair, within
from aiocollect.transport import stream_send, tcp
from aiocollect.transport.wire import DATA, HEADER_SIZE

pytestmark = pytest.mark.timeout(60)


async def test_a_piece_waits_until_the_transport_has_handed_the_last_to_the_kernel() -> None:
    """With the receiver not reading, the kernel's buffers fill; the transport then holds
    at most about one piece of a 32 MiB frame (the rest waits in the link), where a whole
    payload handed over at once would sit in the transport. Once the receiver reads again
    the frame lands whole."""
    data = payload(32 << 20, 4)
    async with tcp_pair()(Recorder(), Recorder(), 64 << 20) as (a, b):
        assert isinstance(a, tcp.StreamLink)
        assert isinstance(b, tcp.StreamLink)
        assert b.transport is not None
        assert a.transport is not None
        b.transport.pause_reading()
        key, header = frame(DATA, 1, data)
        buf = bytearray(len(data))
        fut = b.post_recv(key, memoryview(buf))
        a.send(header, data)
        for _ in range(200):  # loop turns (the sender's pieces are due one per turn)
            await asyncio.sleep(0)
        assert a._piece_waits, "the next piece did not wait for the transport"
        assert a.transport.get_write_buffer_size() <= stream_send.PIECE + HEADER_SIZE
        assert a.write_buffer_size() > len(data) // 2  # the rest is held by the link
        b.transport.resume_reading()
        await within("the 32 MiB frame", fut)
        assert bytes(buf) == data
        await within("the sender to drain", a.drained())
        assert not a._piece_waits


@pytest.mark.parametrize("tls", [False, True])
async def test_pace_writes_off_writes_plain_tcp_payloads_whole(tls: bool, tmp_path: Path) -> None:
    """Where ranks share cores a plain TCP link hands a large payload over at once; a TLS
    link keeps its pieces (its transport would encrypt the whole payload in one go)."""
    pair = tcp_pair()
    if tls:
        certs = make_certs(tmp_path, 2)
        pair = tcp_pair(certs.config(1).server, certs.config(0).client)
    data = payload(3 << 20, 5)
    async with pair(Recorder(), Recorder(), 8 << 20) as (a, b):
        assert isinstance(a, tcp.StreamLink)
        a.pace_writes(False)
        key, header = frame(DATA, 1, data)
        buf = bytearray(len(data))
        fut = b.post_recv(key, memoryview(buf))
        a.send(header, data)
        assert (a._partial is not None) == tls
        await within("the frame", fut)
        assert bytes(buf) == data


async def test_pieces_turned_off_mid_frame_write_the_rest_whole() -> None:
    data = payload(3 << 20, 6)
    async with tcp_pair()(Recorder(), Recorder(), 8 << 20) as (a, b):
        assert isinstance(a, tcp.StreamLink)
        key, header = frame(DATA, 1, data)
        buf = bytearray(len(data))
        fut = b.post_recv(key, memoryview(buf))
        a.send(header, data)
        assert a._partial is not None
        a.pace_writes(False)
        await within("the frame", fut)
        assert bytes(buf) == data
        await within("the sender to drain", a.drained())


async def test_core_each_counts_this_rank_and_its_local_peers() -> None:
    async with tcp_pair()(Recorder(), Recorder(), 1 << 20) as (a, _):
        assert a.caps.local  # loopback
        assert core_each([], cores=1)
        assert core_each([a], cores=2)
        assert not core_each([a], cores=1)


async def _pieces(group: Group) -> tuple[list[int], bool]:
    buf = np.arange(1 << 20, dtype=np.float32)
    await group.allreduce(buf)
    ok = bool((buf == np.arange(1 << 20, dtype=np.float32) * group.world_size).all())
    return [link._piece for link in group._fabric.links.values()], ok  # type: ignore[attr-defined]


@pytest.mark.parametrize("n", [2, 3])
async def test_a_group_paces_its_tcp_links_by_cores(n: int) -> None:
    """Real TCP groups in this process: with a core per rank their links write in pieces,
    with more ranks than cores whole, and the allreduce over them is right either way."""
    results = await run_ranks(n, _pieces, transport="tcp")
    want = stream_send.PIECE if n <= usable_cores() else 0
    assert all(piece == want for pieces, _ in results for piece in pieces), results
    assert all(ok for _, ok in results)
