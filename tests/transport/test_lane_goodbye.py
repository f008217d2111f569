"""A GOODBYE goes on both connections of a laned TCP link whatever its size and whatever the
link is writing (transport/stream_send.py): a large one sent while a bulk frame is being
written in pieces is copied to the lane too, else the peer holds it until the lane ends.
Real loopback connections; the lane's writes are recorded."""

from __future__ import annotations

import asyncio

import pytest

from aiocollect.testing.link_suite import Recorder, frame, payload, tcp_pair
from aiocollect.transport import tcp
from aiocollect.transport.stream_send import BULK_MIN
from aiocollect.transport.tcp_link import LANE_MAX
from aiocollect.transport.wire import DATA, GOODBYE, KIND_AT, control_header

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("size", [16, BULK_MIN, 4 * BULK_MIN])
@pytest.mark.parametrize("mid_bulk", [False, True])
async def test_a_goodbye_is_copied_to_the_lane(size: int, mid_bulk: bool) -> None:
    async with tcp_pair()(Recorder(), Recorder(), 64 << 20) as (a, b):
        assert isinstance(a, tcp.StreamLink)
        assert isinstance(b, tcp.StreamLink)
        assert b.transport is not None
        on_lane: list[bytes] = []
        a._lane_max, a._lane_write = LANE_MAX, on_lane.append
        b.transport.pause_reading()  # (the kernel's buffers fill: the pieces wait)
        if mid_bulk:
            _, header = frame(DATA, 1, b"")
            a.send(header, payload(8 << 20, 1))
            await asyncio.sleep(0)
            assert a._partial is not None, "the bulk frame is not being written in pieces"
        a.send(control_header(GOODBYE, size), payload(size, 2))
        goodbyes = [f for f in on_lane if f[KIND_AT] == GOODBYE]
        assert len(goodbyes) == 1, f"a {size} B GOODBYE was not copied to the lane"
        assert len(goodbyes[0]) == len(control_header(GOODBYE, 0)) + size
        b.transport.resume_reading()
