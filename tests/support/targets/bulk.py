"""Bodies for tests/shm/test_bulk_worker.py that run in spawned rank processes (with
``AIOCOLLECT_BULK_THREAD=1``: the pull collectives' bulk work in the group's worker)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.engine import bulk

#: float32 elements of a buffer whose blocks (4 ranks at most) are at least
#: ``bulk.MIN_BYTES``, plus an odd tail (blocks of unequal sizes).
COUNT = bulk.MIN_BYTES + 7


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aiocollect-bulk")]


async def exact(g: ac.Group) -> dict[str, Any]:
    """Two SUM and one AVG allreduces, an allgather and a reduce_scatter in flight at
    once, large enough for the worker, checked exactly (integers in float32). Returns
    whether the group had a worker, its thread's nice value, and whether a worker thread
    was left after the group closed."""
    n, r = g.world_size, g.rank
    sums = [np.arange(COUNT, dtype=np.float32) % 1000 + r + i for i in range(2)]
    avg = np.full(COUNT, 4 * r, np.float32)
    send = np.full(COUNT // n, r, np.float32)
    gathered = np.empty((n, COUNT // n), np.float32)
    scatter_in = np.repeat(np.arange(n, dtype=np.float32) + r, COUNT // n)
    await asyncio.gather(
        *[g.allreduce(s) for s in sums],
        g.allreduce(avg, op=ac.ReduceOp.AVG),
        g.allgather(send, gathered),
        g.reduce_scatter(scatter_in),
    )
    base = np.arange(COUNT, dtype=np.float32) % 1000
    for i, s in enumerate(sums):
        assert (s == n * base + sum(range(n)) + n * i).all(), (i, s[:4])
    assert (avg == 4 * sum(range(n)) / n).all(), avg[:4]
    assert all((gathered[q] == q).all() for q in range(n))
    dest = await g.reduce_scatter(scatter_in)
    assert (dest == sum(q + r for q in range(n))).all(), dest[:4]
    workers = _workers()
    nice = os.getpriority(os.PRIO_PROCESS, workers[0].native_id or 0) if workers else None
    had = g._fabric.bulk is not None
    await g.aclose()
    return {"worker": had, "threads": len(workers), "nice": nice, "left": len(_workers())}


async def small_during_bulk(g: ac.Group, rounds: int) -> list[float]:
    """While every rank runs back-to-back 64 MiB allreduces, ranks 0 and 1 exchange
    ``rounds`` 1 KiB request/replies, one at a time; rank 0 returns each round trip's
    seconds (the others an empty list)."""
    data = np.zeros(16 << 20, np.float32)
    stop = np.zeros(1, np.int32)
    done = asyncio.Event()

    async def bulk_loop() -> int:
        count = 0
        while True:
            await g.allreduce(data)
            count += 1
            stop[0] = g.rank == 0 and done.is_set()
            await g.broadcast(stop, root=0)
            if stop[0]:
                return count

    background = asyncio.ensure_future(bulk_loop())
    times: list[float] = []
    ping = np.zeros(256, np.float32)
    if g.rank == 0:
        for i in range(rounds):
            t = time.perf_counter()
            ping[0] = i
            await g.send(ping, 1, tag=7)
            await g.recv(ping, 1, tag=8)
            times.append(time.perf_counter() - t)
        done.set()
    elif g.rank == 1:
        for _ in range(rounds):
            await g.recv(ping, 0, tag=7)
            await g.send(ping, 0, tag=8)
    assert await background >= 1
    return times
