"""Dissemination barrier.

Schedule: ceil(log2 n) rounds; in round k rank r sends an empty frame to r + 2^k and waits
for one from r - 2^k. After the last round every rank has (transitively) heard from all.
Cost: ceil(log2 n) latency steps, zero payload bytes.
"""

from __future__ import annotations

import numpy as np

from aiocollect.engine.op import Op

_EMPTY = np.empty(0, dtype=np.uint8)


async def barrier(op: Op) -> None:
    n, r = op.size, op.rank
    k, dist = 0, 1
    while dist < n:
        fut = op.recv((r - dist) % n, k, 0, _EMPTY)
        await op.send((r + dist) % n, k, 0, _EMPTY)
        await fut
        k, dist = k + 1, dist * 2
