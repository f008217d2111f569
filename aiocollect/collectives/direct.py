"""Direct algorithms: gather, scatter and pairwise-exchange alltoall.

- gather: every rank sends its block straight to the root (n-1 messages into the root;
  one step of latency; the root receives (n-1)/n of the result).
- scatter: the root sends block i straight to rank i.
- alltoall (pairwise exchange): in step k = 1..n-1 rank r sends block (r+k) to rank r+k and
  receives block (r-k) from rank r-k. All receives are posted first, straight into the
  output. Cost: n-1 steps, (n-1)/n of the data sent and received per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiocollect._buffers import Array
from aiocollect.engine.op import Op

SLOT = 0


async def gather(op: Op, send: Array, blocks: Sequence[Array] | None, root: int,
                 slot: int = SLOT) -> None:
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


async def alltoall(op: Op, send_blocks: Sequence[Array], out_blocks: Sequence[Array],
                   slot: int = SLOT) -> None:
    n, r = op.size, op.rank
    for k in range(1, n):
        op.recv_chunks((r - k) % n, slot, out_blocks[(r - k) % n])
    out_blocks[r][...] = send_blocks[r]
    for k in range(1, n):
        await op.send_chunks((r + k) % n, slot, send_blocks[(r + k) % n])
