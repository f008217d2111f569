"""Early frames (sent before the receiver posted a receive) are staged only up to a bound;
beyond it the link stops reading and the sender waits in TCP flow control. Nothing is lost:
once the receive is posted, everything arrives intact."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks
from aiocollect.transport import base

pytestmark = pytest.mark.timeout(120)


async def _body(g: ac.Group, limit: int, size: int) -> int:
    if g.rank == 1:
        data = np.arange(size, dtype=np.int64)
        await g.send(data, 0, tag=5)
        return 0
    link = g._fabric.links[1]
    full = asyncio.Event()
    seen = 0

    def on_full() -> None:
        nonlocal seen
        seen = max(seen, link.early_bytes)
        full.set()
        type(link)._staging_full(link)

    link._staging_full = on_full  # type: ignore[method-assign]
    await full.wait()  # the sender ran ahead until staging hit the bound
    assert link.early_bytes <= limit + g.chunk_bytes
    buf = np.empty(size, np.int64)
    await g.recv(buf, 1, tag=5)
    np.testing.assert_array_equal(buf, np.arange(size, dtype=np.int64))
    return seen


async def test_staging_is_bounded_and_nothing_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    limit = 4 * 1024 * 1024
    monkeypatch.setattr(base, "STAGING_LIMIT", limit)
    size = limit  # int64 elements: 8x the staging limit in bytes
    res = await run_ranks(2, _body, limit, size, transport="tcp", chunk_bytes=256 * 1024)
    assert limit < res[0] <= limit + 256 * 1024
