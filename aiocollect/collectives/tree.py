"""Binomial-tree broadcast and reduce, pipelined in chunks.

Schedule: with v = (rank - root) mod n, a rank receives from v - lowbit(v) and forwards to
v + m for every power of two m < lowbit(v) (all m for the root) with v + m < n. Each chunk is
forwarded as soon as it arrives. Cost: ceil(log2 n) steps of latency; the root sends the
whole message ceil(log2 n) times (a bandwidth-bound large broadcast prefers the ring).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from aiocollect._buffers import Array
from aiocollect.engine.op import Op
from aiocollect.engine.reduce import reduce_into, settle
from aiocollect.engine.small import Exchange, Program

SLOT = 0


def tree_links(vrank: int, size: int) -> tuple[int | None, list[int]]:
    """(parent, children) of virtual rank ``vrank`` in a binomial tree rooted at 0."""
    parent = None
    mask = 1
    while mask < size:
        if vrank & mask:
            parent = vrank - mask
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if vrank + mask < size:
            children.append(vrank + mask)
        mask >>= 1
    return parent, children


async def broadcast(op: Op, buf: Array, root: int, slot: int = SLOT) -> None:
    n = op.size
    if n == 1:
        return
    v = (op.rank - root) % n
    parent, children = tree_links(v, n)
    real = [(c + root) % n for c in children]
    parts = op.chunks(buf)
    if parent is None:
        for c, part in enumerate(parts):
            for child in real:
                await op.send(child, slot, c, part)
        return
    src = (parent + root) % n
    futs = [op.recv(src, slot, c, part) for c, part in enumerate(parts)]
    for c, part in enumerate(parts):
        await futs[c]
        for child in real:
            await op.send(child, slot, c, part)


@lru_cache(maxsize=256)
def small_program(n: int, rank: int, root: int, slot: int = SLOT) -> Program:
    """:func:`broadcast` of a one-frame buffer as rank ``rank``'s program for
    :class:`aiocollect.engine.small.Quick`: receive from the parent (unless root), then
    send to each child; the same frames as the coroutine."""
    parent, children = tree_links((rank - root) % n, n)
    steps = [] if parent is None else [Exchange(-1, (parent + root) % n, slot)]
    steps += [Exchange((child + root) % n, -1, slot) for child in children]
    return Program(tuple(steps))


async def reduce(op: Op, buf: Array, root: int, ufunc: np.ufunc, average: bool) -> None:
    """Reduce the flat ``buf`` across ranks into ``root``'s ``buf`` (divided by the world
    size there when ``average``); the other ranks' ``buf`` stays unchanged (they reduce
    into a copy)."""
    work = buf if op.rank == root else buf.copy()
    await _reduce(op, work, root, ufunc)
    await op.finish()
    if op.rank == root:
        settle(work, buf, op.size if average else 1)


async def _reduce(op: Op, work: Array, root: int, ufunc: np.ufunc, slot: int = SLOT) -> None:
    """Binomial-tree reduce of ``work`` (this rank's contribution, overwritten with partial
    results) towards ``root``: each rank reduces its children's partials chunk by chunk and
    forwards them to its parent. Cost: ceil(log2 n) steps; every rank sends size once."""
    n = op.size
    if n == 1:
        return
    v = (op.rank - root) % n
    parent, children = tree_links(v, n)
    real = [(c + root) % n for c in children]
    parts = op.chunks(work)
    tmps = {child: np.empty_like(work) for child in real}
    futs = {
        child: [op.recv(child, slot, c, part) for c, part in enumerate(op.chunks(tmp))]
        for child, tmp in tmps.items()
    }
    tparts = {child: op.chunks(tmp) for child, tmp in tmps.items()}
    for c, part in enumerate(parts):
        for child in reversed(real):
            await futs[child][c]
            await reduce_into(ufunc, part, tparts[child][c])
        if parent is not None:
            await op.send((parent + root) % n, slot, c, part)


def small_covers(n: int) -> bool:
    """Whether :func:`small_program` covers world size ``n`` (any above 1)."""
    return n > 1
