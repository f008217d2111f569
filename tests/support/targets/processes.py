"""Rank bodies run in spawned processes (module level so ``spawn`` can import them)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np

import aiocollect as ac
from tests.support.collectives import (
    CORE_DTYPES,
    assert_close,
    counts_for,
    data,
    reference,
    valid_ops,
)


async def sweep(g: ac.Group) -> int:
    """A compact sweep of every collective, checked against numpy on every rank."""
    n, r, checked = g.world_size, g.rank, 0
    for dtype in CORE_DTYPES:
        for count in counts_for(dtype):
            for op in valid_ops(dtype):
                buf = data(r, count, dtype, op=op)
                await g.allreduce(buf, op=op)
                want = reference([data(x, count, dtype, op=op) for x in range(n)], op)
                assert_close(buf, want, f"allreduce {dtype} {op.name} {count}")
                checked += 1
            everyone = [data(x, count, dtype) for x in range(n)]
            for root in range(n):
                buf = everyone[r].copy()
                await g.broadcast(buf, root=root)
                np.testing.assert_array_equal(buf, everyone[root])
                red = everyone[r].copy()
                await g.reduce(red, root=root, op=ac.MAX)
                if r == root:
                    assert_close(red, reference(everyone, ac.MAX))
            out = await g.allgather(everyone[r])
            np.testing.assert_array_equal(out, np.stack(everyone))
            rows = [data(x, n * (count + 1), dtype, seed=3) for x in range(n)]
            rs = await g.reduce_scatter(rows[r], op=ac.MAX)
            k = count + 1
            assert_close(rs, reference(rows, ac.MAX)[r * k : (r + 1) * k])
    # point to point around the ring, several messages in flight
    buf = np.empty(100, np.int32)
    hs = [g.recv(buf, (r - 1) % n, tag=3), g.send(np.full(100, r, np.int32), (r + 1) % n, tag=3)]
    await asyncio.gather(*hs)  # type: ignore[call-overload]
    assert (buf == (r - 1) % n).all()
    await g.barrier()
    return checked


async def concurrent(g: ac.Group, count: int) -> list[float]:
    """Several allreduces in flight at once; returns their first elements."""
    arrays = [np.full(count, float(g.rank + i), np.float64) for i in range(6)]
    await asyncio.gather(*(g.allreduce(a) for a in arrays))
    return [float(a[0]) for a in arrays]


async def echo_rank(g: ac.Group) -> Any:
    return (g.rank, g.world_size)


async def parent_and_sum(g: ac.Group) -> Any:
    """The rank's parent pid (who started it) and an allreduce of the ranks' numbers."""
    data = np.full(3, g.rank + 1, dtype=np.int64)
    await g.allreduce(data)
    return (os.getppid(), data.tolist())


async def environment_and_cwd(g: ac.Group, name: str) -> tuple[str | None, str]:
    """The rank's value of the environment variable ``name`` and its working directory."""
    await g.barrier()
    return (os.environ.get(name), os.getcwd())


async def overflow_under_strict_numpy(g: ac.Group) -> list[list[float]]:
    """Allreduces whose sums overflow float32 in a process whose numpy raises on every
    floating-point error and whose warnings are errors: one frame (4 bytes) and the pull
    allreduce (4 MiB, shared memory), SUM then AVG; each one's first and last element."""
    import warnings

    np.seterr(all="raise")
    warnings.simplefilter("error")
    seen = []
    for count in (1, 1 << 20):
        for op in (ac.SUM, ac.AVG):
            buf = np.ones(count, np.float32)
            buf[0] = 3e38
            await g.allreduce(buf, op=op)
            seen.append([float(buf[0]), float(buf[-1])])
    return seen
