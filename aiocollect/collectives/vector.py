"""The two-phase v-collectives: first every rank's sizes, then the data.

- allgatherv (ring): an allgather of (rows, row size) per rank, then a ring allgather of
  the rows into one array. Each declared size is checked before anything is allocated.
- allgatherv (bruck): the same two exchanges in ceil(log2 n) rounds each
  (collectives/bruck.py); the rows by ring when they are more than
  ``select.BRUCK_MAX_BYTES`` in all.
- alltoallv (pairwise): an alltoall of (rows, row size) per destination, then a pairwise
  exchange of the rows straight into the output.

:func:`gather_v` is allgatherv's exchange; the object collectives reuse it with their own
size limit.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from aiocollect._buffers import Array
from aiocollect.collectives import bruck, direct, ring, select
from aiocollect.engine.op import Op
from aiocollect.errors import MismatchError, ProtocolError, UsageError

_I64 = np.dtype(np.int64)


def _host_memory() -> int:
    """Bytes one rank may declare in allgatherv: this host's physical memory (no block
    larger could be received here), at most 2**56 so that sizes cannot overflow int64."""
    try:
        return min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 1 << 56)
    except (ValueError, OSError, AttributeError):
        return 1 << 56


#: One exchange of :func:`gather_v`: ``(op, blocks, step)`` fills every block of
#: ``blocks`` from its rank (``blocks[op.rank]`` holds this rank's) and returns once all
#: have landed; ``step`` 0 exchanges the sizes, 1 the rows. The blocks are a
#: ``bruck.Tiled``: they tile one flat array in rank order.
Gather = Callable[[Op, Sequence[Array], int], Awaitable[None]]


async def ring_gather(o: Op, blocks: Sequence[Array], step: int) -> None:
    """:data:`Gather` by ring allgather (allgatherv's ``ring``)."""
    await ring.allgather_blocks(o, blocks, slot0=ring.AG_SLOT if step else 0)
    await o.finish()  # the last receives land after ring.allgather_blocks returns


async def gather_v(
    o: Op, arr: Array, kind: str, limit: int | None = None, gather: Gather = ring_gather
) -> list[tuple[int, Array]]:
    """The two phases of allgatherv: every rank's (rows, row size), then the rows, each
    exchanged by ``gather`` (default: by ring). Returns (rows, flat block) per rank, in
    rank order. Each rank's declared size is checked before anything is allocated:
    negative, or above ``limit`` bytes (default: this host's memory), is a ProtocolError
    (no real rank sends that); rows of another size than this rank's are a
    MismatchError."""
    limit = _host_memory() if limit is None else limit
    n, me, itemsize = o.size, o.rank, arr.itemsize
    row = int(np.prod(arr.shape[1:]))
    sizes = np.zeros((n, 2), dtype=_I64)
    sizes[me] = (arr.shape[0], row)
    await gather(o, bruck.Tiled(sizes.reshape(-1), range(0, 2 * n + 1, 2)), 0)
    rows, rrows = sizes[:, 0], sizes[:, 1]
    # rows * max(rrow, 1) * itemsize > limit, without overflow (the factor clamped)
    per = np.minimum(np.maximum(rrows, 1), limit // itemsize + 1) * itemsize
    bad = (rows < 0) | (rrows < 0) | (rows > limit // per)
    bad[me] = False
    if bad.any():
        r = int(np.argmax(bad))
        via = (
            (me - 1) % n  # (the ring's sender)
            if gather is ring_gather
            else bruck.source(n, me, r)
            if gather is bruck.gather
            else r
        )
        raise ProtocolError(
            f"{kind} (op #{o.seq}): rank {r} declared {int(rows[r])} rows of {int(rrows[r])} "
            f"elements of {itemsize} bytes (at most {limit} bytes"
            + ("" if via == r else f"; received from rank {via}")
            + ")"
        )
    if (rrows != row).any():
        r = int(np.argmax(rrows != row))
        raise MismatchError(
            f"{kind}: rank {r} sent rows of {int(rrows[r])} elements, rank {me} "
            f"rows of {row} (shape {arr.shape})"
        )
    bounds = np.zeros(n + 1, dtype=_I64)
    np.cumsum(rows * row, out=bounds[1:])
    blocks = bruck.Tiled(np.empty(int(bounds[-1]), dtype=arr.dtype), bounds.tolist())
    blocks[me][...] = arr.reshape(-1)
    await gather(o, blocks, 1)
    return list(zip(rows.tolist(), blocks, strict=True))


def small_gather(n: int) -> Gather:
    """The :data:`Gather` the automatic choice takes for ``n`` ranks: Bruck's from
    ``select.BRUCK_MIN_RANKS`` ranks on, else the ring's."""
    return bruck.gather if n >= select.BRUCK_MIN_RANKS else ring_gather


async def allgatherv(o: Op, arr: Array) -> list[Array]:
    """Every rank's ``arr`` (at least one axis; the first may differ per rank), in rank
    order, by ring. Raises as :func:`gather_v`."""
    blocks = await gather_v(o, arr, "allgatherv")
    return [b.reshape(rows, *arr.shape[1:]) for rows, b in blocks]


async def allgatherv_bruck(o: Op, arr: Array) -> list[Array]:
    """:func:`allgatherv` by Bruck's rounds (:func:`bruck.gather`). Raises as
    :func:`gather_v`."""
    blocks = await gather_v(o, arr, "allgatherv", gather=bruck.gather)
    return [b.reshape(rows, *arr.shape[1:]) for rows, b in blocks]


async def alltoallv(o: Op, arr: Array, counts: list[int], res: Array | None) -> list[Array]:
    """Rows ``[sum(counts[:i]), sum(counts[:i+1]))`` of ``arr`` go to rank i. The blocks
    received from each rank, in rank order (views of ``res`` when given, else of a fresh
    array).

    Raises:
        MismatchError: a rank sent rows of another size.
        UsageError: ``res`` does not have as many rows as arrive.
    """
    n = o.size
    row = int(np.prod(arr.shape[1:]))
    mine = np.array([[c, row] for c in counts], dtype=_I64)
    theirs = np.empty_like(mine)
    await direct.alltoall(o, list(mine), list(theirs), slot=0)
    await o.finish()
    if (theirs[:, 1] != row).any():
        raise MismatchError(
            f"alltoallv: ranks sent rows of {theirs[:, 1].tolist()} "
            f"elements, rank {o.rank} rows of {row}"
        )
    rows = theirs[:, 0]
    total = int(rows.sum())
    if res is not None and res.shape[0] != total:
        raise UsageError(f"alltoallv: out has {res.shape[0]} rows, {total} arrive")
    dest = res.reshape(-1) if res is not None else np.empty(total * row, arr.dtype)
    rb = np.concatenate([[0], np.cumsum(rows * row)])
    sb = np.concatenate([[0], np.cumsum(np.array(counts, dtype=_I64) * row)])
    flat = arr.reshape(-1)
    await direct.alltoall(
        o,
        [flat[sb[i] : sb[i + 1]] for i in range(n)],
        [dest[rb[i] : rb[i + 1]] for i in range(n)],
        slot=1,
    )
    return [dest[rb[i] : rb[i + 1]].reshape(int(rows[i]), *arr.shape[1:]) for i in range(n)]
