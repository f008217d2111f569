"""A member flooding zero-length frames for operations nobody calls.

The staging cap (``MAX_EARLY_BYTES``) must count what staging really costs — payload and
every byte of bookkeeping, in the link and in the fabric — so the ProtocolError comes before
memory passes the cap; and once the link (or group) has failed, all of it is released.
Measured with tracemalloc on a real rank linked over TCP to a hand-driven peer.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect import errors
from aiocollect.store import MemoryStore
from aiocollect.transport import mailbox
from aiocollect.transport.wire import DATA, P2P
from tests.support.fakepeer import FakePeer, header

pytestmark = pytest.mark.timeout(120)

CHUNK = 64
LIMIT = 24 << 20  # the cap under test (the default, 1 GiB, would take minutes here)
SLACK = 2 << 20  # socket read buffers, the fake peer's own write buffer, the loop


def _frames(kind: int, start: int, count: int, distinct_seqs: bool) -> bytes:
    if distinct_seqs:  # one operation per frame: the fabric's bookkeeping grows per frame
        return b"".join(header(kind, seq=1000 + start + i, length=0) for i in range(count))
    return b"".join(header(kind, seq=1000, slot=start + i, length=0) for i in range(count))


async def _flood(g: ac.Group, fake: FakePeer, kind: int, distinct_seqs: bool) -> int:
    sent, batch = 0, 2048
    fabric = g._fabric
    while fabric.failure is None and sent < 4 * LIMIT // 256:
        fake.write(_frames(kind, sent, batch, distinct_seqs))
        try:
            await fake.drain()
        except ConnectionError:
            break
        sent += batch
        await asyncio.sleep(0)  # let the rank read what the kernel holds
    return sent


@pytest.mark.parametrize(
    ("kind", "distinct_seqs"),
    [(DATA, False), (DATA, True), (P2P, False)],
    ids=["data-one-op", "data-many-ops", "p2p"],
)
async def test_empty_frame_flood_is_capped_and_released(
    kind: int,
    distinct_seqs: bool,
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    monkeypatch: pytest.MonkeyPatch,
    loop_errors: list[Any],
) -> None:
    monkeypatch.setattr(mailbox, "MAX_EARLY_BYTES", LIMIT)
    fake = fake_peer(memory_store, unique_name, chunk_bytes=CHUNK)
    opening = asyncio.ensure_future(
        ac.open_group(
            0,
            2,
            store=memory_store,
            transport="tcp",
            timeout=60,
            name=unique_name,
            chunk_bytes=CHUNK,
        )
    )
    await fake.join()
    g = await opening
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        sent = await _flood(g, fake, kind, distinct_seqs)
        async with asyncio.timeout(20):
            # the flood breaks the group inside a protocol callback; no awaitable reports
            # it without another operation (which would add its own traffic)
            while g._fabric.failure is None:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        peak = tracemalloc.get_traced_memory()[1] - base
        failure = g._fabric.failure
        assert isinstance(failure, errors.ProtocolError), failure
        assert "staged" in str(failure), str(failure)
        # the cap held: what staging cost never went (much) beyond it
        assert peak <= LIMIT + SLACK, (
            f"staging {sent} frames used {peak / 2**20:.1f} MiB, cap {LIMIT / 2**20:.0f} MiB"
        )
        g.abort()
        await fake.aclose()
        await asyncio.sleep(0.1)
        del failure
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert left < SLACK, f"{left / 2**20:.1f} MiB still held after the failure and abort()"
    # the process is healthy
    buf = np.ones(1)
    assert (await ac.testing.run_ranks(2, lambda gr: gr.allreduce(buf.copy())))[0][0] == 2
