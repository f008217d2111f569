"""Rank bodies for the shared-memory tests (module level, so spawned processes import them)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.transport.shm import ShmLink


def link_kinds_of(g: ac.Group) -> list[str]:
    links = g._fabric.links
    return ["shm" if isinstance(links[p], ShmLink) and links[p].shm else "tcp"
            for p in sorted(links)]


async def link_kinds(g: ac.Group) -> list[str]:
    """``shm`` or ``tcp`` for each peer link, in peer order."""
    kinds = link_kinds_of(g)
    await g.barrier()
    return kinds


async def big_frames(g: ac.Group, count: int) -> bool:
    """Large allreduces and broadcasts, several in flight, checked exactly."""
    n = g.world_size
    arrays = [np.arange(count, dtype=np.float64) * (g.rank + 1 + i) for i in range(3)]
    await asyncio.gather(*(g.allreduce(a) for a in arrays))
    total = n * (n + 1) // 2
    for i, a in enumerate(arrays):
        np.testing.assert_array_equal(a, np.arange(count, dtype=np.float64) * (total + i * n))
    for root in range(n):
        b = np.full(count // 3, g.rank, np.int32)
        await g.broadcast(b, root=root)
        assert (b == root).all()
    return True


async def objects_and_split(g: ac.Group) -> tuple[list[int], int]:
    everyone = await g.allgather_object(g.rank)
    sub = await g.split(g.rank % 2)
    assert sub is not None
    buf = np.array([g.rank], np.int64)
    await sub.allreduce(buf)
    return list(everyone), int(buf[0])


async def allreduce_forever(g: ac.Group, size: int) -> dict[str, Any]:
    """Allreduce until the group fails; report the error."""
    buf = np.ones(size, np.float32)
    try:
        while True:
            await g.allreduce(buf)
    except ac.AiocollectError as exc:
        cause = exc.__cause__
        return {"error": type(exc).__name__, "message": str(exc),
                "cause": type(cause).__name__ if cause else None}
