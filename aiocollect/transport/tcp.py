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
cannot reorder it: plain TCP links to processes on this host ask for
``LOCAL_SOCKET_BUFFER`` (1 MiB) per buffer, TLS links and links to other hosts for
``SOCKET_BUFFER`` (4 MiB), and
``AIOCOLLECT_SOCKET_BUFFER`` overrides both (:func:`socket_buffer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl as ssl_module
import struct
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any, cast

import msgpack

from aiocollect.errors import PeerDisconnected, ProtocolError, RendezvousError
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
from aiocollect.transport.interface import LinkSetup, Listener, Record, Screen, Transport
from aiocollect.transport.wire import (
    DATA,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    P2P,
    Header,
    Key,
    parse_header,
)

log = logging.getLogger("aiocollect.transport.tcp")

#: Frame kinds whose payload, when wholly read, enters the mailbox in one step.
WHOLE = (DATA, P2P)

#: Kernel socket buffer (SO_SNDBUF and SO_RCVBUF, which Linux doubles) of a link to another
#: host: enough bytes in flight for a LAN's round trip.
SOCKET_BUFFER = 4 * 1024 * 1024
#: The same for a plain TCP link to a process on this host (loopback, or this host's own
#: address; TLS links keep ``SOCKET_BUFFER``). Everything in these buffers lies ahead of a
#: small frame sent behind bulk frames and drains at the receiver's pace, so they are kept
#: small: 1 MiB measured no slower than 4 MiB for bulk and took the round trip behind
#: 64 MiB allreduces from 9-13 ms to 6 ms at p99 (docs/benchmarks.md, "Thirteenth
#: session").
LOCAL_SOCKET_BUFFER = 1024 * 1024
#: Overrides both (bytes; 0 leaves the buffers to the kernel's autotuning).
SOCKET_BUFFER_ENV = "AIOCOLLECT_SOCKET_BUFFER"
#: The smallest override taken as given: with 4 and 8 KiB, several operations in flight
#: over loopback stopped for good (the receive window, against a 64 KiB MSS, never
#: reopened; docs/benchmarks.md, "Nineteenth session"); 16 KiB and up did not.
MIN_SOCKET_BUFFER = 64 * 1024
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


class _Screened(Exception):
    """An accepted connection refused by the listener's screen (which logged it)."""


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
        #: Bulk frames waiting for the transport's buffer to drain below BULK_CAP:
        #: (header, payload, stream), with the bytes and the streams they hold.
        self._bulk: deque[tuple[bytes, memoryview | bytes, bytes]] = deque()
        self._bulk_bytes = 0
        self._copied = False  # the last send's payload was copied (joined to its header)
        self._bulk_streams: Counter[bytes] = Counter()
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
            self.peer_pid = _unix_peer_pid(sock)
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
                self.handshake_failed(_Screened(str(reply.get("error", "refused"))))
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
            if n >= BULK_MIN or stream in self._bulk_streams:  # (order within a stream)
                self._queue_bulk(header, payload, stream)
                return DRAIN
            self._behind.append(header + bytes(payload))
            self._bulk_bytes += len(header) + n
            self._copied = True
            return None
        if n >= BULK_MIN:
            if self._bulk or self._must_wait(transport, n):
                self._queue_bulk(header, payload, stream_of(header))
                return DRAIN
            if self._piece and n > self._piece:
                self._write_in_pieces(transport, header, payload)
                return DRAIN
        elif self._bulk:
            stream = stream_of(header)
            if stream in self._bulk_streams:  # behind its stream's queued frames
                self._queue_bulk(header, payload, stream)
                return DRAIN
        if n > JOIN_MAX:
            transport.writelines((header, payload))
            return self.sent_mark(None)
        # one buffer: the event loop writes it with one plain write()
        transport.write(header + payload if n else header)
        self._copied = True
        return None

    def _queue_bulk(self, header: bytes, payload: memoryview | bytes, stream: bytes) -> None:
        self._bulk.append((header, payload, stream))
        self._bulk_bytes += len(header) + len(payload)
        self._bulk_streams[stream] += 1

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
        self._bulk_bytes += len(self._partial)
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
        self._bulk_bytes -= len(piece)
        if len(rest) > len(piece):  # (state first, as in _write_in_pieces)
            self._partial = rest[len(piece) :]
            self._piece_handle = asyncio.get_running_loop().call_soon(self._next_piece)
            transport.write(piece)
            return
        self._partial = None
        behind, self._behind = self._behind, []
        self._bulk_bytes -= sum(len(b) for b in behind)
        transport.writelines([piece, *behind])  # the frame's end and the frames behind it
        self._pump_bulk()
        drain = self._drain  # (resume_writing need not come: the transport may hold nothing)
        if drain is not None and not drain.done() and not self.write_buffer_size():
            drain.set_result(None)

    def _pump_bulk(self) -> None:
        """Hand queued bulk frames to the transport while its buffer allows. Afterwards
        the queue is empty or the transport holds bytes (so ``resume_writing`` comes), or
        a frame is being written in pieces (TLS; its end pumps again)."""
        transport, bulk = self.transport, self._bulk
        if transport is None or self.lost:
            return
        # (re-checked each time: a write may call resume_writing, which pumps too)
        while bulk and self._partial is None:
            header, payload, stream = bulk[0]
            n = len(payload)
            if self._must_wait(transport, n):
                return
            bulk.popleft()
            self._bulk_bytes -= len(header) + n
            left = self._bulk_streams[stream] - 1
            if left:
                self._bulk_streams[stream] = left
            else:
                del self._bulk_streams[stream]
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
        transport, bulk = self.transport, self._bulk
        if transport is not None and not self.lost and not transport.is_closing():
            if self._partial is not None:
                rest, self._partial = self._partial, None
                transport.writelines([rest, *self._behind])
            for header, payload, _ in bulk:
                transport.writelines((header, payload))
        self._drop_bulk()

    def _drop_bulk(self) -> None:
        self._bulk.clear()
        self._bulk_bytes = 0
        self._bulk_streams.clear()
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
        return self.transport.get_write_buffer_size() + self._bulk_bytes

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


#: AIOCOLLECT_SOCKET_BUFFER values already warned about (:func:`socket_buffer`).
_WARNED: set[str] = set()


def socket_buffer(
    local: bool | None, tls: bool = False, env: Mapping[str, str] | None = None
) -> int:
    """Bytes to ask the kernel for as each socket buffer of a TCP link (0: leave them to
    its autotuning): ``AIOCOLLECT_SOCKET_BUFFER`` (in ``env``, default ``os.environ``) if
    set, else :data:`LOCAL_SOCKET_BUFFER` for a plain TCP link to this host (``local``)
    and :data:`SOCKET_BUFFER` otherwise. TLS links keep the larger buffers: their bytes
    drain at the receiver's decryption rate whatever the buffer holds, and the smaller one
    measured no better for a small frame there (docs/benchmarks.md, "Thirteenth
    session"). A value that is not a non-negative integer is ignored, with a warning the
    first time."""
    raw = (os.environ if env is None else env).get(SOCKET_BUFFER_ENV, "").strip()
    if not raw.isdecimal():
        if raw:
            _warn_once(raw, f"ignoring {SOCKET_BUFFER_ENV}={raw!r}: not a number of bytes")
        return LOCAL_SOCKET_BUFFER if local and not tls else SOCKET_BUFFER
    size = int(raw)
    if 0 < size < MIN_SOCKET_BUFFER:
        _warn_once(
            raw,
            f"{SOCKET_BUFFER_ENV}={raw} raised to {MIN_SOCKET_BUFFER} bytes: smaller socket "
            "buffers can stall TCP on this host for good (loopback's receive window does "
            "not reopen)",
        )
        return MIN_SOCKET_BUFFER
    return size


def _warn_once(raw: str, message: str) -> None:
    """Log ``message`` the first time ``raw`` (an AIOCOLLECT_SOCKET_BUFFER value) comes:
    every link asks, one warning per value is enough."""
    if raw not in _WARNED:
        _WARNED.add(raw)
        log.warning("%s", message)


def _unix_peer_pid(sock: socket.socket) -> int | None:
    """The process id of a Unix socket's peer, where the kernel says (``SO_PEERCRED``;
    None where it does not)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = int(struct.unpack("3i", creds)[0])
    except (OSError, struct.error, AttributeError):
        return None
    return pid if pid > 0 else None


def is_local(peername: object, sockname: object) -> bool | None:
    """Whether the peer at ``peername`` of a socket bound to ``sockname`` is a process on
    this host: True when the two ends have the same address (loopback included), False
    for another host's; None when they are not IP addresses (the link is not a network
    socket)."""
    if not isinstance(peername, tuple) or not isinstance(sockname, tuple):
        return None
    peer = peername[0]
    return bool(peer == sockname[0] or str(peer).startswith("127.") or peer == "::1")


class TcpLink(StreamLink):
    """A peer link over one TCP (or TLS) connection: frames on the socket."""


def stream_of(header: bytes) -> bytes:
    """The ``(kind, gid, seq, slot)`` bytes of a frame header (see wire.HEADER): frames of
    one stream keep their order."""
    return header[2:3] + header[6:10] + header[14:30]


async def listen(
    host: str,
    port: int,
    make_link: Callable[[], StreamLink],
    on_link: Callable[[StreamLink], None],
    ssl: ssl_module.SSLContext | None = None,
    screen: Screen | None = None,
) -> asyncio.Server:
    """Accept peer connections; ``on_link`` gets each link whose handshake succeeded.
    Failed handshakes are logged and closed; they never disturb the listener. ``screen``,
    when given, sees each connection first and may refuse it (its reply is sent, then the
    connection closed; the screen does its own logging)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        accepting(make_link, on_link, screen), host, port, ssl=ssl, reuse_address=True
    )


def accepting(
    make_link: Callable[[], StreamLink],
    on_link: Callable[[StreamLink], None],
    screen: Screen | None = None,
) -> Callable[[], StreamLink]:
    """The protocol factory of a listener of stream links (any ``loop.create_*_server``):
    see :func:`listen`."""

    def factory() -> StreamLink:
        link = make_link()
        link.screen = screen
        link.ready.add_done_callback(_accepted)
        return link

    def _accepted(fut: asyncio.Future[StreamLink]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if isinstance(exc, _Screened):
            return
        if exc is not None:
            log.warning("rejected an incoming connection: %s", exc)
            return
        on_link(fut.result())

    return factory


async def connect(
    host: str,
    port: int,
    link: StreamLink,
    ssl: ssl_module.SSLContext | None = None,
    server_hostname: str | None = None,
) -> StreamLink:
    """Connect ``link`` to ``host:port`` and run its handshake.

    Raises:
        OSError: the connection was refused. Handshake errors as raised by the handshaker.
    """
    loop = asyncio.get_running_loop()
    kwargs: dict[str, Any] = {}
    if ssl is not None:
        kwargs = {"ssl": ssl, "server_hostname": server_hostname or host}
    await loop.create_connection(lambda: link, host, port, **kwargs)
    return await link.ready


class SocketListener(Listener):
    """A rank's listener of stream links: TCP (or TLS) as it stands; a subclass may make
    other links on the same connections (:meth:`make_link`: shared memory) or use other
    sockets (:meth:`serve` and :meth:`dial`: a Unix socket, say)."""

    def __init__(
        self,
        setup: LinkSetup,
        family: str,
        server_ssl: ssl_module.SSLContext | None = None,
        client_ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        self.setup = setup
        self.server_ssl, self.client_ssl = server_ssl, client_ssl
        self.record: Record = {"transport": family}
        self._server: asyncio.Server | None = None
        #: Accepted connections still in their handshake (strangers, once rendezvous
        #: is over).
        self._handshaking: set[StreamLink] = set()

    def make_link(self, handshaker: Handshaker, record: Record | None) -> StreamLink:
        """The link for one connection: ``record`` is the peer's when connecting to it,
        None for an accepted connection."""
        del record
        return TcpLink(self.setup.events, self.setup.max_frame, handshaker)

    async def serve(self, factory: Callable[[], StreamLink]) -> asyncio.Server:
        """Start the server whose connections ``factory`` makes links for, and add its
        address to ``self.record``."""
        server = await asyncio.get_running_loop().create_server(
            factory, self.setup.host, 0, ssl=self.server_ssl, reuse_address=True
        )
        self.record.update(address=self.setup.host, port=server.sockets[0].getsockname()[1])
        return server

    async def dial(self, record: Record, link: StreamLink) -> None:
        """Open the connection to the server that ``record`` names, for ``link``.

        Raises:
            OSError: the connection failed.
        """
        host, port = str(record["address"]), int(record["port"])
        kwargs: dict[str, Any] = {}
        if self.client_ssl is not None:
            kwargs = {"ssl": self.client_ssl, "server_hostname": host}
        await asyncio.get_running_loop().create_connection(lambda: link, host, port, **kwargs)

    def where(self, record: Record) -> str:
        """The address ``record`` names, for messages."""
        return f"{record.get('address')}:{record.get('port')}"

    async def start(self) -> None:
        setup = self.setup

        def accepted() -> StreamLink:
            link = self.make_link(setup.acceptor(), None)
            self._handshaking.add(link)
            link.ready.add_done_callback(lambda _: self._handshaking.discard(link))
            return link

        self._server = await self.serve(accepting(accepted, setup.on_link, setup.screen))

    async def connect(self, record: Record, handshaker: Handshaker) -> Link:
        rank, peer = self.setup.rank, int(record["rank"])
        link = self.make_link(handshaker, record)
        try:
            await self.dial(record, link)
            return await link.ready
        except OSError as exc:
            raise RendezvousError(
                f"rank {rank} could not connect to rank {peer} at {self.where(record)}: {exc}"
            ) from None
        except PeerDisconnected as exc:  # closed before the handshake completed
            hint = (
                f" (rank {peer} may have rejected this rank's TLS certificate)"
                if self.client_ssl is not None
                else ""
            )
            raise RendezvousError(
                f"rank {rank} could not link to rank {peer} at {self.where(record)}: {exc}{hint}"
            ) from None

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._handshaking):  # asyncio.Server.close() leaves them open
            link.abort()
        self._handshaking.clear()


class TcpTransport(Transport):
    """``tcp``: one TCP connection per link; ``tls`` (``tls=True``): mutual TLS on it."""

    def __init__(self, tls: bool = False) -> None:
        self.name = "tls" if tls else "tcp"
        self.needs_tls = tls

    def details(self) -> str | None:
        return ssl_module.OPENSSL_VERSION if self.needs_tls else None

    async def listen(self, setup: LinkSetup) -> Listener:
        tls = setup.tls if self.needs_tls else None
        listener = SocketListener(
            setup, self.name, tls.server if tls else None, tls.client if tls else None
        )
        await listener.start()
        return listener


TCP = TcpTransport()
TLS = TcpTransport(tls=True)
