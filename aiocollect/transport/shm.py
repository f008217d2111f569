"""Shared-memory links between ranks on one host: frames through rings in ``/dev/shm``,
wake-ups and liveness through the TCP connection that carried the handshake.

A link starts as a :class:`~aiocollect.transport.tcp.TcpLink`. The connecting rank asks for
shared memory in its hello; the accepting rank creates a segment (two rings, see
:mod:`aiocollect.transport.shm_ring`) and names it in its welcome; the connecting rank maps
it, unlinks the name and answers ``shm-ok`` (or ``shm-fail``, and both sides stay on TCP when
the transport was ``auto``). From then on the socket carries only doorbell bytes:

- Frames (the same headers as on TCP) are copied into the outgoing ring by ``send`` and out
  of the incoming ring straight into the posted receive's memory (or a staging buffer).
- A writer rings the doorbell (writes one byte) only when the reader announced, in the ring,
  that it is about to sleep; a reader rings it only when the writer announced that it waits
  for space. Any byte makes the receiving loop drain its incoming ring and continue its
  queued writes, so idle links cost nothing and a stream of frames costs one wake-up.
- ``send`` never blocks: what does not fit is queued (the payload is referenced, not
  copied, until it is in the ring, as with TCP) and written as the reader frees space;
  ``write_buffer_size`` is the queued bytes and ``drained`` waits for the queue to empty.
- The socket closing (a SIGKILLed peer's kernel closes it) is the loss of the peer; what
  the peer put in the ring before is still read first, so an ABORT frame is never lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from aiocollect.errors import PeerDisconnected, ProtocolError, RendezvousError
from aiocollect.transport.base import Handshaker, LinkEvents
from aiocollect.transport.shm_ring import Ring, Segment, configured_capacity, fence
from aiocollect.transport.tcp import LINGER, TcpLink
from aiocollect.transport.wire import HEADER_SIZE, parse_header

log = logging.getLogger("aiocollect.transport.shm")

_BELLS = memoryview(bytearray(4096))
_BELL = b"\x01"
#: A write at least this large is published (and the reader woken) before the next one, so
#: the reader copies out while the writer copies in.
PUBLISH_EVERY = 64 * 1024


class ShmLink(TcpLink):
    """A peer link through shared-memory rings, falling back to plain TCP (``auto``) when
    the peer does not take up the offer.

    Args:
        role: ``"connector"`` (asks for shared memory) or ``"acceptor"`` (creates it).
        required: shared memory or failure (``transport="shm"``); else fall back to TCP.
        capacity: bytes per ring (acceptor; the connector takes what is offered).
    """

    def __init__(self, events: LinkEvents, max_frame: int, handshaker: Handshaker, *,
                 role: str, required: bool = False, capacity: int | None = None) -> None:
        self._shm_setup = _ShmSetup(handshaker, self, role, required,
                                capacity or configured_capacity())
        super().__init__(events, max_frame, self._shm_setup)
        self.shm = False
        self._segment: Segment | None = None
        self._rx: Ring | None = None
        self._tx: Ring | None = None
        self._rx_dead = False
        self._tx_dead = False
        self._queue: deque[memoryview] = deque()
        self._queued = 0
        self._rgen = 1  # our reader's sleep generation; a new segment starts armed at 1
        self._wgen = 0
        self._rung_reader = 0  # the peer reader's generation we last rang for
        self._rung_writer = 0
        self._close_pending = False

    def _activate(self, segment: Segment, rx: int) -> None:
        self._segment = segment
        self._rx, self._tx = segment.rings[rx], segment.rings[1 - rx]
        self.shm = True

    # -- connection lifecycle --------------------------------------------------------------

    def connection_lost(self, exc: Exception | None) -> None:
        if self.shm:
            self._read_ring_final()
            self._queue.clear()
            self._queued = 0
        try:
            super().connection_lost(exc)
        finally:
            self._shm_setup.discard()
            self._release()

    def _handshake_failed(self, exc: BaseException) -> None:
        self._shm_setup.discard()
        super()._handshake_failed(exc)

    def pause_writing(self) -> None:
        if not self.shm:
            super().pause_writing()

    def resume_writing(self) -> None:
        if not self.shm:
            super().resume_writing()

    def _release(self) -> None:
        segment, self._segment = self._segment, None
        self._rx = self._tx = None
        if segment is not None:
            segment.close()

    # -- reading ---------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.shm:
            return _BELLS
        return super().get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self.shm:
            self._service()
        else:
            super().buffer_updated(nbytes)

    def _service(self) -> None:
        """A doorbell rang: read what arrived, then write what waits for space."""
        rx = self._rx
        if rx is not None and not self._rx_dead:
            try:
                self._read_ring(rx)
            except ProtocolError as exc:
                self._rx_failed(exc)
        if self._queue:
            self._pump()

    def _read_ring(self, rx: Ring) -> None:
        while not self._lost:
            avail = rx.available()
            if avail:
                self._consume(rx, avail)
                continue
            # About to sleep: say so, then look once more (the writer checks the flag after
            # publishing, so one of the two sees the other).
            self._rgen += 1
            rx.arm_reader(self._rgen)
            fence()
            if not rx.available():
                return

    def _read_ring_final(self) -> None:
        """The socket closed: read what the peer put in the ring before it went."""
        rx = self._rx
        if rx is None or self._rx_dead:
            return
        try:
            while avail := rx.available():
                self._consume(rx, avail, wake=False)
        except ProtocolError as exc:
            self._rx_failed(exc)

    def _consume(self, rx: Ring, avail: int, wake: bool = True) -> None:
        """Parse ``avail`` bytes of the frame stream: headers into the header buffer,
        payloads into the memory ``_begin_frame`` chose (one copy)."""
        while avail and not self._rx_dead:
            if self._discard:
                rx.skip(avail)
                break
            payload = self._payload
            if payload is not None:
                got = self._got
                n = min(avail, len(payload) - got)
                rx.read(payload[got:got + n])
                avail -= n
                self._got = got = got + n
                if got == len(payload):
                    self._payload = None
                    self._got = 0
                    rx.publish_tail()
                    if wake:
                        self._wake_writer(rx)
                    self._end_frame()
                continue
            got = self._got
            n = min(avail, HEADER_SIZE - got)
            rx.read(self._hdr_view[got:got + n])
            avail -= n
            self._got = got = got + n
            if got < HEADER_SIZE:
                continue
            self._got = 0
            h = parse_header(self._hdr, self.max_frame)
            dest = self._begin_frame(h)
            if dest is None:
                self._discard = True
            elif h.length == 0:
                self._end_frame()
            else:
                self._payload = dest
        if not self._rx_dead:
            rx.publish_tail()
            if wake:
                self._wake_writer(rx)

    def _wake_writer(self, rx: Ring) -> None:
        fence()
        gen = rx.writer_sleep()
        if gen and gen != self._rung_writer:
            self._rung_writer = gen
            self._bell()

    def _rx_failed(self, exc: ProtocolError) -> None:
        """The incoming ring or frame stream is corrupt: never read it again."""
        self._rx_dead = True
        self._raise_error(exc)

    # -- sending ---------------------------------------------------------------------------

    def send(self, header: bytes, payload: memoryview | bytes) -> None:
        if not self.shm:
            super().send(header, payload)
            return
        if self._lost or self.closed or self._tx_dead or self._tx is None:
            raise self._failure or PeerDisconnected(
                f"link to {self.describe()} is closed", self.peer)
        idle = not self._queue  # else the queue waits for space: the doorbell resumes it
        self._queue.append(memoryview(header))
        n = len(payload)
        if n:
            view = memoryview(payload)
            self._queue.append(view if view.format == "B" and view.ndim == 1
                               else view.cast("B"))
        self._queued += len(header) + n
        self.bytes_sent += n
        self.frames_sent += 1
        if idle:
            self._pump()

    def _pump(self) -> None:
        """Copy queued pieces into the outgoing ring while it has space."""
        tx, queue = self._tx, self._queue
        if tx is None or self._tx_dead:
            return
        try:
            free = tx.free()
            wrote = False
            while queue:
                if not free:
                    if wrote:
                        self._publish(tx)
                        wrote = False
                    self._wgen += 1
                    tx.arm_writer(self._wgen)
                    fence()
                    free = tx.free()
                    if not free:
                        return
                    continue
                piece = queue[0]
                n = len(piece)
                if n <= free:
                    tx.write(piece)
                    queue.popleft()
                else:
                    n = free
                    tx.write(piece[:n])
                    queue[0] = piece[n:]
                free -= n
                self._queued -= n
                wrote = True
                if n >= PUBLISH_EVERY:
                    self._publish(tx)
                    wrote = False
            if wrote:
                self._publish(tx)
        except ProtocolError as exc:
            self._tx_failed(exc)
            return
        self._flushed()

    def _publish(self, tx: Ring) -> None:
        tx.publish_head()
        fence()
        gen = tx.reader_sleep()
        if gen and gen != self._rung_reader:
            self._rung_reader = gen
            self._bell()

    def _bell(self) -> None:
        transport = self.transport
        if transport is not None and not self._lost and not transport.is_closing():
            transport.write(_BELL)

    def _flushed(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if self._close_pending and self.transport is not None:
            self._close_pending = False
            self.transport.close()

    def _tx_failed(self, exc: ProtocolError) -> None:
        self._tx_dead = True
        self._queue.clear()
        self._queued = 0
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(exc)
            self._drain.exception()
        self._raise_error(exc)
        if self.transport is not None:
            self.transport.abort()

    def write_buffer_size(self) -> int:
        return self._queued if self.shm else super().write_buffer_size()

    async def drained(self) -> None:
        if not self.shm:
            await super().drained()
            return
        while self._queue:
            if self._lost or self._tx_dead:
                raise self._failure or PeerDisconnected(
                    f"link to {self.describe()} closed", self.peer)
            if self._drain is None or self._drain.done():
                self._drain = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drain)

    def close(self) -> None:
        """Finish writing what is queued into the ring (an ABORT or GOODBYE above all),
        then close the socket. Incoming frames are skipped from now on but still consumed,
        so a peer flushing its own queue is never stuck; a peer that stops reading gets
        the socket reset after LINGER seconds."""
        if not self.shm:
            super().close()
            return
        if self.closed:
            return
        self.closed = True
        self._discard = True
        transport = self.transport
        if transport is None or self._lost:
            return
        if self._queue and not self._tx_dead:
            self._close_pending = True
            self._linger = asyncio.get_running_loop().call_later(LINGER, transport.abort)
        else:
            transport.close()

    def abort(self) -> None:
        if self.shm:
            self._queue.clear()
            self._queued = 0
        super().abort()

    def describe(self) -> str:
        base = super().describe()
        return f"{base[:-1]}, shm)" if self.shm and base.endswith(")") else base


class _ShmSetup:
    """Wraps the peer handshake: the connector's hello asks for shared memory, the
    acceptor's welcome offers a segment, the connector answers ``shm-ok`` or ``shm-fail``.
    The link is ready (``on_message`` returns the peer) once both sides know the outcome."""

    def __init__(self, inner: Handshaker, link: ShmLink, role: str, required: bool,
                 capacity: int) -> None:
        if role not in ("connector", "acceptor"):
            raise ValueError(f"role must be connector or acceptor, not {role!r}")
        self.inner = inner
        self.link = link
        self.role = role
        self.required = required
        self.capacity = capacity
        self.segment: Segment | None = None  # created, not yet handed to the link
        self.peer: int | None = None

    def start(self) -> list[dict[str, Any]]:
        return self.inner.start()

    def on_message(self, msg: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
        if self.role == "connector":
            return self._connector(msg)
        return self._acceptor(msg)

    def discard(self) -> None:
        """Remove a segment that was created but never handed over (setup failed)."""
        segment, self.segment = self.segment, None
        if segment is not None:
            segment.close()

    def _connector(self, msg: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
        replies, peer = self.inner.on_message(msg)
        if msg.get("t") == "challenge":
            return [dict(r, shm=True) if r.get("t") == "hello" else r for r in replies], peer
        if peer is None:
            return replies, peer
        offer = msg.get("shm")
        try:
            if not isinstance(offer, dict):
                raise RendezvousError(f"rank {peer} offered no shared memory"
                                      + (f": {msg['shm_error']}" if "shm_error" in msg else ""))
            name, capacity = offer.get("name"), offer.get("capacity")
            if not isinstance(name, str) or not isinstance(capacity, int):
                raise ProtocolError(f"malformed shared-memory offer from rank {peer}")
            segment = Segment.attach(name, capacity)
        except (OSError, ProtocolError, RendezvousError) as exc:
            if self.required:
                raise RendezvousError(
                    f"no shared-memory link to rank {peer}: {exc}") from None
            log.info("link to rank %d stays on TCP: %s", peer, exc)
            return [*replies, {"t": "shm-fail", "error": str(exc)}], peer
        segment.unlink()  # both sides have it mapped: the name is no longer needed
        self.link._activate(segment, rx=0)
        return [*replies, {"t": "shm-ok"}], peer

    def _acceptor(self, msg: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
        if self.peer is None:
            replies, peer = self.inner.on_message(msg)
            if peer is None:
                return replies, peer
            if not msg.get("shm"):
                if self.required:
                    raise RendezvousError(f"rank {peer} did not ask for shared memory but "
                                          "this rank requires it (transport='shm')")
                return replies, peer
            extra: dict[str, Any]
            try:
                self.segment = Segment.create(self.capacity)
            except OSError as exc:
                log.warning("cannot create a shared-memory segment: %s", exc)
                extra = {"shm_error": str(exc)}
            else:
                extra = {"shm": {"name": self.segment.name, "capacity": self.capacity}}
            replies = [dict(r, **extra) if r.get("t") == "welcome" else r for r in replies]
            if self.segment is None:
                return replies, peer
            self.peer = peer
            return replies, None
        kind = msg.get("t")
        segment = self.segment
        if segment is None or kind not in ("shm-ok", "shm-fail"):
            raise ProtocolError(f"expected shm-ok or shm-fail, got {kind!r}")
        self.segment = None
        if kind == "shm-ok":
            segment.unlink()
            self.link._activate(segment, rx=1)
            return [], self.peer
        segment.close()
        if self.required:
            raise RendezvousError(f"rank {self.peer} could not map shared memory: "
                                  f"{msg.get('error')}")
        log.info("link to rank %d stays on TCP: %s", self.peer, msg.get("error"))
        return [], self.peer
