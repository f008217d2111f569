"""The pull allreduce: every rank reads its peers' arrays straight out of their memory
(one-sided), so a bulk allreduce costs a handful of small frames instead of a frame per
chunk and step.

Schedule (n ranks, the flat buffer in n blocks, rank r owns block r):

1. *Addresses.* Every rank sends every peer one frame: where its buffer lies in its
   memory, its length, and whether it pushes to that peer instead (below).
2. *Reduce-scatter.* For k = 1 .. n-1, rank r reads block r of rank (r+k)'s buffer in
   ``RS_STEP`` pieces into scratch and folds each piece into its own block r, with a turn
   of the event loop after each: block r becomes ((x_r + x_{r+1}) + x_{r+2}) + ...
   (AVG then divides it). Meanwhile the peers read the other blocks of r's buffer, which
   r leaves as they are: only block r changes, and no peer reads it before step 3.
3. *Done.* Rank r tells every peer that block r is final (an empty frame).
4. *Allgather.* For k = 1 .. n-1, once rank q = (r+k) said done, rank r reads block q of
   q's buffer straight into its own block q (``AG_STEP`` per loop turn). Writing that
   block is safe then: q's done means q has read it (its step 2).
5. *Finished.* Rank r tells every peer it read from that it is finished, and ends once
   every peer that reads its buffer said so: the buffer is then the caller's again.

Every rank reads and writes what a ring moves (2 (n-1)/n of the buffer, one copy each,
(n-1)/n of it reduced) with 3 (n-1) small frames per rank, against the ring's
2 (n-1) frames per chunk of a block, whose per-frame interpreter work is what four ranks
on two cores wait for (docs/benchmarks.md, *Sixteenth session*). At step k every rank
reads from a different peer, so no rank's memory serves two readers at once.

*Reading.* ``Link.read_peer`` (``process_vm_readv`` on shared-memory links whose pull
check worked; ``caps.reference_min`` on the owner's side says the peer reads it). The
address frames are checked (length equal to this rank's buffer, a non-zero address); the
kernel checks that the range is the peer's own memory, and a range that is not breaks
the link and the group with a ProtocolError.

*Fallback: pushes.* A rank whose peer cannot read its memory (that link's pull check
failed, pulls are turned off, or the link is not shared memory: the automatic choice
takes this algorithm only where the rendezvous records predict pulls everywhere, but a
check can still fail, and ``algorithm="pull"`` may be forced anywhere) says so in its
address frame and sends that peer the data it would have read as ordinary frames: block
q of its buffer (slot ``PUSH_RS``) for the reduce-scatter and, instead of the done frame,
its final block (``PUSH_AG``). So the algorithm is correct over any links, and fast where
it reads.

Results are identical on every rank (each block is reduced by one rank and copied), but
not bit-identical to the ring's, whose fold order differs.
"""

from __future__ import annotations

import asyncio

import numpy as np

from aiocollect._buffers import Array, byte_view
from aiocollect.engine.op import Op, flat_blocks
from aiocollect.engine.reduce import reduce_into
from aiocollect.engine.scratch import SCRATCH
from aiocollect.errors import ProtocolError

ADDR, DONE, FIN, PUSH_RS, PUSH_AG = range(5)
#: Address-frame flag: the sender pushes to this peer instead of being read.
PUSHES = 1
#: Bytes read and reduced per turn of the event loop in the reduce-scatter (the
#: scratch: about this host's L2 per core; 256 and 512 KiB measured slower).
RS_STEP = 1 << 20
#: Bytes read per turn of the event loop in the allgather (no reduction to follow).
AG_STEP = 4 << 20

_EMPTY = np.empty(0, dtype=np.uint8)


def _record(base: int, nbytes: int, push: bool) -> Array:
    """An address frame's payload: the buffer's address and length in this process, and
    ``PUSHES`` when this rank pushes to the peer instead of being read."""
    return np.array([base, nbytes, PUSHES if push else 0], np.uint64)


async def allreduce(op: Op, buf: Array, ufunc: np.ufunc, average: bool) -> None:
    """Reduce the flat ``buf`` in place on every rank (``average``: then divide by the
    world size), reading the peers' buffers where their links allow (module docstring).

    Raises:
        ProtocolError: a peer's address frame is malformed, or names memory the peer
            does not have (the group breaks).
        PeerDisconnected: a peer's process is gone while its memory is read.
    """
    n, r = op.size, op.rank
    if n == 1 or not buf.nbytes:  # (every rank's count is the same: none sends)
        return
    blocks = flat_blocks(buf, n)
    mine = blocks[r]
    itemsize = buf.itemsize
    offsets = [0] * n
    for b in range(1, n):
        offsets[b] = offsets[b - 1] + blocks[b - 1].nbytes
    order = [(r + k) % n for k in range(1, n)]
    # this rank pushes to the peers that cannot read its memory
    push_to = {q: not op.link(q).caps.reference_min for q in order}
    table = np.zeros((n, 3), np.uint64)
    # (in chunks like any payload: a group's frames may be smaller than the record)
    addrs = {q: op.recv_chunks(q, ADDR, table[q].view(np.uint8)) for q in order}
    fins = {q: op.recv(q, FIN, 0, _EMPTY) for q in order if not push_to[q]}
    base = int(buf.ctypes.data)
    for q in order:
        record = _record(base, buf.nbytes, push_to[q])
        for c, part in enumerate(op.chunks(record.view(np.uint8))):
            op.send_now(q, ADDR, c, part)
    for q in order:
        if push_to[q]:
            for c, part in enumerate(op.chunks(blocks[q])):
                await op.send(q, PUSH_RS, c, part)

    pushed: dict[int, list[asyncio.Future[None]]] = {}  # allgather frames of pushers
    dones: dict[int, asyncio.Future[None]] = {}
    step = max(1, RS_STEP // itemsize)
    scratch = SCRATCH.acquire(min(step, max(1, mine.size)), mine.dtype)
    try:
        sview = byte_view(scratch)
        for q in order:
            for fut in addrs[q]:
                await fut
            addr, length, flags = (int(x) for x in table[q])
            if length != buf.nbytes or flags & ~PUSHES:
                raise ProtocolError(
                    f"rank {q} sent a malformed address frame ({length} bytes, flags "
                    f"{flags:#x}) for a {buf.nbytes}-byte allreduce"
                )
            if flags & PUSHES:
                part = np.empty_like(mine)
                futs = op.recv_chunks(q, PUSH_RS, part)
                # its block q lands in place: q pushes it only after reading what it needs
                pushed[q] = op.recv_chunks(q, PUSH_AG, blocks[q])
                for fut in futs:
                    await fut
                await reduce_into(ufunc, mine, part)
                continue
            link = op.link(q)
            if not link.caps.pull_min or not addr:
                raise ProtocolError(
                    f"rank {q} asked to be read ({addr:#x}), but this side cannot read it"
                )
            dones[q] = op.recv(q, DONE, 0, _EMPTY)
            src = addr + offsets[r]
            for s in range(0, mine.size, step):
                m = min(step, mine.size - s)
                link.read_peer(sview[: m * itemsize], src + s * itemsize)
                piece = mine[s : s + m]
                ufunc(piece, scratch[:m], out=piece)
                await asyncio.sleep(0)
    finally:
        SCRATCH.release(scratch)  # (only ever written by the synchronous reads above)
    if average:
        mine /= n

    for q in order:
        if not push_to[q]:
            op.send_now(q, DONE, 0, _EMPTY)
    for q in order:
        if push_to[q]:
            for c, part in enumerate(op.chunks(mine)):
                await op.send(q, PUSH_AG, c, part)

    view = byte_view(buf)
    for q in order:
        if q in pushed:
            for fut in pushed[q]:
                await fut
            continue
        await dones[q]
        link = op.link(q)
        lo, hi = offsets[q], offsets[q] + blocks[q].nbytes
        src = int(table[q, 0])
        while lo < hi:
            e = min(hi, lo + AG_STEP)
            link.read_peer(view[lo:e], src + lo)
            lo = e
            await asyncio.sleep(0)
        op.send_now(q, FIN, 0, _EMPTY)
    for fut in fins.values():
        await fut
