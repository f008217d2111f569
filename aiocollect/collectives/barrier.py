"""Dissemination and star barriers.

Dissemination: ceil(log2 n) rounds; in round k rank r sends an empty frame to r + 2^k and
waits for one from r - 2^k. After the last round every rank has (transitively) heard from
all. Cost: ceil(log2 n) latency steps, n ceil(log2 n) empty frames.

Star: ranks 1..n-1 send an empty frame to rank 0 and wait for one back; rank 0 answers each
once it has heard from all. Cost: 2 latency steps, 2(n-1) empty frames (6 against 8 at four
ranks, 4 against 6 at three), one wake-up per non-root rank; rank 0's are serial, so the
automatic choice takes it at three and four ranks only (select.py, as the star allreduce).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from aiocollect.collectives import star as star_frames
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


async def star(op: Op) -> None:
    n = op.size
    if n == 1:
        return
    if op.rank != 0:
        fut = op.recv(0, 0, 0, _EMPTY)
        await op.send(0, 0, 0, _EMPTY)
        await fut
        return
    for fut in [op.recv(peer, 0, 0, _EMPTY) for peer in range(1, n)]:
        await fut
    for peer in range(1, n):
        await op.send(peer, 0, 0, _EMPTY)


@lru_cache(maxsize=256)
def star_program(n: int, rank: int) -> Program:
    """:func:`star` as rank ``rank``'s program for :class:`aiocollect.engine.small.Quick`
    (the star allreduce's frames, empty and with nothing to fold)."""
    return star_frames.program(n, rank)


def small_covers(n: int) -> bool:
    """Whether :func:`small_program` covers world size ``n`` (any above 1)."""
    return n > 1
