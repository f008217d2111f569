"""Every collective against numpy: world sizes, counts around the chunk size, dtypes, ops,
roots — in one process over the memory and TCP transports."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks
from tests.helpers import (
    CHUNK,
    CORE_DTYPES,
    DTYPES,
    allreduce_every_op,
    assert_close,
    counts_for,
    data,
    move_every_way,
    reference,
    valid_ops,
)

SIZES = [1, 2, 3, 4, 7]
TRANSPORTS = ["memory", "tcp"]

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", SIZES)
async def test_allreduce(n: int, transport: str) -> None:
    dtypes = DTYPES if transport == "memory" else CORE_DTYPES
    counts = await run_ranks(n, allreduce_every_op, dtypes, transport=transport, chunk_bytes=CHUNK)
    assert counts[0] > 50


async def _reduce_all(g: ac.Group, dtypes: list[Any]) -> None:
    n = g.world_size
    for dtype in dtypes:
        for op in valid_ops(dtype):
            for root in range(n):
                for count in counts_for(dtype)[::2]:
                    mine = data(g.rank, count, dtype, op=op)
                    buf = mine.copy()
                    await g.reduce(buf, root=root, op=op)
                    if g.rank == root:
                        want = reference([data(r, count, dtype, op=op) for r in range(n)], op)
                        assert_close(buf, want, f"reduce {dtype} {op.name} root={root}")
                    else:
                        np.testing.assert_array_equal(buf, mine)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", SIZES)
async def test_reduce(n: int, transport: str) -> None:
    await run_ranks(n, _reduce_all, CORE_DTYPES[1::2], transport=transport, chunk_bytes=CHUNK)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", SIZES)
async def test_data_movement(n: int, transport: str) -> None:
    dtypes = DTYPES if transport == "memory" else CORE_DTYPES
    await run_ranks(n, move_every_way, dtypes, transport=transport, chunk_bytes=CHUNK)


async def _p2p(g: ac.Group) -> list[int]:
    n, r = g.world_size, g.rank
    sources = []
    for count in counts_for(np.dtype(np.float32)):
        # ring exchange with specific sources, two tags in flight
        nxt, prv = (r + 1) % n, (r - 1) % n
        a = np.full(count, r, np.float32)
        b = np.full(count, r + 100, np.float32)
        got_a, got_b = np.empty_like(a), np.empty_like(b)
        hs = [
            g.recv(got_b, prv, tag=2),
            g.recv(got_a, prv, tag=1),
            g.send(a, nxt, tag=1),
            g.send(b, nxt, tag=2),
        ]
        await asyncio.gather(*hs)
        np.testing.assert_array_equal(got_a, np.full(count, prv, np.float32))
        np.testing.assert_array_equal(got_b, np.full(count, prv + 100, np.float32))
    # any-source: everyone sends to rank 0
    if r == 0:
        for _ in range(n - 1):
            buf = np.empty(3, np.int64)
            src = await g.recv(buf, tag=7)
            assert buf.tolist() == [src, src, src]
            sources.append(src)
    else:
        await g.send(np.full(3, r, np.int64), 0, tag=7)
    return sorted(sources)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 3, 4, 7])
async def test_send_recv(n: int, transport: str) -> None:
    res = await run_ranks(n, _p2p, transport=transport, chunk_bytes=CHUNK)
    assert res[0] == list(range(1, n))


import asyncio  # noqa: E402
