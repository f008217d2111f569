"""Stream links on ``asyncio.BufferedProtocol`` (TCP, TLS; the socket side of shared-memory
links): payloads land straight in the receiver's array.

Reading is a small state machine: handshake messages (u32 length + msgpack) until the
handshaker says the peer is known, then frames (fixed header + payload). Frames are read
into a 64 KiB read-ahead buffer and parsed from there, so a burst of small frames costs one
``recv`` and one callback, not two per frame; the part of a payload that does not fit in
the read-ahead buffer is read straight into its destination (the receiver's array when the
receive was posted in time), so large payloads are not copied in user space.

Sending, with small frames ahead of bulk ones and large payloads written in pieces, is
:class:`~aiocollect.transport.stream_send.SendSide`, the base of :class:`StreamLink`. A TCP
link and its small-frame lane are :mod:`aiocollect.transport.tcp_link`.

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
from aiocollect.transport.base import COPIES, Handshaker, LinkCaps, LinkEvents, Superseded
from aiocollect.transport.handshake_stream import HandshakeStream
from aiocollect.transport.interface import Screen
from aiocollect.transport.mailbox import land
from aiocollect.transport.sockets import (
    Screened,
    is_local,
    keep_alive,
    link_silence,
    socket_buffer,
    unanswered,
    unix_peer_pid,
)
from aiocollect.transport.stream_send import SendSide
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

_new_key = tuple.__new__
_unpack_header = HEADER.unpack_from


class StreamLink(SendSide, asyncio.BufferedProtocol):
    """A peer link over one stream socket (TCP, TLS, a Unix socket): the handshake, then
    frames on the socket, written by its base :class:`~aiocollect.transport.stream_send.SendSide`
    (``send`` and the bulk queue). The base of :class:`TcpLink` and of the shared-memory link
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
      that stops reading sets it), ``handshake`` (until the handshake is over),
      ``is_lane`` (its handshake made it a TCP link's small-frame lane: tcp_link.py).
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
        SendSide.__init__(self, events, max_frame)
        #: The handshake, until it is over (then None: frames follow).
        self.handshake: HandshakeStream | None = HandshakeStream(handshaker, self._write)
        self.ready: asyncio.Future[StreamLink] = asyncio.get_running_loop().create_future()
        self.transport = None
        self.address = "?"
        self._hdr = bytearray(HEADER_SIZE)
        self._hdr_view = memoryview(self._hdr)
        self._got = 0
        self._payload: memoryview | None = None
        self._rbuf = bytearray(READ_AHEAD)
        self._rview = memoryview(self._rbuf)
        self._rlen = 0  # bytes of an incomplete header kept at the start of _rbuf
        self._direct = False  # get_buffer handed out the payload's own memory
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
        self.is_lane = False
        self._caps = COPIES  # local is known once connected
        #: The socket of a link to another host, whose acknowledgements are watched.
        self._remote: socket.socket | None = None

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
            if self._caps.local is False and (silence := link_silence()) > 0:
                keep_alive(sock, silence)
                self._remote = sock
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
            why = f"connection to {self.address} closed during the handshake" + (
                f": {exc}" if exc else ""
            )
            handshake = self.handshake
            if handshake is not None and getattr(handshake.handshaker, "lane", False):
                # a small-frame lane given up while set up: its link goes on without it
                self.ready.set_exception(Superseded(f"a small-frame lane's {why}"))
            else:
                self.ready.set_exception(PeerDisconnected(why, None))
            return
        if self.ready.cancelled() or self.ready.exception() is not None:
            return  # a rejected handshake: this connection never joined the group
        self.events.on_lost(self, exc)

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
            if self.ready.done():  # whoever connected it gave up meanwhile (cancelled)
                self.handshake_failed(PeerDisconnected("the connect was abandoned", peer))
                return
            self.peer = peer
            self.handshake = None
            if getattr(handshake.handshaker, "lane", False) and self.transport is not None:
                # A link's second connection: nothing more is read until the link takes
                # it over (tcp_link.py), or closes it.
                self.is_lane = True
                self._transport_paused = True
                self.transport.pause_reading()
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

    # -- closing ---------------------------------------------------------------------------

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

    def unanswered(self) -> float | None:
        if self._remote is None or self.lost:
            return None
        return unanswered(self._remote)

    def describe(self) -> str:
        return f"rank {self.peer} ({self.address})" if self.peer >= 0 else self.address
