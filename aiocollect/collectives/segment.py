"""The segment allreduce: copy in, reduce-scatter and copy out through shared memory
that the ranks of one host map (copy-in/copy-out as in Open MPI's ``coll/sm``, whose
allreduce folds everything into one rank's buffer in the segment and fans the result
out; here every rank folds one block, as in the pull allreduce).

Every rank owns a *slot segment* (:mod:`aiocollect.transport.shm_slots`: a sealed memfd
of ``REGIONS`` regions of ``SLOT_BYTES``), made at its first use in the group and mapped
by its peers at theirs. Schedule of rank r (n ranks, the flat buffer in n blocks, rank r
owns block r), in region k of its segment:

1. *Copy in.* Rank r copies its buffer, except block r, into region k, and sends every
   peer a *written* frame: its segment's descriptor and token (a peer maps the segment
   the first time it sees them), k and the length.
2. *Reduce-scatter.* Once rank q's written frame is here, rank r folds block r of q's
   region into block r of its own region (numpy straight on the mappings, q in the order
   r+1, r+2, ...: block r becomes ((x_r + x_{r+1}) + x_{r+2}) + ...; AVG then divides
   it), copies the result into its buffer and sends every peer a *reduced* frame.
3. *Copy out.* Once rank q said reduced, rank r copies block q of q's region into its
   buffer.

Every rank copies the buffer once in and once out and reads (n-1)/n of it from its
peers for the folds, all plain memory copies (a 512 KiB ``memcpy`` from a mapping took
about 20 us here, a ``process_vm_readv`` of the same bytes about 130 us, which is what
the pull allreduce pays twice), with 2 (n-1) empty or 56-byte frames per rank and two
waits for the peers: one round fewer than the pull allreduce, which must also hear that
its buffer is no longer read.

*Regions and operations in flight.* A rank runs its segment allreduces of a group one
after another, in the order they were called (an operation first waits for its
predecessor's end on this rank: they would compete for the same cores anyway), and
alternates between its two regions. So no finished round is needed: a peer's written
frame of operation j says the peer has finished operation j-1, so region k's previous
contents (operation j-2's) are read by nobody once every written frame of operation
j-1 arrived, which this rank waited for before operation j began. Falling back to the
pull allreduce where a region is busy was the other choice; but whether it is busy is
known to one rank only, and every rank must run the same algorithm.

Buffers over ``SLOT_BYTES`` and groups whose ranks are not all on one host (as the
rendezvous records say) run :func:`aiocollect.collectives.pull.allreduce` instead (the
same decision on every rank); the automatic choice takes this algorithm only where
every rank reads every other's memory (``Fabric.pulls``), for the sizes in
``select.SEGMENT_MIN`` .. ``select.SEGMENT_MAX``.

A peer that dies fails the receive of its next frame, as for any algorithm: this rank
never waits on the segment itself. Results are identical on every rank (each block is
reduced by one rank and copied), and the same as the pull allreduce's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from typing import NoReturn

import numpy as np

from aiocollect._buffers import Array
from aiocollect.collectives import pull
from aiocollect.engine.op import Op, flat_blocks
from aiocollect.engine.reduce import apply, copy_into, divide
from aiocollect.engine.turns import give_way
from aiocollect.errors import GroupBrokenError, InternalError, ProtocolError
from aiocollect.transport.shm_ring import TOKEN_BYTES
from aiocollect.transport.shm_slots import REGIONS, SlotSegment

WRITTEN, REDUCED = range(2)
#: Bytes per region: the largest buffer this algorithm copies through a segment (larger
#: ones run the pull allreduce). A rank's segment holds ``REGIONS`` of them (8 MiB).
SLOT_BYTES = 4 << 20
#: Bytes copied or folded per turn of the event loop.
STEP = 1 << 20
#: How long a rank whose peer's segment cannot be mapped waits for that peer's link to
#: say why (below, :func:`_unmappable`) before it calls the written frame a lie.
UNMAPPABLE_GRACE = 5.0
#: A written frame's words (uint64): pid, descriptor, region bytes, region, length, then
#: the token.
_HEAD = 5
_WORDS = _HEAD + TOKEN_BYTES // 8

_EMPTY = np.empty(0, dtype=np.uint8)


class Slots:
    """One group's segments on this rank: its own (made at the first operation), the
    peers' it mapped (by group rank), and the chain of its operations in call order.
    Kept in ``Fabric.resources`` and closed with the links."""

    def __init__(self) -> None:
        self.own: SlotSegment | None = None
        self.peers: dict[int, SlotSegment] = {}
        self.uses = 0
        #: The sequence number of the last operation that joined the chain.
        self.last_seq = -1
        self.closed = False
        #: The end of the last operation called on this rank (None: none yet).
        self.tail: asyncio.Future[None] | None = None

    def segment(self) -> SlotSegment:
        """This rank's segment, made at its first use.

        Raises:
            MemoryError: the host's shared memory cannot hold it.
            GroupBrokenError: the group closed (while the operation waited for its
                predecessor).
        """
        if self.closed:
            raise GroupBrokenError("the group closed: its slot segments are released")
        if self.own is None:
            self.own = SlotSegment.create(SLOT_BYTES)
        return self.own

    def peer(self, rank: int, record: Array) -> SlotSegment:
        """Group rank ``rank``'s segment as its written frame ``record`` names it, mapped
        at its first mention.

        Raises:
            ProtocolError: the record names no segment of this user that can be mapped
                (the message names the rank).
            GroupBrokenError: the group closed.
        """
        if self.closed:
            raise GroupBrokenError("the group closed: its slot segments are released")
        pid, fd, region_bytes = (int(x) for x in record[:3])
        token = record[_HEAD:].tobytes()
        seg = self.peers.get(rank)
        if seg is not None and seg.token == token and seg.region_bytes == region_bytes:
            return seg
        try:
            new = SlotSegment.attach(pid, fd, region_bytes, token)
        except (OSError, ProtocolError) as exc:
            raise ProtocolError(
                f"cannot map the slot segment of rank {rank} (descriptor {fd} of "
                f"process {pid}): {exc}"
            ) from exc
        if seg is not None:
            seg.close()
        self.peers[rank] = new
        return new

    def close(self) -> None:
        """Unmap every segment and close this rank's descriptor (idempotent)."""
        self.closed = True
        if self.own is not None:
            self.own.close()
        for seg in self.peers.values():
            seg.close()
        self.peers.clear()


def _slots(op: Op) -> Slots:
    """``op``'s group's segments on this rank, made at its first operation.

    Raises:
        GroupBrokenError: the group's links are closing (nothing is made then: what
            the fabric holds is released once).
    """
    if op.fabric.closing:
        raise GroupBrokenError("the group is closing: its slot segments are released")
    key = ("segment", op.gid)
    slots = op.fabric.resources.get(key)
    if not isinstance(slots, Slots):
        slots = op.fabric.resources[key] = Slots()
    return slots


def _one_host(op: Op) -> bool:
    """Whether the rendezvous records put every rank of ``op`` on one host."""
    hosts = op.fabric.hosts
    return bool(hosts) and len({hosts[w] for w in op.ranks}) == 1


async def _unmappable(q: int, reduced: asyncio.Future[None], exc: ProtocolError) -> NoReturn:
    """Rank ``q``'s written frame names a segment that cannot be mapped: a peer that died,
    or whose group broke or closed since it wrote (it released its segment, and its ABORT
    or GOODBYE follows on the link), fails ``reduced`` (its next receive) with that cause,
    which is raised; a peer that goes on, or says nothing within UNMAPPABLE_GRACE, lied.

    Raises:
        PeerError, GroupBrokenError: the link's failure (the peer's death or abort).
        ProtocolError: ``exc``, otherwise.
    """
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(reduced), UNMAPPABLE_GRACE)
    raise exc


async def _fold(ufunc: np.ufunc, a: Array, b: Array, out: Array) -> None:
    """``out = ufunc(a, b)``, ``STEP`` bytes per turn of the event loop."""
    step = max(1, STEP // out.itemsize)
    if out.size <= step:
        apply(ufunc, a, b, out)
        return
    for s in range(0, out.size, step):
        e = s + step
        apply(ufunc, a[s:e], b[s:e], out[s:e])
        await give_way()


async def allreduce(op: Op, buf: Array, ufunc: np.ufunc, average: bool) -> None:
    """Reduce the flat ``buf`` in place on every rank (``average``: then divide by the
    world size) through the ranks' slot segments (module docstring).

    Raises:
        ProtocolError: a peer's written frame is malformed or names no segment that can
            be mapped here (the group breaks).
        GroupBrokenError: the group is closing.
        InternalError: operations started out of call order (a bug).
        MemoryError: this rank's segment does not fit the host's shared memory.
        PeerDisconnected: a peer's link was lost.
    """
    n, r = op.size, op.rank
    if n == 1 or not buf.nbytes:  # (every rank's count is the same: none sends)
        return
    if buf.nbytes > SLOT_BYTES or not _one_host(op):
        await pull.allreduce(op, buf, ufunc, average)
        return
    slots = _slots(op)
    if op.seq <= slots.last_seq:  # (the regions' reuse relies on call order)
        raise InternalError(
            f"segment allreduce #{op.seq} started after #{slots.last_seq} on rank {r}"
        )
    slots.last_seq = op.seq
    prev = slots.tail
    end: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    slots.tail = end
    order = [(r + k) % n for k in range(1, n)]
    table = np.zeros((n, _WORDS), np.uint64)
    written = {q: op.recv_chunks(q, WRITTEN, table[q].view(np.uint8)) for q in order}
    reduced = {q: op.recv(q, REDUCED, 0, _EMPTY) for q in order}
    try:
        if prev is not None and not prev.done():
            await prev
        await _run(op, slots, buf, ufunc, average, order, table, written, reduced)
    finally:
        end.set_result(None)


async def _run(
    op: Op,
    slots: Slots,
    buf: Array,
    ufunc: np.ufunc,
    average: bool,
    order: list[int],
    table: Array,
    written: dict[int, list[asyncio.Future[None]]],
    reduced: dict[int, asyncio.Future[None]],
) -> None:
    """Steps 1-3 of the module docstring, once this rank's previous operation ended."""
    n, r = op.size, op.rank
    blocks = flat_blocks(buf, n)
    bounds = [0, *itertools.accumulate(b.size for b in blocks)]  # (elements)
    lo, hi = bounds[r], bounds[r + 1]
    own = slots.segment()
    k = slots.uses % REGIONS
    slots.uses += 1
    region = own.region(k, buf.nbytes).view(buf.dtype)
    await copy_into(region[:lo], buf[:lo], STEP)
    await copy_into(region[hi:], buf[hi:], STEP)
    record = _record(own, k, buf.nbytes)
    for q in order:
        for c, part in enumerate(op.chunks(record.view(np.uint8))):
            op.send_now(q, WRITTEN, c, part)

    mine, first = region[lo:hi], buf[lo:hi]
    theirs: dict[int, Array] = {}
    for q in order:
        for fut in written[q]:
            await pull.arrival(op, q, fut)
        try:
            theirs[q] = peer = _region(op, slots, q, table[q], buf)
        except ProtocolError as exc:
            await _unmappable(q, reduced[q], exc)
        await _fold(ufunc, first, peer[lo:hi], mine)
        first = mine
    if average:
        divide(mine, n)
    await copy_into(buf[lo:hi], mine, STEP)
    for q in order:
        op.send_now(q, REDUCED, 0, _EMPTY)

    for q in order:
        await pull.arrival(op, q, reduced[q])
        await copy_into(blocks[q], theirs[q][bounds[q] : bounds[q + 1]], STEP)
    own.handed_over()  # (every peer has mapped it: each said reduced)


def _record(own: SlotSegment, index: int, nbytes: int) -> Array:
    """A written frame's payload: ``own``'s process, descriptor, region size and token,
    and the region ``index`` holding the ``nbytes`` of this operation."""
    record = np.zeros(_WORDS, np.uint64)
    record[:_HEAD] = (os.getpid(), own.offered, own.region_bytes, index, nbytes)
    record[_HEAD:] = np.frombuffer(own.token, np.uint64)
    return record


def _region(op: Op, slots: Slots, q: int, record: Array, buf: Array) -> Array:
    """The region of rank ``q``'s segment that its written frame ``record`` names, as
    ``buf``'s dtype.

    Raises:
        ProtocolError: the record is malformed, or names a region of another length.
    """
    index, length = int(record[3]), int(record[4])
    if length != buf.nbytes:
        raise ProtocolError(
            f"rank {q} announced a {length}-byte region for a {buf.nbytes}-byte allreduce"
        )
    seg = slots.peer(q, record)
    try:
        return seg.region(index, length).view(buf.dtype)
    except ProtocolError as exc:
        raise ProtocolError(f"rank {q}'s written frame: {exc}") from None
