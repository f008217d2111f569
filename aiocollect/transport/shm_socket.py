"""The bytes on a shared-memory link's socket (sans-IO): doorbells, small frames and an
escaped ABORT.

Once a link is in shared-memory mode its socket carries doorbell bytes (``0x01``), small
frames (``0x03`` followed by the frame as on TCP, header and payload of at most
``SOCKET_FRAME_MAX`` bytes: sent instead of a doorbell when the reader sleeps with its
ring empty, see :mod:`aiocollect.transport.shm`) and, once, possibly an *escape*: a rank
that found the link's rings corrupt sends ``0x02`` followed by one ABORT frame (header and
payload, as on TCP) on the socket, since the rings can no longer be trusted to carry it,
and closes. The receiving side then stops reading its ring and takes the ABORT from the
socket; any other frame after an escape, any other byte between frames, or a socket frame
larger than ``SOCKET_FRAME_MAX`` is a ProtocolError.

:class:`SocketParser` turns the bytes read into events; the link
(:class:`~aiocollect.transport.shm_doorbell.DoorbellReader`) acts on them. It takes the common
case, a read that is exactly one whole frame, without the parser (one step per frame).
"""

from __future__ import annotations

from collections.abc import Iterator

from aiocollect.errors import ProtocolError
from aiocollect.transport.wire import ABORT, HEADER_SIZE, Header, parse_header

#: A doorbell: the ring has news (input, space, pulls), or the peer's queue may go on.
BELL = b"\x01"
#: What follows is one frame (module docstring).
SOCKET_FRAME = b"\x03"
#: What follows is one ABORT frame: the peer found the rings corrupt.
ESCAPE = b"\x02"
BELL_BYTE = BELL[0]
SOCKET_FRAME_BYTE = SOCKET_FRAME[0]
ESCAPE_BYTE = ESCAPE[0]
#: The largest payload a frame on the socket may carry.
SOCKET_FRAME_MAX = 16 * 1024
#: Most frames a writer sends on the socket before the reader has counted them taken; a
#: writer at the limit queues its frames for the ring until the reader catches up (a
#: reader whose staging is full counts none, so this bounds what it stages beyond it).
SOCKET_FRAMES_AHEAD = 64
#: The largest ABORT payload taken after an escape (its message and origin).
MAX_ESCAPED = 64 * 1024

#: Events of :meth:`SocketParser.feed`, each ``(kind, header, data)``: ``RANG`` a doorbell
#: rang (once per read at most), ``FRAME`` a whole frame (``data``: its header and payload
#: bytes), ``ESCAPED`` an escape came (the rings are not to be read again), ``ABORTED``
#: the escaped ABORT is complete (``data``: its payload; nothing after it is parsed).
RANG, FRAME, ESCAPED, ABORTED = 1, 2, 3, 4
Event = tuple[int, Header | None, bytes | bytearray]
_RANG: Event = (RANG, None, b"")
_ESCAPED: Event = (ESCAPED, None, b"")


class SocketParser:
    """The state of the bytes on one link's socket between reads.

    Attributes (read-only for the link):
        busy: a frame or an escaped ABORT is partly read: the next read continues it (the
            link's one-frame shortcut does not apply).
        frame: the frame being read (header and payload so far), or None.
        head: its header, once that is in.
        escaped: an escape came: the escaped ABORT's bytes so far, or None.
    """

    __slots__ = ("busy", "escaped", "frame", "head", "max_frame")

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self.busy = False
        self.frame: bytearray | None = None
        self.head: Header | None = None
        self.escaped: bytearray | None = None

    def feed(self, data: memoryview) -> Iterator[Event]:
        """Parse ``data``, the bytes just read, in order. A caller that stops iterating
        drops the rest of them.

        Raises:
            ProtocolError: a byte that is no doorbell, frame or escape; a malformed
                frame, one larger than ``SOCKET_FRAME_MAX``, or anything but an ABORT
                after an escape. The message reads after the peer's name and "sent ";
                the parser is reset (the link stops reading).
        """
        if self.escaped is not None:
            yield from self._escaped_bytes(data)
            return
        pos, end = 0, len(data)
        bell = False
        while pos < end:
            buf = self.frame
            if buf is not None:
                h = self.head
                want = HEADER_SIZE + (h.length if h is not None else 0) - len(buf)
                take = min(want, end - pos)
                buf += data[pos : pos + take]
                pos += take
                if take < want:
                    break
                if h is None:
                    try:
                        h = parse_header(buf, self.max_frame)
                        if h.length > SOCKET_FRAME_MAX:
                            raise ProtocolError(
                                f"{h.length} bytes in a frame on the socket "
                                f"(at most {SOCKET_FRAME_MAX})"
                            )
                    except ProtocolError as exc:
                        self.reset()
                        raise ProtocolError(f"a malformed frame on its socket: {exc}") from None
                    self.head = h
                    if h.length:
                        continue
                self.frame = self.head = None
                self.busy = False
                yield (FRAME, h, buf)
                continue
            byte = data[pos]
            pos += 1
            if byte == BELL_BYTE:
                bell = True
            elif byte == SOCKET_FRAME_BYTE:
                self.frame = bytearray()
                self.busy = True
            elif byte == ESCAPE_BYTE:
                self.escaped = bytearray()
                self.busy = True
                yield _ESCAPED
                yield from self._escaped_bytes(data[pos:end])
                return
            else:
                self.reset()
                raise ProtocolError(
                    f"byte {byte:#04x} on its socket in shared-memory mode (a doorbell, a "
                    "frame or an escape expected)"
                )
        if bell:
            yield _RANG

    def _escaped_bytes(self, data: memoryview) -> Iterator[Event]:
        """Collect the ABORT frame that follows an escape; the event once complete."""
        buf = self.escaped
        assert buf is not None
        buf += data
        if len(buf) < HEADER_SIZE:
            return
        try:
            h = parse_header(buf, self.max_frame)
            if h.kind != ABORT or h.length > MAX_ESCAPED:
                raise ProtocolError(
                    f"a frame of kind {h.kind} and {h.length} bytes after "
                    "an escape (only an ABORT may follow)"
                )
        except ProtocolError as exc:
            self.reset()
            raise ProtocolError(f"a malformed frame on its socket: {exc}") from None
        if len(buf) < HEADER_SIZE + h.length:
            return
        self.reset()
        yield (ABORTED, None, bytes(buf[HEADER_SIZE : HEADER_SIZE + h.length]))

    def reset(self) -> None:
        """Forget any partly read frame or escape."""
        self.frame = self.head = self.escaped = None
        self.busy = False
