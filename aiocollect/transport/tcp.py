"""Stream links on ``asyncio.BufferedProtocol`` (TCP, TLS; the socket side of shared-memory
links): payloads land straight in the receiver's array.

Reading is a small state machine: handshake messages (u32 length + msgpack) until the
handshaker says the peer is known, then frames (fixed header + payload). Frames are read
into a 64 KiB read-ahead buffer and parsed from there, so a burst of small frames costs one
``recv`` and one callback, not two per frame; the part of a payload that does not fit in
the read-ahead buffer is read straight into its destination (the receiver's array when the
receive was posted in time), so large payloads are not copied in user space.

Sending keeps small frames from waiting behind bulk ones (head-of-line blocking). A frame
whose payload is at least ``BULK_MIN`` bytes is *bulk*: it is handed to the transport only
while the transport's write buffer holds less than ``BULK_CAP`` bytes (or is empty);
otherwise it waits in the link's own queue, in order, and goes out as the transport
drains (``resume_writing``). Every other frame (control frames, point-to-point messages
and small collectives) goes to the transport at once, ahead of the queued bulk frames,
unless a bulk frame of the same stream ``(kind, gid, seq, slot)`` is still queued: the
frames of one stream keep their order. Receivers match frames by key, so reordering
across streams changes nothing they rely on. ``write_buffer_size`` counts both queues.

A payload over ``PIECE`` goes to the transport in pieces, one per loop turn, so that no
single write holds the event loop for long; frames sent meanwhile wait for the end of that
frame (small ones right after it, bulk ones in the queue). Over plain TCP a piece also
waits until the transport has handed the previous one to the kernel; over TLS (whose
transport encrypts what it is given at once and passes it on) the pieces alone, not the
transport's buffer size, pace the bulk queue.

What lies in the kernel's socket buffers is ahead of a small frame too, and user space
cannot reorder it: :mod:`aiocollect.transport.sockets` sizes them. The listener and the
``tcp``/``tls`` transports are in :mod:`aiocollect.transport.tcp_listener`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import cast

import msgpack

from aiocollect.errors import PeerDisconnected, ProtocolError
from aiocollect.transport.base import (
    COPIES,
    DRAIN,
    Handshaker,
    Link,
    LinkCaps,
    LinkEvents,
    SendMark,
    land,
)
from aiocollect.transport.handshake_stream import HandshakeStream
from aiocollect.transport.interface import Screen
from aiocollect.transport.sockets import Screened, is_local, socket_buffer, unix_peer_pid
from aiocollect.transport.stream_queue import StreamQueue
from aiocollect.transport.wire import (
    DATA,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    P2P,
    Header,
    Key,
    parse_header,
    stream_of,
)

log = logging.getLogger("aiocollect.transport.tcp")

#: Frame kinds whose payload, when wholly read, enters the mailbox in one step.
WHOLE = (DATA, P2P)

#: Seconds a closing link waits for the peer's FIN before resetting the connection.
LINGER = 5.0
_SCRATCH = memoryview(bytearray(64 * 1024))
#: Size of the read-ahead buffer; a payload with at least this much left to read is read
#: straight into its destination.
READ_AHEAD = 64 * 1024
#: Payload bytes read straight into place before the link lets the event loop run other
#: callbacks: libuv keeps reading while data keeps coming (up to 32 reads of a whole
#: payload each), which would stall every other task for tens of milliseconds.
READ_BUDGET = 2 * 1024 * 1024
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
#: loop (and every small frame behind it) for milliseconds (docs/benchmarks.md,
#: "Tenth-session findings"). Over plain TCP a write is one system call that copies as
#: much as the kernel takes, and on loopback, with the peer reading meanwhile, a 1-2 MiB
#: write held the loop 2-9 ms: there the next piece also waits until the transport has
#: handed the previous one to the kernel (docs/benchmarks.md, "Seventeenth session"). The
#: extra system calls cost four ranks on two cores about 8 % of their CPU, so plain TCP
#: links write whole payloads where ranks share cores (``pace_writes``).
PIECE = 256 * 1024

_new_key = tuple.__new__
_unpack_header = HEADER.unpack_from


class StreamLink(Link, asyncio.BufferedProtocol):
    """A peer link over one stream socket (TCP, TLS, a Unix socket): the handshake, then
    frames on the socket. The base of :class:`TcpLink` and of the shared-memory link
    (:class:`~aiocollect.transport.shm.ShmLink`), which keeps the socket for its
    handshake, doorbells, escaped ABORTs and liveness and may stay on it (``auto``).

    What a subclass may use, besides Link's transport contract (``_begin_frame``,
    ``_end_frame``, ``_raise_error`` and the staging hooks, see
    :mod:`aiocollect.transport.base`); everything else here, underscored, is this class's
    own and no subclass reads or writes it:

    - State, read-only unless said: ``transport`` (None until connected), ``address``
      (the peer's, for messages), ``ready`` (resolves to the link once the handshake is
      over), ``gone`` (set once the connection ended), ``lost`` (the same as a plain flag,
      for hot paths), ``discarding`` (nothing more is read into the mailbox; a subclass
      that stops reading sets it), ``handshake`` (until the handshake is over).
    - Hooks to override, calling this class's version for what they do not take over:
      the protocol's ``get_buffer``/``buffer_updated`` (bytes read from the socket),
      ``connection_lost``, ``pause_writing``/``resume_writing`` (the socket's flow
      control), ``handshake_failed`` (release what the handshake set up), and the link's
      ``send``, ``write_buffer_size``, ``drained``, ``close``, ``abort``, ``describe``.
    - Helpers: :meth:`open_frame` (a parsed header into the mailbox: where its payload
      goes), :meth:`take_whole` (a data frame whose payload is at hand, in one step),
      :meth:`half_close` (end this side's stream and read on until the peer
      closes), :meth:`reset_later` (a closing link whose peer never closes is reset).
    """

    def __init__(self, events: LinkEvents, max_frame: int, handshaker: Handshaker) -> None:
        Link.__init__(self, events, max_frame)
        #: The handshake, until it is over (then None: frames follow).
        self.handshake: HandshakeStream | None = HandshakeStream(handshaker, self._write)
        self.ready: asyncio.Future[StreamLink] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.address = "?"
        self._hdr = bytearray(HEADER_SIZE)
        self._hdr_view = memoryview(self._hdr)
        self._got = 0
        self._payload: memoryview | None = None
        self._rbuf = bytearray(READ_AHEAD)
        self._rview = memoryview(self._rbuf)
        self._rlen = 0  # bytes of an incomplete header kept at the start of _rbuf
        self._direct = False  # get_buffer handed out the payload's own memory
        self._drain: asyncio.Future[None] | None = None
        #: Set once the transport reported the connection's end (connection_lost ran).
        self.gone = asyncio.Event()
        self.lost = False  # gone.is_set(), as a plain attribute
        #: Nothing more is read into the mailbox (bytes still read are dropped).
        self.discarding = False
        self._reading_paused = False  # staging is full (backpressure)
        self._yielding = False  # paused for one loop pass after READ_BUDGET bytes
        self._read_run = 0  # payload bytes read since the last such pause
        self._transport_paused = False  # what the transport was last told
        self._linger: asyncio.TimerHandle | None = None
        self.screen: Screen | None = None
        self._caps = COPIES  # local is known once connected
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

    # -- connection lifecycle --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        try:
            self._setup(self.transport)
        except Exception as exc:  # fail the handshake at once rather than time out
            self.handshake_failed(exc)

    def _setup(self, transport: asyncio.Transport) -> None:
        transport.set_write_buffer_limits(high=0, low=0)
        self._tls = transport.get_extra_info("ssl_object") is not None
        sock = transport.get_extra_info("socket")
        peername = transport.get_extra_info("peername")
        sockname = transport.get_extra_info("sockname")
        if sock is not None and sock.family == socket.AF_UNIX:
            self.peer_pid = unix_peer_pid(sock)
            self.address = (
                "unix socket" if self.peer_pid is None else f"unix socket, pid {self.peer_pid}"
            )
            self._caps = LinkCaps(local=True)  # (a Unix socket's peer is on this host)
        else:
            if peername:
                self.address = f"{peername[0]}:{peername[1]}"
            self._caps = LinkCaps(local=is_local(peername, sockname))
        if self.screen is not None:
            reply = self.screen(peername, sockname)
            if reply is not None:  # refused before a byte is read from it
                assert self.handshake is not None
                self.handshake.send(reply)
                self.handshake_failed(Screened(str(reply.get("error", "refused"))))
                return
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            size = socket_buffer(self._caps.local, tls=self._tls)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF) if size else ():
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, opt, size)
        assert self.handshake is not None
        try:
            self.handshake.start()
        except Exception as exc:
            self.handshake_failed(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.gone.set()
        self.closed = True
        self._drop_bulk()
        if self._linger is not None:
            self._linger.cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(
                PeerDisconnected(f"link to {self.describe()} closed with data queued", self.peer)
            )
            self._drain.exception()  # mark retrieved: waiters may have gone
        if not self.ready.done():
            self.ready.set_exception(
                PeerDisconnected(
                    f"connection to {self.address} closed during the handshake"
                    + (f": {exc}" if exc else ""),
                    None,
                )
            )
            return
        if self.ready.cancelled() or self.ready.exception() is not None:
            return  # a rejected handshake: this connection never joined the group
        self.events.on_lost(self, exc)

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

    # -- reading ---------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.discarding:
            return _SCRATCH
        payload = self._payload
        if payload is not None and len(payload) - self._got >= READ_AHEAD:
            self._direct = True
            return payload[self._got :]
        self._direct = False
        if self.handshake is not None:
            return self.handshake.buffer()
        return self._rview[self._rlen :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.discarding:
            return
        if self._direct:
            assert self._payload is not None
            self._got += nbytes
            self._read_run += nbytes
            if self._read_run >= READ_BUDGET:
                self._yield_reading()
            if self._got == len(self._payload):
                self._payload = None
                self._got = 0
                self._end_frame()
            return
        if self.handshake is not None:
            self._handshake_bytes(self.handshake, nbytes)
            return
        self._parse(self._rlen + nbytes)

    def _parse(self, end: int) -> None:
        """Consume ``_rbuf[:end]``: the rest of the current payload, then whole frames; an
        incomplete header is kept at the start of the buffer for the next read."""
        view = self._rview
        pos = 0
        while pos < end:
            payload = self._payload
            if payload is not None:
                got = self._got
                n = min(len(payload) - got, end - pos)
                payload[got : got + n] = view[pos : pos + n]
                pos += n
                if got + n < len(payload):
                    self._got = got + n
                    break
                self._payload = None
                self._got = 0
                self._end_frame()
            elif end - pos < HEADER_SIZE:
                self._rbuf[: end - pos] = view[pos:end]
                self._rlen = end - pos
                return
            elif (fast := self._fast_frame(pos, end)) is not None:
                pos = fast
            else:
                try:
                    h = parse_header(self._rbuf, self.max_frame, pos)
                except ProtocolError as exc:
                    self._raise_error(
                        ProtocolError(f"{self.describe()} sent a malformed frame: {exc}")
                    )
                    return
                pos += HEADER_SIZE
                if h.kind in WHOLE and end - pos >= h.length:  # all of it read: one step
                    self.take_whole(h, view[pos : pos + h.length])
                    pos += h.length
                elif (dest := self.open_frame(h)) is not None:
                    self._payload = dest
                    self._got = 0
            if self.discarding:
                return
        self._rlen = 0

    def _fast_frame(self, pos: int, end: int) -> int | None:
        """The common small frame, in one step: a DATA frame wholly in the read-ahead
        buffer at ``pos`` whose receive is posted with its fingerprint and length (what
        ``Op.recv`` posts). Its payload is copied into place and the receive landed;
        returns the position after it. None for every other frame (the general path
        then checks, routes or stages it and reports errors)."""
        magic, kind, coll, rop, dtype, gid, chunk, seq, slot, root, elems, n = _unpack_header(
            self._rbuf, pos
        )
        if kind != DATA:
            return None
        start = pos + HEADER_SIZE
        if end - start < n or magic != MAGIC:
            return None
        recv = self._take_posted(
            _new_key(Key, (kind, gid, seq, slot, chunk)), n, (coll, dtype, elems, rop, root)
        )
        if recv is None:
            return None
        land(recv, self._rview[start : start + n])
        after: int = start + n
        return after

    def open_frame(self, h: Header) -> memoryview | None:
        """Begin the frame ``h`` (parsed from the socket or, in a subclass, elsewhere) in
        the mailbox: returns the memory its payload goes to, or None when there is nothing
        to read, because it is empty (and has ended here) or was refused (the link then
        discards what follows)."""
        dest = self._begin_frame(h)
        if dest is not None and h.length:
            return dest
        if dest is None:
            self.discarding = True
        else:
            self._end_frame()
        return None

    def take_whole(
        self, h: Header, payload: memoryview | bytes | bytearray, key: Key | None = None
    ) -> None:
        """The DATA or P2P frame ``h`` (``key``: its key, if at hand) with its whole
        payload at hand into the mailbox, as :meth:`open_frame`, the copy and
        ``_end_frame`` would put it (a refused one: the link discards what follows)."""
        if not self._whole_frame(h, payload, key):
            self.discarding = True

    def _staging_full(self) -> None:
        self._reading_paused = True
        self._sync_reading()

    def _staging_relieved(self) -> None:
        self._reading_paused = False
        self._sync_reading()

    def _yield_reading(self) -> None:
        """Stop reading until the event loop has run everything else that is ready."""
        self._read_run = 0
        if not self._yielding:
            self._yielding = True
            self._sync_reading()
            asyncio.get_running_loop().call_soon(self._end_yield)

    def _end_yield(self) -> None:
        self._yielding = False
        self._sync_reading()

    def _sync_reading(self) -> None:
        """Pause the transport while staging is full or the link yields, else resume it."""
        transport = self.transport
        if transport is None or self.lost:
            return
        paused = self._reading_paused or self._yielding
        if paused != self._transport_paused:
            self._transport_paused = paused
            if paused:
                transport.pause_reading()
            elif not transport.is_closing():
                transport.resume_reading()

    def eof_received(self) -> bool | None:
        return False  # close our side too; connection_lost reports it

    def _raise_error(self, exc: BaseException) -> None:
        log.warning("link to %s (%s): %s; closing it", self.describe(), self.address, exc)
        self.discarding = True  # read nothing more from it; the fabric closes it gracefully
        super()._raise_error(exc)

    # -- handshake -------------------------------------------------------------------------

    def _handshake_bytes(self, handshake: HandshakeStream, nbytes: int) -> None:
        try:
            peer = handshake.received(nbytes)
        except Exception as exc:
            self.handshake_failed(exc)
            return
        if peer is not None:
            self.peer = peer
            self.handshake = None
            self.ready.set_result(self)

    def _write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def handshake_failed(self, exc: BaseException) -> None:
        if isinstance(exc, (ValueError, msgpack.exceptions.ExtraData)) and not isinstance(
            exc, ProtocolError
        ):
            exc = ProtocolError(f"malformed handshake from {self.address}: {exc}")
        if not self.ready.done():
            self.ready.set_exception(exc)
        self.handshake = None
        # Nothing more from this connection may be read, let alone parsed as frames: a TLS
        # transport still delivers already-decrypted bytes after close().
        self.discarding = True
        if self.transport is not None:
            # Let a final error reply leave before closing.
            self.transport.close()

    # -- sending ---------------------------------------------------------------------------

    def send(self, header: bytes, payload: memoryview | bytes) -> SendMark:
        transport = self.transport
        if transport is None or self.lost or self.closed:
            raise self._failure or PeerDisconnected(
                f"link to {self.describe()} is closed", self.peer
            )
        n = len(payload)
        self.bytes_sent += n
        self.frames_sent += 1
        self._copied = False
        if self._partial is not None:  # after the frame being written in pieces
            stream = stream_of(header)
            if n >= BULK_MIN or stream in self._bulk_queue.streams:  # (order in a stream)
                self._bulk_queue.push(header, payload, stream)
                return DRAIN
            self._behind.append(header + bytes(payload))
            self._piece_bytes += len(header) + n
            self._copied = True
            return None
        if n >= BULK_MIN:
            if self._bulk or self._must_wait(transport, n):
                self._bulk_queue.push(header, payload, stream_of(header))
                return DRAIN
            if self._piece and n > self._piece:
                self._write_in_pieces(transport, header, payload)
                return DRAIN
        elif self._bulk:
            stream = stream_of(header)
            if stream in self._bulk_queue.streams:  # behind its stream's queued frames
                self._bulk_queue.push(header, payload, stream)
                return DRAIN
        if n > JOIN_MAX:
            transport.writelines((header, payload))
            return self.sent_mark(None)
        # one buffer: the event loop writes it with one plain write()
        transport.write(header + payload if n else header)
        self._copied = True
        return None

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

    def close(self) -> None:
        """Flush what is queued (an ABORT or GOODBYE above all), half-close, and keep
        reading (discarding) until the peer closes too: closing with unread input would
        send a reset that can destroy the frame we just queued."""
        if self.closed:
            return
        self.closed = True
        self.discarding = True
        self._staging_relieved()  # drain whatever the peer still sends
        transport = self.transport
        if transport is None or self.lost:
            return
        if self._bulk or self._partial is not None:
            self._flush_bulk()
        self.half_close()

    def half_close(self) -> None:
        """End this side's stream once the transport has written what it holds, and read
        on until the peer closes too (``reset_later``); a transport that cannot
        half-close is closed. Closing with unread input would send a reset, which can
        destroy what this side sent and the peer has not read yet."""
        transport = self.transport
        if transport is None:
            return
        if transport.can_write_eof():
            try:
                transport.write_eof()
            except OSError:  # the peer reset the connection already: nothing to flush
                transport.abort()
                return
            self.reset_later()
        else:
            transport.close()

    def reset_later(self) -> None:
        """Reset the connection in LINGER seconds (from now, replacing an earlier timer)
        unless it has ended by then (a closing link waits that long for the peer to read
        what it flushed and close too)."""
        transport = self.transport
        if transport is not None:
            if self._linger is not None:
                self._linger.cancel()
            self._linger = asyncio.get_running_loop().call_later(LINGER, transport.abort)

    def abort(self) -> None:
        self.closed = True
        self._drop_bulk()
        if self.transport is not None:
            self.transport.abort()

    async def wait_closed(self) -> None:
        if self.transport is not None:
            await self.gone.wait()

    @property
    def caps(self) -> LinkCaps:
        """Whether the peer is local (from the socket's two addresses, once connected)."""
        return self._caps

    def describe(self) -> str:
        return f"rank {self.peer} ({self.address})" if self.peer >= 0 else self.address


class TcpLink(StreamLink):
    """A peer link over one TCP (or TLS) connection: frames on the socket."""
