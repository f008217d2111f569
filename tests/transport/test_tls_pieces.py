"""TLS links (and plain TCP links, test_tcp_pieces.py) write large payloads in pieces, one
per loop turn (transport/stream_send.py, ``PIECE``): over a real connection on
loopback, TLS or plain, a small frame sent while a large frame is being written goes right
after that frame, ahead of the bulk frames queued behind it, and every frame lands
whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiocollect.testing.certs import make_certs
from aiocollect.testing.link_suite import Recorder, frame, payload, tcp_pair, within
from aiocollect.transport import stream_send, tcp
from aiocollect.transport.wire import DATA

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("tls", [True, False])
async def test_small_frame_follows_the_frame_being_written(tmp_path: Path, tls: bool) -> None:
    pair = tcp_pair()
    if tls:
        certs = make_certs(tmp_path, 2)
        pair = tcp_pair(certs.config(1).server, certs.config(0).client)
    ra, rb = Recorder(), Recorder()
    big, bulk, small = payload(3 << 20, 1), payload(1 << 20, 2), payload(100, 3)
    sends = [(1, 0, big), (1, 1, bulk), (2, 0, small)]  # (slot, chunk, payload)
    async with pair(ra, rb, 8 << 20) as (a, b):
        assert isinstance(a, tcp.StreamLink)
        bufs = {}
        for slot, chunk, data in sends:
            key, _ = frame(DATA, slot, data, chunk)
            bufs[key] = (bytearray(len(data)), data)
        futs = [b.post_recv(key, memoryview(buf)) for key, (buf, _) in bufs.items()]
        for slot, chunk, data in sends:
            a.send(frame(DATA, slot, data, chunk)[1], data)
            if slot == 1 and chunk == 0:
                assert a._partial is not None, "the 3 MiB frame was written at once"
        assert a.write_buffer_size() >= len(big) - stream_send.PIECE
        for fut in futs:
            await within("a frame", fut)
        for buf, data in bufs.values():
            assert bytes(buf) == data, "a payload landed corrupted"
        await within("the sender to drain", a.drained())
        order = [(k[3], k[4]) for k in rb.headers]
        assert order == [(1, 0), (2, 0), (1, 1)], order
