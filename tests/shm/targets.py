"""Rank bodies for the shared-memory tests (module level, so spawned processes import them)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.transport.shm import ShmLink


def link_kinds_of(g: ac.Group) -> list[str]:
    links = g._fabric.links
    return [
        "shm" if isinstance(links[p], ShmLink) and links[p].shm else "tcp" for p in sorted(links)
    ]


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
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "cause": type(cause).__name__ if cause else None,
        }


async def allreduce_until_told(
    g: ac.Group, count: int, ready_key: str, go_key: str, after: int
) -> dict[str, Any]:
    """Allreduce (checked exactly) while the test does something to the ranks: publish
    this rank's pid under ``ready_key`` once links are warm, keep going until ``go_key``
    appears in the store (rank 0 looks, every rank learns it in the same allreduce), then
    ``after`` more rounds. Returns the rounds done and the error, if any."""
    n = g.world_size
    want = n * (n + 1) / 2
    buf = np.empty(count, np.float64)
    flag = np.zeros(1, np.int64)
    rounds = 0
    try:
        await g.store.set(f"{ready_key}/{g.rank}", str(os.getpid()).encode())
        while True:
            buf[:] = g.rank + 1
            await g.allreduce(buf)
            assert (buf == want).all(), f"round {rounds}: {buf[:4]}"
            rounds += 1
            flag[0] = 1 if g.rank == 0 and (await g.store.check([go_key]))[0] else 0
            await g.allreduce(flag, op=ac.ReduceOp.MAX)
            if flag[0]:
                break
        for _ in range(after):
            buf[:] = g.rank + 1
            await g.allreduce(buf)
            assert (buf == want).all(), f"round {rounds}: {buf[:4]}"
            rounds += 1
    except ac.AiocollectError as exc:
        return {"rounds": rounds, "error": f"{type(exc).__name__}: {exc}"}
    return {"rounds": rounds, "error": None}


async def corrupt_pull_count(g: ac.Group, count: int) -> dict[str, Any]:
    """Rank 1 claims pulls rank 0 never sent (it publishes the count after its next real
    pull); both ranks allreduce frames sent by reference until the group breaks. Returns
    what each rank raised, its cause and, for a relayed failure, the ABORT it came in."""
    if g.rank == 1:
        link = g._fabric.links[0]
        assert isinstance(link, ShmLink)
        assert link.shm
        link._pulled = 1 << 40
    await g.barrier()
    buf = np.ones(count, np.float32)
    try:
        for _ in range(20):
            await g.allreduce(buf, timeout=20, algorithm="ring")  # (frames by reference)
    except ac.AiocollectError as exc:
        cause = exc.__cause__
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "cause": f"{type(cause).__name__}: {cause}" if cause else None,
            "abort": getattr(exc, "abort_info", None) or getattr(cause, "abort_info", None),
        }
    return {"error": None}
