"""Pipelined chain broadcast: root -> root+1 -> ... -> root-1, chunk by chunk.

Schedule: each rank forwards chunk c to its successor as soon as it has arrived. With m
chunks, the last rank has everything after (n - 1 + m - 1) chunk steps; every rank sends the
message at most once, so for large messages the time approaches size / link bandwidth,
independent of n (the binomial tree sends it log2(n) times from the root).
"""

from __future__ import annotations

from aiocollect._buffers import Array
from aiocollect.engine.op import Op

SLOT = 0


async def broadcast(op: Op, buf: Array, root: int, slot: int = SLOT) -> None:
    n = op.size
    if n == 1:
        return
    v = (op.rank - root) % n
    nxt = (op.rank + 1) % n if v < n - 1 else None
    parts = op.chunks(buf)
    if v == 0:
        for c, part in enumerate(parts):
            await op.send(nxt, slot, c, part)  # type: ignore[arg-type]
        return
    futs = [op.recv((op.rank - 1) % n, slot, c, part) for c, part in enumerate(parts)]
    for c, part in enumerate(parts):
        await futs[c]
        if nxt is not None:
            await op.send(nxt, slot, c, part)
