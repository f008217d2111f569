"""The receiving half's entry points outside the ring, on a shared-memory link: the
socket's bytes (doorbells, small frames and an escaped ABORT, parsed by
:mod:`aiocollect.transport.shm_socket`) and the mailbox's events (a receive posted or
awaited, staging full or relieved), each of which may resume reading the ring or start a
spin.

A socket frame that arrives while a frame from the ring is half read is a ProtocolError.
The reader counts the socket's frames in its ring (``socket_taken``) as it takes them; the
writer puts nothing into the ring while any it sent are not counted, so frames reach the
mailbox in the order they were sent whichever way each went.

:class:`DoorbellReader` completes :class:`~aiocollect.transport.shm_reader.RingReader` (the
ring's consumption, pulls, parking and spinning) into the receiving half: the two share the
half's state, and the sending half (:class:`~aiocollect.transport.shm_writer.RingWriter`)
sees only their declared interface.
"""

from __future__ import annotations

import asyncio

from aiocollect.errors import ProtocolError
from aiocollect.transport.base import Fingerprint, Handshaker, LinkEvents, Receiver
from aiocollect.transport.mailbox import land
from aiocollect.transport.shm_reader import RingReader, ShmPolicy
from aiocollect.transport.shm_socket import (
    BELL,
    ESCAPED,
    FRAME,
    RANG,
    SOCKET_FRAME_BYTE,
    SOCKET_FRAME_MAX,
    SocketParser,
)
from aiocollect.transport.wire import (
    ABORT,
    DATA,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    P2P,
    Header,
    Key,
)

_unpack_header = HEADER.unpack_from
_new_key = tuple.__new__
_new_header = tuple.__new__  # (a Header from fields already checked, without _make)

_BELL_BYTES = bytearray(64 * 1024)
_BELLS = memoryview(_BELL_BYTES)


class DoorbellReader(RingReader):
    """The receiving half of a shared-memory link: :class:`RingReader` and what reaches it
    from the socket (``get_buffer``/``buffer_updated``: doorbells, socket frames, an escaped
    ABORT) and from the mailbox (``post``/``post_recv``, ``expect``, the staging hooks).
    Before shared memory mode, and on TCP fallback, each goes to the stream link. Its
    declared interface to the sending half is :class:`RingReader`'s.
    """

    def __init__(
        self, events: LinkEvents, max_frame: int, handshaker: Handshaker, policy: ShmPolicy
    ) -> None:
        super().__init__(events, max_frame, handshaker, policy)
        #: The bytes on the socket: a frame or an escaped ABORT as far as it has come.
        self._socket_parser = SocketParser(max_frame)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.shm:
            return _BELLS
        return super().get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if not self.shm:
            super().buffer_updated(nbytes)
        elif self._socket_parser.busy:
            self._socket_bytes(nbytes)
        elif _BELL_BYTES[0] == SOCKET_FRAME_BYTE and not self.discarding:
            if not self._socket_frame_fast(nbytes):
                self._socket_bytes(nbytes)
        elif self.discarding or _BELL_BYTES.count(BELL, 0, nbytes) == nbytes:
            self._service()  # doorbells only, or nothing more is taken
        else:
            self._socket_bytes(nbytes)

    def _socket_frame_fast(self, nbytes: int) -> bool:
        """The common case of a frame on the socket, in one step: the read is exactly one
        DATA or P2P frame whose receive is posted with its fingerprint and length (as
        ``_consume``'s fast path). False, having done nothing, for anything else."""
        if nbytes < 1 + HEADER_SIZE or self.discarding:
            return False
        magic, kind, coll, rop, dtype, gid, chunk, seq, slot, root, elems, n = _unpack_header(
            _BELL_BYTES, 1
        )
        if (
            nbytes != 1 + HEADER_SIZE + n
            or magic != MAGIC
            or kind not in (DATA, P2P)
            or n > SOCKET_FRAME_MAX
            or self._ring_frame_open()
            or self._rx_dead
        ):
            return False  # (_take_socket_frame reports what is wrong)
        key = _new_key(Key, (kind, gid, seq, slot, chunk))
        recv = self._take_posted(key, n, (coll, dtype, elems, rop, root))
        if recv is None:
            h = _new_header(Header, (kind, coll, rop, dtype, gid, chunk, seq, slot, root, elems, n))
            return self._socket_frame_early(nbytes, h, key)
        self._socket_taken += 1
        self._count_socket_frames()
        land(recv, _BELLS[1 + HEADER_SIZE : nbytes])
        return True

    def _socket_frame_early(self, nbytes: int, h: Header, key: Key) -> bool:
        """The read is exactly one DATA or P2P frame ``h`` (``key``; ``_socket_frame_fast``
        checked its magic, kind and length, and made ``h`` from its fields as
        ``parse_header`` would) whose receive is not posted as it says: into the mailbox as
        ``_take_socket_frame`` would put it (staged early, or a mismatch reported), without
        collecting it byte by byte first. The star's root takes most of its leaves' frames
        this way. False, having done nothing, when the frame is longer than this link
        takes (``_socket_bytes`` reports it)."""
        if h.length > self.max_frame:
            return False
        self._socket_taken += 1
        self.take_whole(h, _BELLS[1 + HEADER_SIZE : nbytes], key)
        self._count_socket_frames()
        return True

    def _socket_bytes(self, nbytes: int) -> None:
        """Doorbells, frames and an escape on the socket, in order
        (:mod:`aiocollect.transport.shm_socket`)."""
        parser = self._socket_parser
        escaping = parser.escaped is not None  # (then only the escaped ABORT comes)
        if escaping and (self.discarding or self.lost):
            return
        taken = self._socket_taken
        bell = False
        try:
            for kind, h, data in parser.feed(_BELLS[:nbytes]):
                if kind == FRAME and h is not None:
                    if not self._take_socket_frame(h, data):
                        return
                elif kind == RANG:
                    bell = True
                elif kind == ESCAPED:
                    escaping = True
                    self._rx_dead = True  # the peer says the rings are broken: never read them
                    self._spin_until = None
                    self._unpark()
                    if self.discarding or self.lost:
                        return
                else:  # ABORTED
                    self.discarding = True  # nothing may follow the ABORT
                    self.frames_received += 1
                    self.bytes_received += len(data)
                    self.events.on_control(self, ABORT, bytes(data))
        except ProtocolError as exc:
            self._raise_error(ProtocolError(f"{self.describe()} sent {exc}"))
            return
        if escaping:
            return  # (the ring is not read again)
        if self._socket_taken != taken:
            self._count_socket_frames()
        if bell:
            self._service()

    def _ring_frame_open(self) -> bool:
        """Whether a frame from the ring is half read or pulls are queued: then no frame
        may come on the socket (the writer sends one only with everything before it read
        and pulled)."""
        return self._rpayload is not None or bool(self._pull_streams)  # (queued or underway)

    def _take_socket_frame(self, h: Header, buf: bytes | bytearray) -> bool:
        """Hand the frame ``h`` (``buf``: its header and payload) from the socket to the
        mailbox, as if read from the ring; False when the link stops reading (an error
        reported)."""
        self._socket_taken += 1
        if self.discarding or self.lost or self._rx_dead:
            return True
        if self._ring_frame_open():
            self._raise_error(
                ProtocolError(
                    f"{self.describe()} sent a frame on its socket while one from its "
                    "ring was half read"
                )
            )
            return False
        payload = memoryview(buf)[HEADER_SIZE:]
        if h.kind in (DATA, P2P):
            recv = self._take_posted(h.key, h.length, h.fingerprint)
            if recv is not None:
                land(recv, payload)
            else:
                self.take_whole(h, payload)
            return not self.discarding
        dest = self.open_frame(h)
        if dest is not None:
            dest[:] = payload
            self._end_frame()
        return not self.discarding

    def expect(self) -> None:
        """Start spinning on the ring for a receive that has to wait (one just posted, or
        one posted earlier and now awaited: :meth:`Link.expect`), unless a spin is on
        already, the policy does not spin or the ring is gone."""
        if (
            self.policy.spin > 0
            and self._spin_until is None
            and self.rx is not None
            and not self._rx_dead
            and not self.lost
        ):
            self._start_spin(self.rx)

    def post_recv(
        self, key: Key, view: memoryview, expect: Fingerprint | None = None
    ) -> asyncio.Future[None]:
        fut = super().post_recv(key, view, expect)
        self._posted_one(key, fut.done())
        return fut

    def post(self, key: Key, recv: Receiver) -> bool:
        landed = super().post(key, recv)
        # (_posted_one's cases, the common one first: nothing parked, no spin to start)
        if key == self._parked or (not landed and self.policy.spin > 0):
            self._posted_one(key, landed)
        return landed

    def _posted_one(self, key: Key, landed: bool) -> None:
        """A receive for ``key`` was posted (``landed``: its frame was staged already)."""
        if key == self._parked:
            self._unpark()
            # the caller is an algorithm posting receives: read on the loop's next turn
            self._loop.call_soon(self._service)
        elif not landed:
            self.expect()  # a receive that has to wait

    def _staging_full(self) -> None:
        if not self.shm:
            super()._staging_full()
            return
        # Stop taking frames out of the ring, but keep reading doorbells: they also say
        # that our own queued writes can go on, and the socket's end is the peer's death.
        self._rx_paused = True

    def _staging_relieved(self) -> None:
        if not self.shm:
            super()._staging_relieved()
            return
        if self._rx_paused:
            self._rx_paused = False
            if self._socket_unacked:
                self._count_socket_frames()
            # called from post_recv: read on the loop's next turn, not inside the caller
            asyncio.get_running_loop().call_soon(self._service)
