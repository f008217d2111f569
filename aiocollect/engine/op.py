"""One in-flight operation: its frame headers, its posted receives and its sends.

Algorithms address peers by *group* rank and frames by ``(slot, chunk)``; the Op maps them
to links and keys. An operation is complete only when every receive has landed and every
send has left user space (``finish``), so callers may reuse their buffers afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiocollect._buffers import Array, byte_view
from aiocollect.engine.fabric import Fabric
from aiocollect.errors import AiocollectError, InternalError
from aiocollect.transport.base import Fingerprint, Link, SendMark
from aiocollect.transport.wire import DATA, HEADER, MAGIC, Key

#: Bytes queued in user space per link before a sender waits for the socket to drain.
SEND_WINDOW = 32 * 1024 * 1024
#: A send of at least this many bytes yields to the event loop once.
YIELD_BYTES = 64 * 1024


class Op:
    """Context of one collective at sequence number ``seq`` of group ``gid``."""

    __slots__ = (
        "_sent",
        "chunk_bytes",
        "expired",
        "fabric",
        "fp",
        "gid",
        "kind",
        "pending",
        "rank",
        "ranks",
        "seq",
        "size",
    )

    def __init__(
        self,
        fabric: Fabric,
        gid: int,
        seq: int,
        fp: Fingerprint,
        ranks: list[int],
        rank: int,
        chunk_bytes: int,
        kind: int = DATA,
    ) -> None:
        self.fabric = fabric
        self.gid = gid
        self.seq = seq
        self.fp = fp
        self.ranks = ranks
        self.rank = rank
        self.size = len(ranks)
        self.chunk_bytes = chunk_bytes
        self.kind = kind
        self.pending: list[tuple[int, Key, asyncio.Future[None]]] = []
        # per link this op sent on: the mark of its frames there (Link.sent_mark)
        self._sent: dict[Link, SendMark] = {}
        self.expired = False  # set by the deadline timer before it cancels the task

    def link(self, peer: int) -> Link:
        return self.fabric.links[self.ranks[peer]]

    def header(self, slot: int, chunk: int, length: int, seq: int | None = None) -> bytes:
        coll, dtype, count, op, root = self.fp
        return HEADER.pack(
            MAGIC,
            self.kind,
            coll,
            op,
            dtype,
            self.gid,
            chunk,
            self.seq if seq is None else seq,
            slot,
            root,
            count,
            length,
        )

    # -- chunking --------------------------------------------------------------------------

    def chunks(self, arr: Array) -> list[Array]:
        """Split a flat array into chunks of at most ``chunk_bytes`` (whole elements).
        An empty array gives no chunks."""
        n = arr.size
        if n == 0:
            return []
        if arr.nbytes <= self.chunk_bytes:
            return [arr]
        step = max(1, self.chunk_bytes // max(1, arr.itemsize))
        return [arr[i : i + step] for i in range(0, n, step)]

    # -- primitives ------------------------------------------------------------------------

    def recv(
        self,
        peer: int,
        slot: int,
        chunk: int,
        dest: Array,
        expect: Fingerprint | None = None,
        seq: int | None = None,
    ) -> asyncio.Future[None]:
        """Post a receive of frame (slot, chunk) from group rank ``peer`` into ``dest``."""
        kind = self.kind
        # tuple.__new__: a Key without its generated __new__'s Python frame (per receive)
        key = _tuple_new(Key, (kind, self.gid, self.seq if seq is None else seq, slot, chunk))
        link = self.fabric.links[self.ranks[peer]]
        # Every frame of a collective carries the op's fingerprint (checked against it by
        # the fabric): with it posted too, a transport can match the frame in one step.
        fut = link.post_recv(
            key, _bytes(dest), self.fp if expect is None and kind == DATA else expect
        )
        self.pending.append((peer, key, fut))
        if not fut.done():
            self.fabric.spin(fut, link)
        return fut

    def recv_chunks(self, peer: int, slot: int, dest: Array) -> list[asyncio.Future[None]]:
        return [self.recv(peer, slot, c, part) for c, part in enumerate(self.chunks(dest))]

    async def send(
        self, peer: int, slot: int, chunk: int, src: Array, seq: int | None = None
    ) -> None:
        """Queue frame (slot, chunk) to group rank ``peer``; waits only when the link's
        user-space queue is above the send window."""
        link = self.link(peer)
        if link.write_buffer_size() > SEND_WINDOW:
            await link.drained()
        n = self.send_now(peer, slot, chunk, src, seq)
        if n >= YIELD_BYTES and link.caps.copies(n):
            await asyncio.sleep(0)  # one big write per loop step keeps the loop lag low

    def send_now(self, peer: int, slot: int, chunk: int, src: Array, seq: int | None = None) -> int:
        """Queue frame (slot, chunk) without waiting for the send window (one-frame
        operations, where it cannot matter). Returns the payload's size in bytes."""
        link = self.fabric.links[self.ranks[peer]]
        data = _bytes(src)
        link.send(self.header(slot, chunk, len(data), seq), data)
        sent = self._sent
        sent[link] = link.sent_mark(sent.get(link))
        return len(data)

    def unsent(self) -> bool:
        """Whether the payload of a frame this op sent still lies in user memory (queued,
        or referenced until the peer pulls it). Other operations' frames queued on the
        same links do not count."""
        for link, mark in self._sent.items():
            if mark is not None and not link.released(mark):
                return True
        return False

    async def sent_left(self, peer: int) -> None:
        """Wait until the payloads of this op's frames to group rank ``peer`` have left
        user memory (its buffer may be rewritten then).

        Raises:
            the link's failure if it breaks first.
        """
        link = self.link(peer)
        mark = self._sent.get(link)
        if mark is not None and not link.released(mark):
            await link.wait_released(mark)

    async def send_chunks(self, peer: int, slot: int, src: Array) -> None:
        for c, part in enumerate(self.chunks(src)):
            await self.send(peer, slot, c, part)

    async def finish(self) -> None:
        """Wait for every posted receive and for every link this op sent on to drain."""
        for _, _, fut in self.pending:
            await fut
        for link, mark in self._sent.items():
            if mark is not None and not link.released(mark):
                await link.wait_released(mark)

    def moved_data(self) -> bool:
        """Whether any frame of this op was sent or received (cancelling it then breaks the
        group: the peers could not finish it consistently)."""
        # A cancelled task cancels the receive it awaited: that one moved nothing.
        return bool(self._sent) or any(
            f.done() and not f.cancelled() and f.exception() is None for _, _, f in self.pending
        )

    def silent_peers(self) -> list[int]:
        """Group ranks this op still waits for (for timeout messages)."""
        # The timeout that asks cancelled the receive being awaited: still not received.
        waiting = {peer for peer, _, fut in self.pending if not fut.done() or fut.cancelled()}
        waiting.update(
            self.ranks.index(link.peer)
            for link, mark in self._sent.items()
            if mark is not None and not link.released(mark) and link.peer in self.ranks
        )
        return sorted(waiting)

    def wrap(self, kind: str, exc: BaseException) -> BaseException:
        """What this operation (a ``kind``) fails with when ``exc`` escaped it
        (:func:`wrap_error`)."""
        return wrap_error(kind, self.seq, self.rank, exc)

    def progress(self) -> tuple[int, int]:
        """Changes whenever the operation posts or completes a receive (stall warnings)."""
        return len(self.pending), sum(1 for _, _, fut in self.pending if fut.done())

    def abandon(self) -> None:
        """Withdraw receives that have not landed (after cancellation or failure)."""
        for peer, key, fut in self.pending:
            if not fut.done():
                self.link(peer).unpost(key)
                fut.cancel()


def wrap_error(kind: str, seq: int, rank: int, exc: BaseException) -> BaseException:
    """What operation ``seq`` (a ``kind``) on ``rank`` fails with when ``exc`` escaped it:
    ``exc`` itself if it is an aiocollect error (or not an Exception), else an
    InternalError caused by it: anything else is a bug, and still breaks the group on
    every rank."""
    if isinstance(exc, AiocollectError) or not isinstance(exc, Exception):
        return exc
    err = InternalError(
        f"{kind} (op #{seq}) on rank {rank} failed on an unexpected {type(exc).__name__}: {exc}"
    )
    err.__cause__ = exc
    return err


_bytes = byte_view
_tuple_new = tuple.__new__


def flat_blocks(arr: Array, parts: int) -> list[Array]:
    """Split a flat array into ``parts`` contiguous blocks, sizes differing by at most one."""
    n = arr.size
    bounds = [n * i // parts for i in range(parts + 1)]
    return [arr[bounds[i] : bounds[i + 1]] for i in range(parts)]


def split_even(arr: Array, parts: int) -> Sequence[Array]:
    """Split a flat array into ``parts`` equal blocks (caller checked divisibility)."""
    step = arr.size // parts
    return [arr[i * step : (i + 1) * step] for i in range(parts)]
