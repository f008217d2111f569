"""Bruck's allgather: every rank's block on every rank in ceil(log2 n) rounds, for any n.

Rank r keeps the blocks in a scratch rotated by r (position i holds rank ``(r + i) % n``'s
block). In round k it sends its first ``min(2^k, n - 2^k)`` positions to rank
``r - 2^k`` and receives as many from rank ``r + 2^k`` into positions ``2^k`` on (mod n);
after the last round every position is filled and one rotation puts the blocks in rank
order. Blocks may differ in size (every rank knows every size: allgatherv's rows follow
the size exchange), and an empty range sends no frame.

The partners ``r +- 2^k`` are links a group opens when it forms (the dissemination
barrier's, ``collectives/neighbours.py``), so this opens no new sockets in a group with
links on demand. Every round's receive is posted before the first send: a round's frames
land in place whenever they come, and a round waits only for the one before it. Against
the ring's ``n - 1`` steps that is ``ceil(log2 n)`` wake-ups per exchange, which wins for
small blocks in large groups; the ring moves as many bytes, pipelined between neighbours,
and stays the choice for large ones (``select.BRUCK_MAX_BYTES``, ``BRUCK_MIN_RANKS``).

:func:`gather` is :data:`aiocollect.collectives.vector.Gather` for allgatherv's ``bruck``
and the object gathers; :func:`allgather_rows` gathers one fixed-size row per rank
(``split``'s colors and keys).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from aiocollect._buffers import Array
from aiocollect.collectives import ring, select
from aiocollect.engine.op import Op
from aiocollect.errors import InternalError

#: Slots of a round: round k of an exchange based at slot s uses slot s + k.
SIZES_SLOT = 0


class Tiled(list[Array]):
    """Blocks in rank order that tile one flat array: block i is
    ``whole[bounds[i]:bounds[i + 1]]`` (what allgatherv exchanges: a rotation of
    ``whole`` is Bruck's scratch, so ranges of blocks move in one piece)."""

    __slots__ = ("bounds", "whole")

    def __init__(self, whole: Array, bounds: Sequence[int]) -> None:
        super().__init__(whole[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1))
        self.whole = whole
        self.bounds = bounds


def source(n: int, rank: int, sender: int) -> int:
    """The rank that rank ``rank`` of ``n`` receives ``sender``'s block from: the rank
    ``2^k`` after it, for the round k whose range holds the block."""
    d = (sender - rank) % n
    return (rank + (1 << (d.bit_length() - 1))) % n if d else rank


async def allgather_flat(o: Op, whole: Array, bounds: Sequence[int], slot0: int) -> None:
    """Fill every rank's block of the flat ``whole`` (rank i's is
    ``whole[bounds[i]:bounds[i + 1]]``; this rank's holds its data) from its rank, by
    Bruck's rounds in slots ``slot0 + k``. Returns once every block is filled; this
    rank's frames may still be queued (``o.finish`` waits for them)."""
    n, r = o.size, o.rank
    if n == 1:
        return
    total, base = int(bounds[n]), int(bounds[r])

    def at(i: int) -> int:
        """Where position i (rank ``(r + i) % n``'s block) starts in the scratch."""
        j = r + i
        return int(bounds[j]) - base if j <= n else int(bounds[j - n]) + total - base

    buf = np.empty(total, dtype=whole.dtype)
    buf[: at(1)] = whole[base : int(bounds[r + 1])]
    rounds: list[tuple[int, Array, list[asyncio.Future[None]]]] = []
    dist, k = 1, 0
    while dist < n:
        count = min(dist, n - dist)
        futs = o.recv_chunks((r + dist) % n, slot0 + k, buf[at(dist) : at(dist + count)])
        rounds.append(((r - dist) % n, buf[: at(count)], futs))
        dist <<= 1
        k += 1
    for k, (dst, send, futs) in enumerate(rounds):
        await o.send_chunks(dst, slot0 + k, send)  # (filled by the rounds before this)
        for fut in futs:
            await fut
    whole[base:] = buf[: total - base]  # (rotated back: rank order)
    whole[:base] = buf[total - base :]


async def allgather_rows(o: Op, mine: Array) -> Array:
    """Every rank's ``mine`` (flat, of one size and dtype on every rank) as the rows of
    an array, in rank order, by Bruck's rounds."""
    n, size = o.size, mine.size
    out = np.empty((n, size), dtype=mine.dtype)
    out[o.rank] = mine
    await allgather_flat(o, out.reshape(-1), range(0, n * size + 1, size), SIZES_SLOT)
    await o.finish()
    return out


async def allgather(o: Op, send: Array, blocks: Sequence[Array]) -> None:
    """The fixed-size allgather (``send`` flat, into ``blocks``, block i from rank i) by
    Bruck's rounds, through one flat scratch of every block (one copy in and out: it is
    chosen for small blocks in large groups, ``select.allgather``)."""
    n, size = o.size, send.size
    if size == 0:  # (nothing to exchange: every rank knows every block is empty)
        return
    whole = np.empty(n * size, dtype=send.dtype)
    whole[o.rank * size : (o.rank + 1) * size] = send
    await allgather_flat(o, whole, range(0, n * size + 1, size), SIZES_SLOT)
    for i, block in enumerate(blocks):
        if i != o.rank:
            block[...] = whole[i * size : (i + 1) * size].reshape(block.shape)
    blocks[o.rank][...] = send.reshape(blocks[o.rank].shape)


async def gather(o: Op, blocks: Sequence[Array], step: int) -> None:
    """:data:`aiocollect.collectives.vector.Gather` by Bruck, for ``blocks`` a
    :class:`Tiled`: the sizes (``step`` 0) always, the rows (``step`` 1) when all of them
    together are at most ``select.BRUCK_MAX_BYTES`` (else by ring: the same choice on
    every rank, which all know the sizes).

    Raises:
        InternalError: ``blocks`` is not a :class:`Tiled`.
    """
    if not isinstance(blocks, Tiled):
        raise InternalError("Bruck's allgather needs blocks that tile one array")
    if step and blocks.whole.nbytes > select.BRUCK_MAX_BYTES:
        await ring.allgather_blocks(o, blocks, slot0=ring.AG_SLOT)
    else:
        slot0 = ring.AG_SLOT if step else SIZES_SLOT
        await allgather_flat(o, blocks.whole, blocks.bounds, slot0)
    await o.finish()
