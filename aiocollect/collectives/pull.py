"""The pull allreduce: every rank reads its peers' arrays straight out of their memory
(one-sided), so a bulk allreduce costs a handful of small frames instead of a frame per
chunk and step.

Schedule (n ranks, the flat buffer in n blocks, rank r owns block r):

1. *Tokens.* Every rank exposes its buffer to every peer (``Link.expose``) and sends
   it one frame: the token the link returned, the buffer's length, and whether it pushes
   to that peer instead (below).
2. *Reduce-scatter.* For k = 1 .. n-1, rank r reads block r of rank (r+k)'s buffer in
   ``RS_STEP`` pieces into scratch and folds each piece into its own block r, giving the
   event loop way after each (:func:`~aiocollect.engine.turns.give_way`: what arrived
   meanwhile runs before the next piece): block r becomes ((x_r + x_{r+1}) + x_{r+2}) + ...
   (AVG then divides it). Meanwhile the peers read the other blocks of r's buffer, which
   r leaves as they are: only block r changes, and no peer reads it before step 3.
3. *Done.* Rank r tells every peer that block r is final (an empty frame).
4. *Allgather.* For k = 1 .. n-1, once rank q = (r+k) said done, rank r reads block q of
   q's buffer straight into its own block q (``AG_STEP`` per loop turn). Writing that
   block is safe then: q's done means q has read it (its step 2).
5. *Finished.* Rank r tells every peer it read from that it is finished, and ends once
   every peer that reads its buffer said so: it ends its exposures (``Link.unexpose``)
   and the buffer is the caller's again.

Every rank reads and writes what a ring moves (2 (n-1)/n of the buffer, one copy each,
(n-1)/n of it reduced) with 3 (n-1) small frames per rank, against the ring's
2 (n-1) frames per chunk of a block, whose per-frame interpreter work is what four ranks
on two cores wait for (docs/benchmarks.md: the pull allreduce's measurements). At step k
every rank reads from a different peer, so no rank's memory serves two readers at once.

*Reading.* Only through the links' one-sided seam (transport/base.py): ``caps.exposes``
on the owner's side says the peer reads what it exposes, ``caps.reads`` on the reader's
that it reads, and ``Link.read_exposed(token, offset, into)`` copies (on shared memory,
one ``process_vm_readv`` per piece). This module never sees an address: the token frames
are checked here for their shape (the length equal to this rank's buffer, a token of at
most ``TOKEN_MAX`` bytes), the token by the reading link, and a bad one breaks the link
and the group with a ProtocolError.

*Fallback: pushes.* A rank whose peer cannot read its memory (that link's pull check
failed, pulls are turned off, or the link has no one-sided reads: the automatic choice
takes this algorithm only where the rendezvous records predict reads everywhere, but a
check can still fail, and ``algorithm="pull"`` may be forced anywhere) says so in its
token frame and sends that peer the data it would have read as ordinary frames: block
q of its buffer (slot ``PUSH_RS``) for the reduce-scatter and, instead of the done frame,
its final block (``PUSH_AG``). So the algorithm is correct over any links, and fast where
it reads.

*The bulk worker.* Where the group has one (``AIOCOLLECT_BULK_THREAD``:
:mod:`aiocollect.engine.bulk`), the reads and folds of blocks of ``bulk.MIN_BYTES`` or more
run there, ``bulk.HOP`` bytes per hop, in the same pieces, instead of on the loop's thread
between ``give_way`` turns; everything else (the frames, the order of the steps) is the
same.

The reduce-scatter, allgather and broadcast of this module are parts of the same scheme
(their docstrings say which).

Results are identical on every rank (each block is reduced by one rank and copied), but
not bit-identical to the ring's, whose fold order differs.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence

import numpy as np

from aiocollect._buffers import Array, byte_view
from aiocollect.engine import bulk
from aiocollect.engine.op import Op, flat_blocks, split_even
from aiocollect.engine.reduce import apply, copy_into, divide, reduce_into
from aiocollect.engine.scratch import SCRATCH
from aiocollect.engine.turns import give_way
from aiocollect.errors import InternalError, PeerDisconnected, ProtocolError
from aiocollect.transport.base import TOKEN_MAX, Link

TOKEN, DONE, FIN, PUSH_RS, PUSH_AG = range(5)
#: Token-frame flag: the sender pushes to this peer instead of being read.
PUSHES = 1
#: A token frame's words (uint64): the buffer's length, the flags and the token's length,
#: then room for ``TOKEN_MAX`` bytes of token.
_HEAD = 3
_WORDS = _HEAD + (TOKEN_MAX + 7) // 8
#: Bytes read and reduced per turn of the event loop in the reduce-scatter (the
#: scratch: about this host's L2 per core; 256 and 512 KiB measured slower).
RS_STEP = 1 << 20
#: Bytes read per turn of the event loop in the allgather (no reduction to follow).
AG_STEP = 4 << 20

_EMPTY = np.empty(0, dtype=np.uint8)


def _record(token: bytes, nbytes: int, push: bool) -> Array:
    """A token frame's payload: the buffer's length, ``PUSHES`` when this rank pushes to
    the peer instead of being read, and the token the link returned (empty then)."""
    record = np.zeros(_WORDS, np.uint64)
    record[:_HEAD] = (nbytes, PUSHES if push else 0, len(token))
    record.view(np.uint8)[_HEAD * 8 : _HEAD * 8 + len(token)] = np.frombuffer(token, np.uint8)
    return record


class _Exchange:
    """One operation's tokens and its end: this rank's buffer ``buf`` exposed to every
    peer (read, or pushed to where the peer cannot read it), the peers' tokens as they
    come, and the finished frames that hand every buffer back. A context manager: leaving
    it ends this rank's exposures, however the operation ends."""

    def __init__(
        self,
        op: Op,
        buf: Array,
        what: str,
        readers: Sequence[int] | None = None,
        sources: Sequence[int] | None = None,
    ) -> None:
        """Expose ``buf`` to ``readers`` and expect the tokens of ``sources`` (both default
        to every peer, in the order r+1, r+2, ...: ``order``).

        Raises:
            InternalError: a link returned a token longer than ``TOKEN_MAX``.
        """
        n, r = op.size, op.rank
        self.op = op
        self.what = what
        self.nbytes = buf.nbytes
        self.order = [(r + k) % n for k in range(1, n)]
        readers = self.order if readers is None else readers
        sources = self.order if sources is None else sources
        # this rank pushes to the peers that cannot read what it exposes
        self.push_to = {q: not op.link(q).caps.exposes for q in readers}
        self.table = np.zeros((n, _WORDS), np.uint64)
        # (in chunks like any payload: a group's frames may be smaller than the record)
        self._tokens = {q: op.recv_chunks(q, TOKEN, self.table[q].view(np.uint8)) for q in sources}
        self._fins = [(q, op.recv(q, FIN, 0, _EMPTY)) for q in readers if not self.push_to[q]]
        self._exposed: list[tuple[Link, bytes]] = []
        try:
            self._announce(buf, readers)
        except BaseException:
            self.__exit__()
            raise

    def _announce(self, buf: Array, readers: Sequence[int]) -> None:
        """Expose ``buf`` to the ``readers`` that can read it and send each its token
        frame."""
        op, view = self.op, byte_view(buf)
        for q in readers:
            token = b""
            if not self.push_to[q]:
                link = op.link(q)
                token = link.expose(view)
                self._exposed.append((link, token))
                if len(token) > TOKEN_MAX:
                    raise InternalError(
                        f"the link to rank {q} made a {len(token)}-byte token (most: {TOKEN_MAX})"
                    )
            record = _record(token, buf.nbytes, self.push_to[q])
            for c, part in enumerate(op.chunks(record.view(np.uint8))):
                op.send_now(q, TOKEN, c, part)

    def __enter__(self) -> _Exchange:
        return self

    def __exit__(self, *exc: object) -> None:
        """End every exposure of this rank's buffer (its readers have finished, or the
        operation failed)."""
        exposed, self._exposed = self._exposed, []
        for link, token in exposed:
            link.unexpose(token)

    async def token(self, q: int) -> bytes | None:
        """Rank ``q``'s token once its frame is here, None when it pushes.

        Raises:
            ProtocolError: the frame is malformed, or asks to be read where this side
                cannot read.
            PeerDisconnected: the link to ``q`` closed after the frame came (the peer
                died or the group broke); the link's failure where it has one.
        """
        for fut in self._tokens[q]:
            await arrival(self.op, q, fut)
        length, flags, size = (int(x) for x in self.table[q, :_HEAD])
        if length != self.nbytes or flags & ~PUSHES or size > TOKEN_MAX:
            raise ProtocolError(
                f"rank {q} sent a malformed token frame ({length} bytes, flags "
                f"{flags:#x}, a {size}-byte token) for a {self.nbytes}-byte {self.what}"
            )
        if flags & PUSHES:
            return None
        link = self.op.link(q)
        if link.closed:  # (a closed link reads nothing: its caps no longer say it does)
            raise link.failure or PeerDisconnected(
                f"link to {link.describe()} closed before its token was read", link.peer
            )
        if not link.caps.reads or not size:
            raise ProtocolError(
                f"rank {q} asked to be read ({size}-byte token), but this side cannot read it"
            )
        return bytes(self.table[q].view(np.uint8)[_HEAD * 8 : _HEAD * 8 + size])

    async def read(self, q: int, dest: memoryview, token: bytes, offset: int) -> None:
        """Copy ``len(dest)`` bytes from ``offset`` of what rank ``q`` exposed as
        ``token``, ``AG_STEP`` at a time: in the group's bulk worker where it has one
        (``bulk.HOP`` per hop), else giving the event loop way after each piece."""
        link = self.op.link(q)
        worker = self.op.fabric.bulk
        if worker is not None and len(dest) >= bulk.MIN_BYTES:
            for lo in range(0, len(dest), bulk.HOP):
                e = min(len(dest), lo + bulk.HOP)
                await worker.run(_read, link, token, offset + lo, dest[lo:e])
            return
        lo, hi = 0, len(dest)
        while lo < hi:
            e = min(hi, lo + AG_STEP)
            link.read_exposed(token, offset + lo, dest[lo:e])
            lo = e
            await give_way()

    async def fold(
        self,
        q: int,
        token: bytes,
        offset: int,
        dest: Array,
        ufunc: np.ufunc,
        scratch: Array,
        base: Array | None = None,
    ) -> None:
        """``dest = ufunc(dest, x)`` (with ``base``: ``ufunc(base, x)``), where ``x`` is
        ``dest.nbytes`` bytes from ``offset`` of what rank ``q`` exposed as ``token``, read
        ``scratch.size`` elements at a time into ``scratch``: in the group's bulk worker
        where it has one (``bulk.HOP`` per hop), else giving the event loop way after each
        piece."""
        fold = _Fold(self.op.link(q), token, offset, dest, ufunc, scratch, base)
        worker = self.op.fabric.bulk
        if worker is not None and dest.nbytes >= bulk.MIN_BYTES:
            hop = max(scratch.size, bulk.HOP // dest.itemsize)
            for s in range(0, dest.size, hop):
                await worker.run(fold.pieces, s, min(dest.size, s + hop))
            return
        for s in range(0, dest.size, scratch.size):
            fold(s, min(dest.size, s + scratch.size))
            await give_way()

    async def push(self, slot: int, parts: Sequence[Array]) -> None:
        """Send every peer this rank pushes to its part ``parts[q]`` as frames of
        ``slot``."""
        for q, push in self.push_to.items():
            if push:
                for c, part in enumerate(self.op.chunks(parts[q])):
                    await self.op.send(q, slot, c, part)

    async def fold_pushed(
        self, q: int, dest: Array, ufunc: np.ufunc, base: Array | None = None
    ) -> None:
        """As :meth:`fold`, for the block rank ``q`` pushes (``PUSH_RS`` frames)."""
        part = np.empty_like(dest)
        await _landed(self.op.recv_chunks(q, PUSH_RS, part))
        await reduce_into(ufunc, dest, part, base)

    def finished(self, q: int) -> None:
        """Tell rank ``q`` this rank has read all it needs from it."""
        self.op.send_now(q, FIN, 0, _EMPTY)

    async def handed_back(self) -> None:
        """Wait until every peer that reads this rank's buffer has said it finished."""
        for q, fut in self._fins:
            await arrival(self.op, q, fut)


class _Fold:
    """One fold of :meth:`_Exchange.fold`, callable on any thread for a range of
    elements."""

    def __init__(
        self,
        link: Link,
        token: bytes,
        offset: int,
        dest: Array,
        ufunc: np.ufunc,
        scratch: Array,
        base: Array | None,
    ) -> None:
        self.link, self.token, self.offset = link, token, offset
        self.dest, self.ufunc, self.scratch = dest, ufunc, scratch
        self.first = dest if base is None else base
        self.sview = byte_view(scratch)

    def __call__(self, lo: int, hi: int) -> None:
        """Fold elements ``lo`` .. ``hi`` of the destination, ``scratch.size`` at a time."""
        step, itemsize = self.scratch.size, self.dest.itemsize
        for s in range(lo, hi, step):
            m = min(step, hi - s)
            self.link.read_exposed(
                self.token, self.offset + s * itemsize, self.sview[: m * itemsize]
            )
            apply(self.ufunc, self.first[s : s + m], self.scratch[:m], self.dest[s : s + m])

    def pieces(self, halt: threading.Event, lo: int, hi: int) -> None:
        """Fold elements ``lo`` .. ``hi`` in the bulk worker, a piece (``scratch.size``) at
        a time, stopping between pieces once ``halt`` is set (the operation was
        cancelled)."""
        step = self.scratch.size
        for s in range(lo, hi, step):
            if halt.is_set():
                return
            self(s, min(hi, s + step))


def _read(halt: threading.Event, link: Link, token: bytes, offset: int, dest: memoryview) -> None:
    """``len(dest)`` bytes from ``offset`` of ``token`` in the bulk worker, ``AG_STEP`` at
    a time, stopping between pieces once ``halt`` is set (the operation was cancelled)."""
    for lo in range(0, len(dest), AG_STEP):
        if halt.is_set():
            return
        e = min(len(dest), lo + AG_STEP)
        link.read_exposed(token, offset + lo, dest[lo:e])


async def arrival(op: Op, q: int, fut: asyncio.Future[None]) -> None:
    """Wait for the receive ``fut`` from rank ``q``, posted when the operation started:
    the link polls for it again first (:meth:`Link.expect`), since its spin after the
    posting has long ended where a read or a fold came in between."""
    if not fut.done():
        op.link(q).expect()
    await fut


async def _landed(futs: list[asyncio.Future[None]]) -> None:
    """Wait for every receive in ``futs`` (the frames of one pushed array)."""
    for fut in futs:
        await fut


def _scratch(block: Array) -> Array:
    """Scratch for one ``RS_STEP`` piece of ``block``'s dtype (release it with
    ``SCRATCH.release``)."""
    step = max(1, RS_STEP // block.itemsize)
    return SCRATCH.acquire(min(step, max(1, block.size)), block.dtype)


async def allreduce(op: Op, buf: Array, ufunc: np.ufunc, average: bool) -> None:
    """Reduce the flat ``buf`` in place on every rank (``average``: then divide by the
    world size), reading the peers' buffers where their links allow (module docstring).

    Raises:
        ProtocolError: a peer's token frame is malformed, or its token names memory the
            peer did not expose (the group breaks).
        PeerDisconnected: a peer's process is gone while its memory is read.
    """
    n, r = op.size, op.rank
    if n == 1 or not buf.nbytes:  # (every rank's count is the same: none sends)
        return
    blocks = flat_blocks(buf, n)
    mine = blocks[r]
    offsets = [0, *itertools.accumulate(b.nbytes for b in blocks)]  # (bytes, in buf)
    with _Exchange(op, buf, "allreduce") as ex:
        await ex.push(PUSH_RS, blocks)

        pushed: dict[int, list[asyncio.Future[None]]] = {}  # allgather frames of pushers
        dones: dict[int, asyncio.Future[None]] = {}
        tokens: dict[int, bytes] = {}
        scratch = _scratch(mine)
        try:
            for q in ex.order:
                token = await ex.token(q)
                if token is None:
                    # its block q lands in place: q pushes it only after reading what it needs
                    pushed[q] = op.recv_chunks(q, PUSH_AG, blocks[q])
                    await ex.fold_pushed(q, mine, ufunc)
                    continue
                tokens[q] = token
                dones[q] = op.recv(q, DONE, 0, _EMPTY)
                await ex.fold(q, token, offsets[r], mine, ufunc, scratch)
        finally:
            SCRATCH.release(scratch)  # (only ever written by the synchronous reads above)
        if average:
            divide(mine, n)

        for q in ex.order:
            if not ex.push_to[q]:
                op.send_now(q, DONE, 0, _EMPTY)
        await ex.push(PUSH_AG, [mine] * n)

        view = byte_view(buf)
        for q in ex.order:
            if q in pushed:
                await _landed(pushed[q])
                continue
            await arrival(op, q, dones[q])
            lo, hi = offsets[q], offsets[q] + blocks[q].nbytes
            await ex.read(q, view[lo:hi], tokens[q], lo)
            ex.finished(q)
        await ex.handed_back()


async def reduce_scatter(op: Op, send: Array, dest: Array, ufunc: np.ufunc, average: bool) -> None:
    """Reduce the flat ``send`` across ranks; the flat ``dest`` gets this rank's block
    (block ``op.rank`` of ``op.size``, divided by the world size when ``average``): the
    allreduce's steps 1, 2 and 5 (nobody changes the inputs, so no done frames).

    Raises:
        as :func:`allreduce`.
    """
    n, r = op.size, op.rank
    blocks = split_even(send, n)
    if n == 1 or not send.nbytes:
        if dest is not send:
            dest[...] = blocks[r]
        return
    with _Exchange(op, send, "reduce_scatter") as ex:
        await ex.push(PUSH_RS, blocks)
        base: Array | None = blocks[r]  # this rank's own part, folded in with the first peer
        scratch = _scratch(dest)
        try:
            for q in ex.order:
                token = await ex.token(q)
                if token is None:
                    await ex.fold_pushed(q, dest, ufunc, base)
                else:
                    await ex.fold(q, token, r * blocks[r].nbytes, dest, ufunc, scratch, base)
                    ex.finished(q)
                base = None
        finally:
            SCRATCH.release(scratch)
        if average:
            divide(dest, n)
        await ex.handed_back()


async def allgather(op: Op, send: Array, blocks: Sequence[Array]) -> None:
    """Gather every rank's flat ``send`` into ``blocks`` (block i from rank i): each rank
    reads every peer's ``send`` straight into place (steps 1, 4 without done frames, and
    5 of the allreduce).

    Raises:
        as :func:`allreduce`.
    """
    n, r = op.size, op.rank
    if n == 1 or not send.nbytes:
        await copy_into(blocks[r], send)
        return
    with _Exchange(op, send, "allgather") as ex:
        await ex.push(PUSH_AG, [send] * n)
        await copy_into(blocks[r], send)
        for q in ex.order:
            token = await ex.token(q)
            if token is None:
                await _landed(op.recv_chunks(q, PUSH_AG, blocks[q]))
            else:
                await ex.read(q, byte_view(blocks[q]), token, 0)
                ex.finished(q)
        await ex.handed_back()


async def broadcast(op: Op, buf: Array, root: int) -> None:
    """Copy ``root``'s flat ``buf`` into every rank's: the root exposes its buffer, every
    other rank reads it straight into its own (``AG_STEP`` per loop turn) and says
    finished; the root ends once every reader has (a root that cannot be read by a rank
    pushes to it).

    Raises:
        as :func:`allreduce`.
    """
    n = op.size
    if n == 1 or not buf.nbytes:
        return
    if op.rank == root:
        with _Exchange(op, buf, "broadcast", sources=()) as ex:
            await ex.push(PUSH_AG, [buf] * n)
            await ex.handed_back()
        return
    with _Exchange(op, buf, "broadcast", readers=(), sources=(root,)) as ex:
        token = await ex.token(root)
        if token is None:
            await _landed(op.recv_chunks(root, PUSH_AG, buf))
            return
        await ex.read(root, byte_view(buf), token, 0)
        ex.finished(root)
