"""Every collective against numpy: world sizes, counts around the chunk size, dtypes, ops,
roots — in one process, over every transport and mode (tests/support/transports.py): every
world size over memory, TCP and shared memory, one over the other modes. Over memory links
the ``*_memory`` tests run them, on one loop (tests/conftest.py: the loop only runs the
ranks' callbacks in the order they were scheduled, asyncio and uvloop alike)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks
from tests.support.collectives import (
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
from tests.support.transports import Axis

SIZES = [1, 2, 3, 4, 7]
#: World sizes per mode (memory: the ``*_memory`` tests); every other mode (a variant, or a
#: transport registered later): 3.
WORLDS = {"memory": [], "tcp": SIZES, "shm": SIZES}
P2P_SIZES = [2, 3, 4, 7]
P2P_WORLDS = {"memory": [], "tcp": P2P_SIZES, "shm": P2P_SIZES}

pytestmark = pytest.mark.timeout(180)


@pytest.mark.transports(argnames="n", values=WORLDS, default=[3])
async def test_allreduce(axis: Axis, n: int) -> None:
    counts = await axis.run(n, allreduce_every_op, CORE_DTYPES, chunk_bytes=CHUNK)
    assert counts[0] > 50


@pytest.mark.parametrize("n", SIZES)
async def test_allreduce_memory(n: int) -> None:
    counts = await run_ranks(n, allreduce_every_op, DTYPES, chunk_bytes=CHUNK)
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


@pytest.mark.transports(argnames="n", values=WORLDS, default=[3])
async def test_reduce(axis: Axis, n: int) -> None:
    await axis.run(n, _reduce_all, CORE_DTYPES[1::2], chunk_bytes=CHUNK)


@pytest.mark.parametrize("n", SIZES)
async def test_reduce_memory(n: int) -> None:
    await run_ranks(n, _reduce_all, CORE_DTYPES[1::2], chunk_bytes=CHUNK)


@pytest.mark.transports(argnames="n", values=WORLDS, default=[3])
async def test_data_movement(axis: Axis, n: int) -> None:
    await axis.run(n, move_every_way, CORE_DTYPES, chunk_bytes=CHUNK)


@pytest.mark.parametrize("n", SIZES)
async def test_data_movement_memory(n: int) -> None:
    await run_ranks(n, move_every_way, DTYPES, chunk_bytes=CHUNK)


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
        await asyncio.gather(*hs)  # type: ignore[call-overload]
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


@pytest.mark.transports(argnames="n", values=P2P_WORLDS, default=[3])
async def test_send_recv(axis: Axis, n: int) -> None:
    res = await axis.run(n, _p2p, chunk_bytes=CHUNK)
    assert res[0] == list(range(1, n))


@pytest.mark.parametrize("n", P2P_SIZES)
async def test_send_recv_memory(n: int) -> None:
    res = await run_ranks(n, _p2p, chunk_bytes=CHUNK)
    assert res[0] == list(range(1, n))


async def objects_and_split(g: ac.Group) -> tuple[list[int], int]:
    everyone = await g.allgather_object(g.rank)
    sub = await g.split(g.rank % 2)
    assert sub is not None
    buf = np.array([g.rank], np.int64)
    await sub.allreduce(buf)
    return list(everyone), int(buf[0])


async def test_objects_and_split(axis: Axis) -> None:
    res = await axis.run(4, objects_and_split)
    # allgather_object of the ranks; allreduce of the ranks within each color (r % 2)
    assert res == [
        ([0, 1, 2, 3], 0 + 2),
        ([0, 1, 2, 3], 1 + 3),
        ([0, 1, 2, 3], 0 + 2),
        ([0, 1, 2, 3], 1 + 3),
    ]
