"""Dissemination barrier.

Schedule: ceil(log2 n) rounds; in round k rank r sends an empty frame to r + 2^k and waits
for one from r - 2^k. After the last round every rank has (transitively) heard from all.
Cost: ceil(log2 n) latency steps, zero payload bytes.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from aiocollect.engine.op import Op
from aiocollect.engine.small import Exchange, Program

_EMPTY = np.empty(0, dtype=np.uint8)


async def barrier(op: Op) -> None:
    n, r = op.size, op.rank
    k, dist = 0, 1
    while dist < n:
        fut = op.recv((r - dist) % n, k, 0, _EMPTY)
        await op.send((r + dist) % n, k, 0, _EMPTY)
        await fut
        k, dist = k + 1, dist * 2


@lru_cache(maxsize=256)
def small_program(n: int, rank: int) -> Program:
    """:func:`barrier` as rank ``rank``'s program for
    :class:`aiocollect.engine.small.Quick` (the same empty frames, one round a step)."""
    steps = []
    k, dist = 0, 1
    while dist < n:
        steps.append(Exchange((rank + dist) % n, (rank - dist) % n, k))
        k, dist = k + 1, dist * 2
    return Program(tuple(steps))


def small_covers(n: int) -> bool:
    """Whether :func:`small_program` covers world size ``n`` (any above 1)."""
    return n > 1
