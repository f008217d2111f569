"""The write side of a stream link (:class:`SendSide`, the base of
:class:`~aiocollect.transport.tcp.StreamLink`): frames handed to the socket's transport,
small ones ahead of bulk ones.

Sending keeps small frames from waiting behind bulk ones (head-of-line blocking). A frame
whose payload is at least ``BULK_MIN`` bytes is *bulk*: it is handed to the transport only
while the transport's write buffer holds less than ``BULK_CAP`` bytes (or is empty);
otherwise it waits in the link's own queue, in order, and goes out as the transport
drains (``resume_writing``). Every other frame (control frames, point-to-point messages
and small collectives) goes to the transport at once, ahead of the queued bulk frames,
unless a bulk frame of the same stream ``(kind, gid, seq, slot)`` is still queued: the
frames of one stream keep their order. Receivers match frames by key, so reordering
across streams changes nothing they rely on. ``write_buffer_size`` counts both queues.

A TCP link with a small-frame lane (:mod:`aiocollect.transport.tcp_link`) writes the small
frames that begin their stream (chunk 0) on the lane's own connection instead: one
comparison per frame (``_lane_max`` is 0 without a lane) chooses. ABORT and GOODBYE go on
both connections, whatever their size and whatever the link's own connection is writing
(``_on_both``). A link whose lane is due once it carries bulk is told so by the bulk
branch alone (``_first_bulk``, called once): the small-frame path does not look.

A payload over ``PIECE`` goes to the transport in pieces, one per loop turn, so that no
single write holds the event loop for long; frames sent meanwhile wait for the end of that
frame (small ones right after it, bulk ones in the queue). Over plain TCP a piece also
waits until the transport has handed the previous one to the kernel; over TLS (whose
transport encrypts what it is given at once and passes it on) the pieces alone, not the
transport's buffer size, pace the bulk queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiocollect.errors import PeerDisconnected
from aiocollect.transport.base import DRAIN, Link, LinkEvents, SendMark
from aiocollect.transport.stream_queue import StreamQueue
from aiocollect.transport.wire import ABORT, GID_AT, GOODBYE, KIND_AT, SEQ_AT, stream_of

#: Payloads up to this size are copied behind their header and written as one buffer
#: (uvloop then skips its scatter-gather write context).
JOIN_MAX = 16 * 1024
#: Payload size from which a frame is bulk (queued behind at most ``BULK_CAP`` bytes).
BULK_MIN = 64 * 1024
#: Bytes in the transport's write buffer above which bulk frames wait in the link's queue:
#: what a small frame may find queued ahead of it in user space.
BULK_CAP = 1024 * 1024
#: A payload larger than this is handed to the transport in pieces of this size, one per
#: loop turn; frames sent meanwhile wait for the end of the frame being written. Over TLS
#: the transport encrypts what it is given at once, so a whole 1 MiB chunk would hold the
#: loop (and every small frame behind it) for milliseconds (docs/benchmarks.md). Over
#: plain TCP a write is one system call that copies as much as the kernel takes, and on
#: loopback, with the peer reading meanwhile, a 1-2 MiB write held the loop 2-9 ms: there
#: the next piece also waits until the transport has handed the previous one to the
#: kernel (docs/design.md, "Bytes ahead of a small frame on a TCP link"). The extra system
#: calls cost four ranks on two cores about 8 % of their CPU, so plain TCP links write
#: whole payloads where ranks share cores (``pace_writes``).
PIECE = 256 * 1024


#: Where a packed header's chunk index lies (after the group id), and its value in a
#: stream's first frame.
CHUNK_AT = GID_AT + 4
FIRST_CHUNK = bytes(SEQ_AT - CHUNK_AT)
#: The chunk field of a GOODBYE on a link's own connection whose copy went on its lane.
LANE_COPY = (1).to_bytes(SEQ_AT - CHUNK_AT, "little")


def _no_lane(data: bytes) -> None:
    raise AssertionError("a frame for the small-frame lane of a link without one")


class SendSide(Link):
    """The sending half of :class:`~aiocollect.transport.tcp.StreamLink`: ``send``, the
    bulk queue, payloads written in pieces, the drain and per-frame release. The stream
    link (the read side, the handshake, closing) sets ``transport`` once connected,
    ``lost`` once the connection ended and ``_tls`` for a TLS connection; the
    protocol's ``pause_writing``/``resume_writing`` are here."""

    #: The socket's transport (None until connected), set by the stream link.
    transport: asyncio.Transport | None
    #: The connection has ended (the stream link's ``connection_lost`` ran).
    lost: bool

    def __init__(self, events: LinkEvents, max_frame: int) -> None:
        Link.__init__(self, events, max_frame)
        self._drain: asyncio.Future[None] | None = None
        #: Bulk frames waiting for the transport's buffer to drain below BULK_CAP, and
        #: its frames (tested per frame sent, without a call).
        self._bulk_queue = StreamQueue()
        self._bulk = self._bulk_queue.frames
        #: Bytes of the frame being written in pieces not handed to the transport yet,
        #: and of the frames behind it.
        self._piece_bytes = 0
        self._copied = False  # the last send's payload was copied (joined to its header)
        #: Payloads larger than this go out in pieces (see PIECE; 0: whole, see
        #: pace_writes).
        self._piece = PIECE
        self._tls = False  # a TLS connection (pieces paced by loop turns only)
        #: A piece is due but waits for the transport to hand the previous one to the
        #: kernel (plain TCP); resume_writing writes it.
        self._piece_waits = False
        #: The rest of the frame being written in pieces, and the frames sent since,
        #: which go right after it (before queued bulk frames, as they would have).
        self._partial: memoryview | None = None
        self._behind: list[bytes] = []
        self._piece_handle: asyncio.Handle | None = None
        #: Frames with a payload below this go to the small-frame lane (0: no lane), which
        #: ``_lane_write`` writes to (tcp_link.py sets both).
        self._lane_max = 0
        self._lane_write: Callable[[bytes], None] = _no_lane
        #: Called on the link's first bulk send, where set (a TCP link whose lane is
        #: dialed only once the link carries bulk: tcp_link.py); it unsets itself.
        self._first_bulk: Callable[[], None] | None = None

    def pause_writing(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._piece_waits:
            self._piece_waits = False
            self._next_piece()
        if self._bulk:
            self._pump_bulk()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def send(self, header: bytes, payload: memoryview | bytes) -> SendMark:
        transport = self.transport
        if transport is None or self.lost or self.closed:
            raise self._failure or PeerDisconnected(
                f"link to {self.describe()} is closed", self.peer
            )
        n = len(payload)
        self.bytes_sent += n
        self.frames_sent += 1
        if n < self._lane_max:  # (0 without a lane)
            kind = header[KIND_AT]
            if (kind < ABORT and header[CHUNK_AT:SEQ_AT] == FIRST_CHUNK) or kind > GOODBYE:
                # (DATA, P2P: its stream's later frames come on the main connection, after
                # it; PING, PONG)
                self._copied = True
                self._lane_write(header + payload if n else header)
                return None
            if kind in (ABORT, GOODBYE):  # on both (ABORT: the first one counts;
                header = self._on_both(header, payload)  # GOODBYE: the peer waits for both)
        self._copied = False
        if n >= BULK_MIN:
            if self._first_bulk is not None:  # (once: this link's lane is wanted now)
                self._first_bulk()
            if self._lane_max and header[KIND_AT] == GOODBYE:  # (a large one: both as well)
                header = self._on_both(header, payload)
            if self._partial is not None or self._bulk or self._must_wait(transport, n):
                self._bulk_queue.push(header, payload, stream_of(header))
                return DRAIN
            if self._piece and n > self._piece:
                self._write_in_pieces(transport, header, payload)
                return DRAIN
        elif self._partial is not None or self._bulk:
            stream = stream_of(header)
            if stream in self._bulk_queue.streams:  # behind its stream's queued frames
                self._bulk_queue.push(header, payload, stream)
                return DRAIN
            if self._partial is not None:  # after the frame being written in pieces
                self._behind.append(header + bytes(payload))
                self._piece_bytes += len(header) + n
                self._copied = True
                return None
        if n > JOIN_MAX:
            transport.writelines((header, payload))
            return self.sent_mark(None)
        # one buffer: the event loop writes it with one plain write()
        transport.write(header + payload if n else header)
        self._copied = True
        return None

    def _on_both(self, header: bytes, payload: memoryview | bytes) -> bytes:
        """Write an ABORT or GOODBYE frame on the lane as well, whatever the link's own
        connection is writing; returns the header for the link's own connection (a
        GOODBYE's says that a copy went on the lane)."""
        self._lane_write(header + payload)
        if header[KIND_AT] == GOODBYE:
            return header[:CHUNK_AT] + LANE_COPY + header[SEQ_AT:]
        return header

    def pace_writes(self, pieces: bool) -> None:
        """Plain TCP: payloads over ``PIECE`` in pieces (``pieces``) or whole; TLS links
        always write in pieces (their transport encrypts a whole payload at once)."""
        self._piece = PIECE if pieces or self._tls else 0

    def _must_wait(self, transport: asyncio.Transport, n: int) -> bool:
        """Whether a bulk frame of ``n`` bytes must wait: the transport holds bytes and
        would then hold more than BULK_CAP. Never over TLS: its transport's buffer size
        says little there (it encrypts and passes everything on), the pieces pace it."""
        if self._tls:
            return False
        queued = transport.get_write_buffer_size()
        return queued > 0 and queued + n > BULK_CAP

    def _write_in_pieces(
        self, transport: asyncio.Transport, header: bytes, payload: memoryview | bytes
    ) -> None:
        """Write the header and the first piece now, the rest one piece per loop turn."""
        view = memoryview(payload).cast("B")
        # set first: the transport may call resume_writing (and so _pump_bulk) from write
        self._partial = view[self._piece :]
        self._piece_bytes += len(self._partial)
        self._piece_handle = asyncio.get_running_loop().call_soon(self._next_piece)
        transport.writelines((header, view[: self._piece]))

    def _next_piece(self) -> None:
        """Write the next piece of the frame being written; at its end, the frames sent
        meanwhile, then the bulk queue. Over plain TCP a piece waits while the transport
        still holds bytes (``resume_writing`` writes it once it holds none)."""
        self._piece_handle = None
        rest, transport = self._partial, self.transport
        if rest is None or transport is None or self.lost or transport.is_closing():
            return
        if not self._tls and transport.get_write_buffer_size():
            self._piece_waits = True
            return
        piece = rest[: self._piece or len(rest)]  # (pieces turned off meanwhile: the rest)
        self._piece_bytes -= len(piece)
        if len(rest) > len(piece):  # (state first, as in _write_in_pieces)
            self._partial = rest[len(piece) :]
            self._piece_handle = asyncio.get_running_loop().call_soon(self._next_piece)
            transport.write(piece)
            return
        self._partial = None
        behind, self._behind = self._behind, []
        self._piece_bytes -= sum(len(b) for b in behind)
        transport.writelines([piece, *behind])  # the frame's end and the frames behind it
        self._pump_bulk()
        drain = self._drain  # (resume_writing need not come: the transport may hold nothing)
        if drain is not None and not drain.done() and not self.write_buffer_size():
            drain.set_result(None)

    def _pump_bulk(self) -> None:
        """Hand queued bulk frames to the transport while its buffer allows. Afterwards
        the queue is empty or the transport holds bytes (so ``resume_writing`` comes), or
        a frame is being written in pieces (TLS; its end pumps again)."""
        transport = self.transport
        if transport is None or self.lost:
            return

        def may_go(n: int) -> bool:
            # (re-checked each time: a write may call resume_writing, which pumps too)
            return self._partial is None and not self._must_wait(transport, n)

        for header, payload in self._bulk_queue.release(may_go):
            n = len(payload)
            if self._piece and n > self._piece:
                self._write_in_pieces(transport, header, payload)
                return
            if n:
                transport.writelines((header, payload))
            else:
                transport.write(header)

    def _flush_bulk(self) -> None:
        """Hand every queued bulk frame to the transport (closing: they go before EOF),
        after the rest of a frame being written in pieces."""
        transport = self.transport
        held = self._bulk_queue.take_all()
        if transport is not None and not self.lost and not transport.is_closing():
            if self._partial is not None:
                rest, self._partial = self._partial, None
                transport.writelines([rest, *self._behind])
            for header, payload, _ in held:
                transport.writelines((header, payload))
        self._drop_bulk()

    def _drop_bulk(self) -> None:
        self._bulk_queue.clear()
        self._piece_bytes = 0
        self._partial = None
        self._behind = []
        self._piece_waits = False
        if self._piece_handle is not None:
            self._piece_handle.cancel()
            self._piece_handle = None

    def sent_mark(self, prev: SendMark = None) -> SendMark:
        """A small frame joined to its header was copied: nothing of the caller's memory
        is kept, whatever is queued ahead of it; any other waits for the drain."""
        if self._copied:
            return prev
        return super().sent_mark(prev)

    def write_buffer_size(self) -> int:
        if self.transport is None:
            return 0
        return self.transport.get_write_buffer_size() + self._bulk_queue.nbytes + self._piece_bytes

    async def drained(self) -> None:
        while self.write_buffer_size() > 0:
            if self.lost:
                raise PeerDisconnected(f"link to {self.describe()} closed", self.peer)
            if self._drain is None or self._drain.done():
                self._drain = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drain)
