"""Recursive doubling and recursive halving-doubling allreduce, for any world size.

Non-power-of-two handling (both): with p the largest power of two <= n and rem = n - p, the
first 2*rem ranks pair up; each even one sends its whole buffer to its odd neighbour and sits
out; the odd ones and the ranks >= 2*rem (p "active" ranks, renumbered 0..p-1) run the
power-of-two algorithm; finally each odd rank sends the result back to its even neighbour.
That costs two extra steps of the full size for the folded ranks.

- recursive doubling: log2(p) steps; in step k active rank v exchanges its whole buffer with
  v xor 2^k and reduces. Latency log2(p) alpha, bytes log2(p) * size: best for small sizes.
- halving-doubling (Rabenseifner): a reduce-scatter by recursive halving (step k exchanges
  half of the current segment with v xor p/2^(k+1)), then an allgather by recursive doubling
  in reverse. Latency 2 log2(p) alpha, bytes 2 (p-1)/p * size: bandwidth-optimal too.

Both partners of a pair reduce in rank order (lower rank's data first), so every rank ends
with bit-identical results.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from aiocollect._buffers import Array
from aiocollect.engine.op import Op
from aiocollect.engine.reduce import reduce_into, settle
from aiocollect.engine.small import (
    Exchange,
    Program,
    divide,
    reduce_mine_first,
    reduce_theirs_first,
)

FOLD_SLOT = 0
STEP_SLOT = 1 << 10
GATHER_SLOT = 2 << 10
UNFOLD_SLOT = 3 << 10


def _fold_layout(n: int, rank: int) -> tuple[int, int, int]:
    """(p, rem, virtual rank or -1 if this rank sits out)."""
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if rank < 2 * rem:
        return p, rem, rank // 2 if rank % 2 else -1
    return p, rem, rank - rem


def _real(v: int, rem: int) -> int:
    return 2 * v + 1 if v < rem else v + rem


async def _transfer(op: Op, peer: int, slot: int, send: Array, recv: Array) -> None:
    """Exchange with ``peer``. Returns once ``recv`` is filled and ``send`` has left user
    space: the partner's data arriving does not mean ours left, and the caller is about to
    rewrite ``send``."""
    futs = op.recv_chunks(peer, slot, recv)
    await op.send_chunks(peer, slot, send)
    for fut in futs:
        await fut
    await op.sent_left(peer)


@lru_cache(maxsize=256)
def small_program(n: int, rank: int, average: bool) -> Program:
    """Recursive doubling for a power-of-two world size ``n`` and a one-frame buffer, as
    rank ``rank``'s program for :class:`aiocollect.engine.small.Quick` (the same frames
    and reduction order as :func:`recursive_doubling`): per step exchange the buffer with
    the partner and reduce, the lower rank's operand first, in place; ``average``: then
    divide by ``n``."""
    steps = tuple(
        Exchange(partner, partner, slot, True, reduce_mine_first if lower else reduce_theirs_first)
        for partner, slot, lower in _exchanges(n, rank)
    )
    return Program(steps, tmp=True, finish=divide if average else None)


@lru_cache(maxsize=64)
def _exchanges(n: int, v: int) -> tuple[tuple[int, int, bool], ...]:
    """Rank ``v``'s exchanges of recursive doubling over ``n`` ranks (a power of two):
    (partner, slot, whether ``v`` is the lower rank of the pair)."""
    out = []
    mask, k = 1, 0
    while mask < n:
        partner = v ^ mask
        out.append((partner, STEP_SLOT + k, v < partner))
        mask, k = mask << 1, k + 1
    return tuple(out)


async def _combine(ufunc: np.ufunc, mine: Array, theirs: Array, i_am_lower: bool) -> None:
    if i_am_lower:
        await reduce_into(ufunc, mine, theirs)
    else:  # keep the lower rank's operand first
        await reduce_into(ufunc, theirs, mine)
        mine[...] = theirs


async def _fold(op: Op, buf: Array, ufunc: np.ufunc, rem: int, v: int) -> None:
    r = op.rank
    if r >= 2 * rem:
        return
    if v < 0:
        await op.send_chunks(r + 1, FOLD_SLOT, buf)
    else:
        tmp = np.empty_like(buf)
        for fut in op.recv_chunks(r - 1, FOLD_SLOT, tmp):
            await fut
        await _combine(ufunc, buf, tmp, i_am_lower=False)


async def _unfold(op: Op, buf: Array, rem: int, v: int) -> None:
    r = op.rank
    if r >= 2 * rem:
        return
    if v < 0:
        for fut in op.recv_chunks(r + 1, UNFOLD_SLOT, buf):
            await fut
    else:
        await op.send_chunks(r - 1, UNFOLD_SLOT, buf)


async def recursive_doubling(op: Op, buf: Array, ufunc: np.ufunc, average: bool) -> None:
    """Allreduce of the flat ``buf`` in place (``average``: then divided by the world
    size) by recursive doubling."""
    if op.size > 1:
        await _recursive_doubling(op, buf, ufunc)
        if average:
            await op.finish()  # (settle rewrites buf: nothing sent from it may wait to leave)
    settle(buf, buf, op.size if average else 1)


async def halving_doubling(op: Op, buf: Array, ufunc: np.ufunc, average: bool) -> None:
    """Allreduce of the flat ``buf`` in place (``average``: then divided by the world
    size) by recursive halving, then doubling."""
    if op.size > 1:
        await _halving_doubling(op, buf, ufunc)
        if average:
            await op.finish()  # (settle rewrites buf: nothing sent from it may wait to leave)
    settle(buf, buf, op.size if average else 1)


def small_covers(n: int) -> bool:
    """Whether :func:`small_program` covers world size ``n`` (a power of two above 1)."""
    return n > 1 and not n & (n - 1)


async def _recursive_doubling(op: Op, buf: Array, ufunc: np.ufunc) -> None:
    n = op.size
    p, rem, v = _fold_layout(n, op.rank)
    await _fold(op, buf, ufunc, rem, v)
    if v >= 0:
        tmp = np.empty_like(buf)
        mask, k = 1, 0
        while mask < p:
            partner = v ^ mask
            await _transfer(op, _real(partner, rem), STEP_SLOT + k, buf, tmp)
            await _combine(ufunc, buf, tmp, i_am_lower=v < partner)
            mask, k = mask << 1, k + 1
    await _unfold(op, buf, rem, v)


async def _halving_doubling(op: Op, buf: Array, ufunc: np.ufunc) -> None:
    n = op.size
    p, rem, v = _fold_layout(n, op.rank)
    await _fold(op, buf, ufunc, rem, v)
    if v >= 0:
        lo, hi = 0, buf.size
        tmp = np.empty(buf.size - buf.size // 2, dtype=buf.dtype)
        history: list[tuple[int, int, int, int, int]] = []
        mask, k = p >> 1, 0
        while mask:
            partner = v ^ mask
            mid = lo + (hi - lo) // 2
            keep, give = ((lo, mid), (mid, hi)) if v < partner else ((mid, hi), (lo, mid))
            size = keep[1] - keep[0]
            await _transfer(
                op, _real(partner, rem), STEP_SLOT + k, buf[give[0] : give[1]], tmp[:size]
            )
            await _combine(ufunc, buf[keep[0] : keep[1]], tmp[:size], i_am_lower=v < partner)
            history.append((partner, keep[0], keep[1], give[0], give[1]))
            lo, hi = keep
            mask, k = mask >> 1, k + 1
        for k, (partner, klo, khi, glo, ghi) in reversed(list(enumerate(history))):
            futs = op.recv_chunks(_real(partner, rem), GATHER_SLOT + k, buf[glo:ghi])
            await op.send_chunks(_real(partner, rem), GATHER_SLOT + k, buf[klo:khi])
            for fut in futs:
                await fut
    await _unfold(op, buf, rem, v)
