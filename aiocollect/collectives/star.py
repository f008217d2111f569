"""Star allreduce: every rank sends its buffer to rank 0, which reduces them in rank order
and sends the result back to every rank.

Schedule: ranks 1..n-1 send their whole buffer to rank 0 and wait for the result; rank 0
reduces ``((x0 + x1) + x2) + ...`` as the buffers arrive (in rank order, so the result
does not depend on arrival order), divides for an AVG, and sends the result to ranks
1..n-1. Every rank ends with rank 0's bits.

Cost: 2 steps of latency, as recursive doubling at four ranks (at three, recursive doubling
folds a rank in and out: 4 steps), but 2(n-1) messages in all against n log2(n) (6 against
8 at four ranks), and each non-root rank sends, receives and wakes once per operation
instead of log2(n) times. Where the ranks share fewer cores than they are, that CPU is
the operation's time (``aiocollect bench allreduce -n 4 --small --algorithm star``
against ``--algorithm doubling``; docs/benchmarks.md, *Small operations, four ranks*). Rank
0 handles n-1 receives and n-1 sends one after the other, and on the coroutine path keeps
n-1 copies of
the buffer, so the star is for small buffers and few ranks: the automatic choice takes it
at three and four ranks up to ``select.ALLREDUCE_DOUBLING_MAX`` (select.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np

from aiocollect._buffers import Array
from aiocollect.engine.op import Op
from aiocollect.engine.reduce import reduce_into, settle
from aiocollect.engine.small import Exchange, Program, Quick, divide, reduce_mine_first

#: The slot of every frame (towards rank 0 and back: the two directions of a link are
#: told apart by the link).
SLOT = 0


async def allreduce(op: Op, buf: Array, ufunc: np.ufunc, average: bool) -> None:
    """Allreduce of the flat ``buf`` in place (``average``: then divided by the world
    size) through rank 0."""
    n = op.size
    if n == 1:
        return
    if op.rank != 0:
        # The result lands in buf: rank 0 sends it only once it has all of our frames,
        # so it cannot overwrite bytes still on their way out.
        futs = op.recv_chunks(0, SLOT, buf)
        await op.send_chunks(0, SLOT, buf)
        for fut in futs:
            await fut
        await op.finish()
        return
    tmps = [np.empty_like(buf) for _ in range(1, n)]  # n - 1 buffers: small ones only
    arrivals = [op.recv_chunks(peer, SLOT, tmps[peer - 1]) for peer in range(1, n)]
    parts = op.chunks(buf)
    tparts = [op.chunks(tmp) for tmp in tmps]
    for c, part in enumerate(parts):
        for peer in range(1, n):
            await arrivals[peer - 1][c]
            await reduce_into(ufunc, part, tparts[peer - 1][c])
    settle(buf, buf, n if average else 1)
    for peer in range(1, n):
        await op.send_chunks(peer, SLOT, buf)
    await op.finish()


def program(
    n: int,
    rank: int,
    fold: Callable[[Quick], None] | None = None,
    last: Callable[[Quick], None] | None = None,
) -> Program:
    """Rank ``rank``'s star for :class:`aiocollect.engine.small.Quick`: a non-root rank
    sends its buffer to rank 0 and receives the answer into it (posted first; rank 0
    answers only once it has our frame, so the answer cannot overwrite what we send);
    rank 0 receives from ranks 1..n-1 in rank order, into a scratch buffer with ``fold``
    after each (``last`` after rank n-1's) where given, then sends its buffer to each. The
    allreduce's and the barrier's (no fold: empty frames) one-frame programs."""
    if rank != 0:
        return Program((Exchange(0, 0, SLOT),))
    into_tmp = fold is not None
    steps = [
        Exchange(-1, peer, SLOT, into_tmp, fold if peer < n - 1 else last) for peer in range(1, n)
    ]
    steps += [Exchange(peer, -1, SLOT) for peer in range(1, n)]
    return Program(tuple(steps), tmp=into_tmp)


@lru_cache(maxsize=256)
def small_program(n: int, rank: int, average: bool) -> Program:
    """:func:`allreduce` of a one-frame buffer as rank ``rank``'s program (the same frames
    and reduction order): rank 0 folds each buffer in, the last one then divided for an
    AVG before the answer goes out."""
    return program(n, rank, reduce_mine_first, _fold_and_divide if average else reduce_mine_first)


def _fold_and_divide(q: Quick) -> None:
    reduce_mine_first(q)
    divide(q)


def small_covers(n: int) -> bool:
    """Whether :func:`small_program` covers world size ``n`` (any above 1)."""
    return n > 1
