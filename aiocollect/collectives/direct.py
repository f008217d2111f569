"""Direct algorithms: gather, scatter, pairwise-exchange alltoall, and one-step allgather
and reduce-scatter for small messages. Each function is a whole algorithm.

- gather: every rank sends its block straight to the root (n-1 messages into the root;
  one step of latency; the root receives (n-1)/n of the result).
- scatter: the root sends block i straight to rank i.
- alltoall (pairwise exchange): in step k = 1..n-1 rank r sends block (r+k) to rank r+k and
  receives block (r-k) from rank r-k. All receives are posted first, straight into the
  output. Cost: n-1 steps, (n-1)/n of the data sent and received per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aiocollect._buffers import Array
from aiocollect.engine.op import Op, split_even
from aiocollect.engine.reduce import copy_into, reduce_into, settle

SLOT = 0


async def gather(
    op: Op, send: Array, blocks: Sequence[Array] | None, root: int, slot: int = SLOT
) -> None:
    if op.rank != root:
        await op.send_chunks(root, slot, send)
        return
    assert blocks is not None
    for peer in range(op.size):
        if peer != root:
            op.recv_chunks(peer, slot, blocks[peer])
    blocks[root][...] = send


async def scatter(op: Op, blocks: Sequence[Array] | None, out: Array, root: int) -> None:
    if op.rank != root:
        op.recv_chunks(root, SLOT, out)
        return
    assert blocks is not None
    for peer in range(op.size):
        if peer != root:
            await op.send_chunks(peer, SLOT, blocks[peer])
    out[...] = blocks[root]


async def alltoall(
    op: Op, send_blocks: Sequence[Array], out_blocks: Sequence[Array], slot: int = SLOT
) -> None:
    n, r = op.size, op.rank
    for k in range(1, n):
        op.recv_chunks((r - k) % n, slot, out_blocks[(r - k) % n])
    out_blocks[r][...] = send_blocks[r]
    for k in range(1, n):
        await op.send_chunks((r + k) % n, slot, send_blocks[(r + k) % n])


async def allgather(op: Op, send: Array, blocks: Sequence[Array], slot: int = SLOT) -> None:
    """Gather every rank's flat ``send`` into ``blocks`` (block i from rank i): every rank
    sends its block straight to every other rank: one step of latency, n-1 messages per
    rank. Best for small blocks."""
    r = op.rank
    await copy_into(blocks[r], send)
    for peer in range(op.size):
        if peer != r:
            op.recv_chunks(peer, slot, blocks[peer])
    for k in range(1, op.size):
        await op.send_chunks((r + k) % op.size, slot, blocks[r])


async def reduce_scatter(
    op: Op, send: Array, dest: Array, ufunc: np.ufunc, average: bool, slot: int = SLOT
) -> None:
    """Reduce the flat ``send`` across ranks; the flat ``dest`` gets this rank's block
    (divided by the world size when ``average``). Rank i receives block i from every rank
    and reduces them in rank order: one step of latency, (n-1)/n of the data sent per rank.
    Best for small blocks."""
    n, r = op.size, op.rank
    blocks = list(split_even(send, n))
    mine = blocks[r] = blocks[r].copy()
    tmps = {peer: np.empty_like(mine) for peer in range(n) if peer != r}
    futs = {peer: op.recv_chunks(peer, slot, tmp) for peer, tmp in tmps.items()}
    for k in range(1, n):
        await op.send_chunks((r + k) % n, slot, blocks[(r + k) % n])
    acc = None
    for peer in range(n):
        part = mine if peer == r else tmps[peer]
        for fut in futs.get(peer, ()):
            await fut
        if acc is None:
            acc = part.copy()
        else:
            await reduce_into(ufunc, acc, part)
    assert acc is not None
    mine[...] = acc
    settle(mine, dest, n if average else 1)
