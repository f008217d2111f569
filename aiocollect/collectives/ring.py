"""Ring algorithms: bandwidth-optimal allreduce, reduce-scatter and allgather, pipelined in
chunks.

Schedule (n ranks, rank r sends to r+1 and receives from r-1, message split in n blocks):

- reduce-scatter: n-1 steps; at step s rank r sends block (r-s-1) mod n and receives block
  (r-s-2) mod n, reducing it into its own copy. Afterwards rank r holds block r reduced.
- allgather: n-1 steps; at step s rank r sends block (r-s) mod n and receives (r-s-1) mod n.

Cost per rank: (n-1) messages of size/n per phase, i.e. 2(n-1)/n * size bytes for an
allreduce, latency 2(n-1) alpha. Each block travels in chunks, and chunk c of step s+1 is sent
as soon as chunk c of step s has arrived (and been reduced), so the steps overlap. The
reduce-scatter receives into a reused window of ``RS_WINDOW_BYTES`` (not a block-sized
buffer) and sends no more than that window ahead of its own reductions.

The whole algorithms (:func:`allreduce`, :func:`reduce_scatter`, :func:`allgather`) are
what the registries run; they are built from the two phases over lists of blocks
(:func:`reduce_scatter_blocks`, :func:`allgather_blocks`), which the v-collectives reuse.
Over links that pull frames out of the sender's memory (shared memory) the whole
algorithms skip their up-front copies (see :func:`_pulled`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from aiocollect._buffers import Array
from aiocollect.engine.op import Op, flat_blocks, split_even
from aiocollect.engine.reduce import copy_into, divide, reduce_into, settle
from aiocollect.engine.scratch import SCRATCH
from aiocollect.engine.turns import give_way

RS_SLOT = 0
AG_SLOT = 1 << 20
#: Bytes of receive scratch a ring reduce-scatter uses (and sends ahead), in whole chunks.
RS_WINDOW_BYTES = 16 * 1024 * 1024
#: Fewest chunk slots in that window (one landing while one is reduced).
RS_MIN_SLOTS = 2
#: Slots when the predecessor's link pulls its frames out of the sender's memory (shared
#: memory): a frame whose receive is not posted waits there at no cost, so two slots do,
#: and a window that small stays in the cache the pulls and reductions work through
#: (docs/algorithms.md gives the measurement).
RS_PULL_SLOTS = 2

Forward = Callable[[int, Array], Awaitable[None]]


def _pulled(op: Op, peer: int, block_bytes: int) -> bool:
    """Whether frames of a ``block_bytes`` block (in chunks) between this rank and group
    rank ``peer`` are pulled out of the sender's memory (shared memory), in either
    direction: the ring then skips its up-front copies (see reduce_scatter, allgather)."""
    frame = min(block_bytes, op.chunk_bytes)
    caps = op.link(peer).caps
    return caps.pulls(frame) or not caps.copies(frame)


async def allreduce(op: Op, buf: Array, ufunc: np.ufunc, average: bool) -> None:
    """Reduce the flat ``buf`` in place on every rank (``average``: then divide by the
    world size): a reduce-scatter whose allgather starts chunk by chunk as soon as each
    chunk of this rank's block is reduced (the allgather's receives are posted first, so
    frames of a rank that runs ahead land in place)."""
    n = op.size
    blocks = flat_blocks(buf, n)
    gathered = post_allgather(op, blocks)
    nxt = (op.rank + 1) % n

    async def forward(c: int, chunk: Array) -> None:
        if average:
            divide(chunk, n)
        await op.send(nxt, AG_SLOT, c, chunk)

    await reduce_scatter_blocks(op, blocks, ufunc, finished=forward)
    await allgather_blocks(op, blocks, posted=gathered, first_sent=True)


async def reduce_scatter(op: Op, send: Array, dest: Array, ufunc: np.ufunc, average: bool) -> None:
    """Reduce the flat ``send`` across ranks; the flat ``dest`` gets this rank's block
    (block ``op.rank`` of ``op.size``), divided by the world size when ``average``.

    The ring reduces every block but the one it sends first, (r-1), exactly once; that
    one stays a view of the input, this rank's own block goes straight into ``dest``.
    Over links that pull, the reductions run out of place from the input (``sources``)
    into fresh arrays, so nothing is copied before the first pull; over TCP the input is
    copied first and reduced in place, which measured faster there (docs/algorithms.md).
    """
    n, r = op.size, op.rank
    blocks = list(split_even(send, n))
    pulled = n > 1 and _pulled(op, (r - 1) % n, blocks[0].nbytes)
    sources = list(blocks) if pulled else None
    for b in range(n):
        if b == r:
            if not pulled:
                dest[...] = blocks[b]
            blocks[b] = dest
        elif b != (r - 1) % n:
            blocks[b] = np.empty_like(blocks[b]) if pulled else blocks[b].copy()
    await reduce_scatter_blocks(op, blocks, ufunc, sources=sources)
    settle(blocks[r], dest, n if average else 1)


async def allgather(op: Op, send: Array, blocks: Sequence[Array]) -> None:
    """Gather every rank's flat ``send`` into ``blocks`` (block i from rank i). When the
    successor pulls, it reads straight from ``send`` while this rank copies it into
    place."""
    n = op.size
    if n > 1 and _pulled(op, (op.rank + 1) % n, send.nbytes):
        await allgather_blocks(op, blocks, own=send)
    else:
        await copy_into(blocks[op.rank], send)
        await allgather_blocks(op, blocks)


async def reduce_scatter_blocks(
    op: Op,
    blocks: list[Array],
    ufunc: np.ufunc,
    slot0: int = RS_SLOT,
    finished: Forward | None = None,
    sources: list[Array] | None = None,
) -> None:
    """After this, ``blocks[op.rank]`` holds the reduction of every rank's block.

    Each rank reduces every block but ``(r - 1) mod n`` exactly once. With ``sources``,
    ``sources[b]`` holds this rank's contribution to block b and ``blocks[b]`` is only
    written (``blocks[b] = ufunc(sources[b], received)``), so the caller need not copy its
    input into the working blocks first; ``blocks[(r - 1) mod n]`` is then only read.

    ``finished(c, chunk)`` is awaited as soon as chunk ``c`` of this rank's block is fully
    reduced: an allreduce starts its allgather there, chunk by chunk, instead of after the
    whole reduce-scatter.

    Receive scratch is a bounded window (see :func:`window_slots`; ``RS_PULL_SLOTS``
    chunks when the predecessor's link pulls frames out of its memory), leased from
    :data:`~aiocollect.engine.scratch.SCRATCH` and used cyclically: the receives are
    numbered in the order they are reduced (step by step, chunk by chunk), receive ``i``
    lands in slot ``i % K`` and is posted as soon as receive ``i - K`` has been reduced.
    Chunks are reduced one at a time (a worker thread takes chunks of at least
    ``THREAD_THRESHOLD`` bytes), with a yield to the loop after each.

    Sends go out in the order the successor reduces them. Chunk ``c`` of step ``s + 1``
    leaves as soon as chunk ``c`` of step ``s`` is reduced, unless it is ``K`` or more
    frames ahead of this rank's own reductions: every rank runs the same schedule, so the
    successor has then not posted a receive for it yet, and it would only be staged
    (allocated and copied) there; it leaves once this rank catches up. Each link's frames
    of one operation arrive in receive order (so a link that stops reading while its
    staging is full never holds a frame a posted receive waits for behind staged ones),
    and the successor stages at most what it lags behind this rank (data that arrives
    early still works, just slower).
    """
    n, r = op.size, op.rank
    if n == 1:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    # What this rank reduces, in order: step s, chunk c of block (r-s-2) mod n.
    recvs = [
        (s, c, dst)
        for s in range(n - 1)
        for c, dst in enumerate(op.chunks(blocks[(r - s - 2) % n]))
    ]
    bases: list[Array | None] = [None] * len(recvs)
    if sources is not None:
        bases = [base for s in range(n - 1) for base in op.chunks(sources[(r - s - 2) % n])]
    # What it sends, in the order its successor reduces them: step s, chunk c of block
    # (r-s-1) mod n; step 0 is this rank's own data, step s+1 the chunk it reduced as
    # receive i at step s (sendable once i+1 receives are reduced).
    sends: list[tuple[int, int, Array, int]] = [
        (0, c, part, 0) for c, part in enumerate(op.chunks(blocks[(r - 1) % n]))
    ]
    sends += [(s + 1, c, dst, i + 1) for i, (s, c, dst) in enumerate(recvs) if s < n - 2]
    lead = window_slots(op.chunk_bytes, blocks[0].dtype.itemsize)
    sent = 0

    async def pump(done: int, limit: int) -> None:
        """Send what ``done`` reductions made ready, up to ``limit`` frames in all."""
        nonlocal sent
        while sent < len(sends) and sent < limit and sends[sent][3] <= done:
            s, c, src, _ = sends[sent]
            sent += 1
            await op.send(nxt, slot0 + s, c, src)

    if not recvs:
        await pump(0, len(sends))
        return
    width = max(dst.size for _, _, dst in recvs)
    frame = width * blocks[0].dtype.itemsize
    k = min(RS_PULL_SLOTS if op.link(prv).caps.pulls(frame) else lead, len(recvs))
    if not op.link(nxt).caps.copies(frame):  # the successor pulls: it has the small window
        lead = RS_PULL_SLOTS
    window = SCRATCH.acquire(k * width, blocks[0].dtype)
    slots = [window[j * width : (j + 1) * width] for j in range(k)]
    futs: list[asyncio.Future[None] | None] = [None] * k
    reducing = False

    def post(i: int) -> None:
        s, c, dst = recvs[i]
        futs[i % k] = op.recv(prv, slot0 + s, c, slots[i % k][: dst.size])

    try:
        for i in range(k):
            post(i)
        await pump(0, lead)
        for i, (s, c, dst) in enumerate(recvs):
            fut = futs[i % k]
            assert fut is not None
            await fut
            reducing = True
            await reduce_into(ufunc, dst, slots[i % k][: dst.size], bases[i])
            reducing = False
            if i + k < len(recvs):
                post(i + k)
            nxt_fut = futs[(i + 1) % k]
            if nxt_fut is not None and nxt_fut.done():
                await give_way()  # a done future does not yield: let what arrived run first
            await pump(i + 1, i + 1 + lead)
            if s == n - 2 and finished is not None:
                await finished(c, dst)
        await pump(len(recvs), len(sends))
    finally:
        # Reuse the window only if no transport can still write into it and no worker
        # thread still reads it; otherwise let it go with the failed operation.
        if not reducing and all(
            f is None or (f.done() and not f.cancelled() and f.exception() is None) for f in futs
        ):
            SCRATCH.release(window)
        else:
            SCRATCH.discard(window)


def window_slots(chunk_bytes: int, itemsize: int) -> int:
    """Chunk slots in a reduce-scatter's receive window, and how many frames a rank sends
    ahead of its own reductions: ``RS_WINDOW_BYTES`` worth of chunks, at least
    ``RS_MIN_SLOTS``. Depends only on values every rank shares."""
    chunk = max(1, chunk_bytes // max(1, itemsize)) * itemsize
    return max(RS_MIN_SLOTS, RS_WINDOW_BYTES // chunk)


def post_allgather(
    op: Op, blocks: Sequence[Array], slot0: int = AG_SLOT
) -> list[list[asyncio.Future[None]]]:
    """Post every receive of the ring allgather straight into its destination block.

    An allreduce posts them before its reduce-scatter, so allgather frames of a peer that
    runs ahead land in place instead of being staged: the frame for block b can only be
    sent once every rank's contribution to b, this rank's included, has left, so this rank
    no longer reads or writes b for the reduce-scatter by then.
    """
    n, r = op.size, op.rank
    prv = (r - 1) % n
    return [
        [
            op.recv(prv, slot0 + s, c, part)
            for c, part in enumerate(op.chunks(blocks[(r - s - 1) % n]))
        ]
        for s in range(n - 1)
    ]


async def allgather_blocks(
    op: Op,
    blocks: Sequence[Array],
    slot0: int = AG_SLOT,
    posted: list[list[asyncio.Future[None]]] | None = None,
    first_sent: bool = False,
    own: Array | None = None,
) -> None:
    """Before: ``blocks[op.rank]`` holds this rank's data, or ``own`` does (it is sent
    from there, then copied into ``blocks[op.rank]`` while the successor receives it).
    After: every block is filled. ``first_sent``: the caller already sent this rank's
    block (step 0)."""
    n, r = op.size, op.rank
    if n == 1:
        if own is not None:
            await copy_into(blocks[r], own)
        return
    nxt = (r + 1) % n
    futs = posted if posted is not None else post_allgather(op, blocks, slot0)
    if not first_sent:
        for c, part in enumerate(op.chunks(blocks[r] if own is None else own)):
            await op.send(nxt, slot0, c, part)
    if own is not None:
        await copy_into(blocks[r], own)
    for s in range(n - 2):
        parts = op.chunks(blocks[(r - s - 1) % n])
        for c, part in enumerate(parts):
            await futs[s][c]
            await op.send(nxt, slot0 + s + 1, c, part)
            await asyncio.sleep(0)
