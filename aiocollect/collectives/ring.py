"""Ring algorithms: bandwidth-optimal reduce-scatter and allgather, pipelined in chunks.

Schedule (n ranks, rank r sends to r+1 and receives from r-1, message split in n blocks):

- reduce-scatter: n-1 steps; at step s rank r sends block (r-s-1) mod n and receives block
  (r-s-2) mod n, reducing it into its own copy. Afterwards rank r holds block r reduced.
- allgather: n-1 steps; at step s rank r sends block (r-s) mod n and receives (r-s-1) mod n.

Cost per rank: (n-1) messages of size/n per phase, i.e. 2(n-1)/n * size bytes for an
allreduce, latency 2(n-1) alpha. Each block travels in chunks, and chunk c of step s+1 is sent
as soon as chunk c of step s has arrived (and been reduced), so the steps overlap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from aiocollect._buffers import Array
from aiocollect.engine.op import Op
from aiocollect.engine.reduce import reduce_into

RS_SLOT = 0
AG_SLOT = 1 << 20

Forward = Callable[[int, Array], Awaitable[None]]


async def reduce_scatter(op: Op, blocks: list[Array], ufunc: np.ufunc,
                         slot0: int = RS_SLOT, finished: Forward | None = None) -> None:
    """After this, ``blocks[op.rank]`` holds the reduction of every rank's block.

    ``finished(c, chunk)`` is awaited as soon as chunk ``c`` of this rank's block is fully
    reduced: an allreduce starts its allgather there, chunk by chunk, instead of after the
    whole reduce-scatter.
    """
    n, r = op.size, op.rank
    if n == 1:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    tmp = np.empty(max(b.size for b in blocks), dtype=blocks[0].dtype)
    recv_block = (r - 2) % n
    futs = [op.recv(prv, slot0, c, part) for c, part in enumerate(op.chunks(
        tmp[:blocks[recv_block].size]))]
    for c, part in enumerate(op.chunks(blocks[(r - 1) % n])):
        await op.send(nxt, slot0, c, part)
    for s in range(n - 1):
        rb = (r - s - 2) % n
        mine = op.chunks(blocks[rb])
        theirs = op.chunks(tmp[:blocks[rb].size])
        last = s == n - 2
        nb = (r - s - 3) % n
        ahead = [] if last else op.chunks(tmp[:blocks[nb].size])
        nfuts = []
        for c, (dst, src) in enumerate(zip(mine, theirs, strict=True)):
            await futs[c]
            await reduce_into(ufunc, dst, src)
            await asyncio.sleep(0)  # a done future does not yield: keep the loop responsive
            if not last:
                if c < len(ahead):
                    nfuts.append(op.recv(prv, slot0 + s + 1, c, ahead[c]))
                await op.send(nxt, slot0 + s + 1, c, dst)
            elif finished is not None:
                await finished(c, dst)
        for c in range(len(mine), len(ahead)):
            nfuts.append(op.recv(prv, slot0 + s + 1, c, ahead[c]))
        futs = nfuts


def post_allgather(op: Op, blocks: list[Array],
                   slot0: int = AG_SLOT) -> list[list[asyncio.Future[None]]]:
    """Post every receive of the ring allgather straight into its destination block.

    An allreduce posts them before its reduce-scatter, so allgather frames of a peer that
    runs ahead land in place instead of being staged: the frame for block b can only be
    sent once every rank's contribution to b, this rank's included, has left, so this rank
    no longer reads or writes b for the reduce-scatter by then.
    """
    n, r = op.size, op.rank
    prv = (r - 1) % n
    return [[op.recv(prv, slot0 + s, c, part)
             for c, part in enumerate(op.chunks(blocks[(r - s - 1) % n]))]
            for s in range(n - 1)]


async def allgather(op: Op, blocks: list[Array], slot0: int = AG_SLOT,
                    posted: list[list[asyncio.Future[None]]] | None = None,
                    first_sent: bool = False) -> None:
    """Before: ``blocks[op.rank]`` holds this rank's data. After: every block is filled.
    ``first_sent``: the caller already sent this rank's block (step 0)."""
    n, r = op.size, op.rank
    if n == 1:
        return
    nxt = (r + 1) % n
    futs = posted if posted is not None else post_allgather(op, blocks, slot0)
    if not first_sent:
        for c, part in enumerate(op.chunks(blocks[r])):
            await op.send(nxt, slot0, c, part)
    for s in range(n - 2):
        parts = op.chunks(blocks[(r - s - 1) % n])
        for c, part in enumerate(parts):
            await futs[s][c]
            await op.send(nxt, slot0 + s + 1, c, part)
            await asyncio.sleep(0)
