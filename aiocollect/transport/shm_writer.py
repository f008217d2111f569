"""The sending half of a shared-memory link: frames into the outgoing ring, on the socket
(small ones, to a sleeping reader) or by reference (the reader pulls them), the queue of
what waits for space, bulk frames held back (head-of-line blocking), and letting go of the
payloads the reader has pulled (see :mod:`aiocollect.transport.shm` for the protocol).

:class:`RingWriter` builds on the receiving half
(:class:`~aiocollect.transport.shm_doorbell.DoorbellReader`) through its declared interface
only; :class:`~aiocollect.transport.shm.ShmLink` completes it with the link's setup, the
waits for sent frames (``drained``, ``wait_released``) and closing, sharing its state.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque

from aiocollect.errors import PeerDisconnected, ProtocolError
from aiocollect.transport import cma
from aiocollect.transport.base import DRAIN, Handshaker, LinkEvents, SendMark
from aiocollect.transport.shm_doorbell import DoorbellReader
from aiocollect.transport.shm_ledger import SendLedger
from aiocollect.transport.shm_reader import PUBLISH_EVERY, ShmPolicy
from aiocollect.transport.shm_ring import REF_DESC, REF_MAGIC_BYTES, Ring, fence
from aiocollect.transport.shm_socket import (
    ESCAPE,
    SOCKET_FRAME,
    SOCKET_FRAME_MAX,
    SOCKET_FRAMES_AHEAD,
)
from aiocollect.transport.stream_queue import StreamQueue
from aiocollect.transport.stream_send import BULK_MIN, JOIN_MAX
from aiocollect.transport.wire import ABORT, KIND_AT, stream_of

#: Bulk bytes ahead in a ring above which bulk frames wait in the link (0: never).
BULK_CAP_ENV = "AIOCOLLECT_SHM_BULK_CAP"


class RingWriter(DoorbellReader):
    """The sending half: ``send`` and what follows from it, once the link is in shared
    memory mode (before that, and on TCP fallback, the stream link's). Its state is the
    sending half's, shared with :class:`~aiocollect.transport.shm.ShmLink`, which sets the
    outgoing ring (``_tx``) when the segment is mapped; what it uses of the receiving half
    is that half's declared interface (``shm``, ``policy``, ``ring_broken``,
    :meth:`ring_bell`/:meth:`stop_bells`), and it implements the hook
    :meth:`write_pending` that every doorbell ends with.
    """

    def __init__(
        self, events: LinkEvents, max_frame: int, handshaker: Handshaker, policy: ShmPolicy
    ) -> None:
        super().__init__(events, max_frame, handshaker, policy)
        #: The outgoing ring, while the link is in shared memory mode.
        self._tx: Ring | None = None
        self._tx_dead = False
        self._queue: deque[memoryview] = deque()
        self._queued = 0
        self._mark: SendMark = None  # what the last send's payload waits for
        self._wgen = 0
        self._rung_reader = 0  # the peer reader's generation we last rang for
        self._socket_sent = 0  # frames ever sent on the socket (see _send_frame)
        self._close_pending = False
        #: Send marks and references not pulled yet: what sent payloads wait for.
        self._ledger = SendLedger()
        #: Bulk frames waiting for the ring (head-of-line blocking), and its frames (tested
        #: per frame sent, without a call).
        self._hold_queue = StreamQueue()
        self._held = self._hold_queue.frames
        self._bulk_cap = bulk_cap()
        #: Resolved when what ``drained`` waits for may have happened (the stream's flow
        #: control has its own, for TCP fallback).
        self._ring_drain: asyncio.Future[None] | None = None

    def send(self, header: bytes, payload: memoryview | bytes) -> SendMark:
        tx = self._tx
        tried = False  # (whether _socket_frame said no)
        if tx is not None and not self._held:
            if self._socket_frame(header, payload, tx):
                return None  # (the common small frame, in one call)
            tried = True
        if not self.shm:
            return super().send(header, payload)
        if self.ring_broken and header[KIND_AT] == ABORT and not (self.lost or self.closed):
            self._send_escaped(header, payload)
            self.bytes_sent += len(payload)
            self.frames_sent += 1
            self._mark = None
            return None
        if self.lost or self.closed or self._tx_dead or tx is None:
            raise self.failure or PeerDisconnected(
                f"link to {self.describe()} is closed", self.peer
            )
        n = len(payload)
        if n >= BULK_MIN and self._bulk_cap:
            if self._held or self._must_hold(n):
                self._hold(header, payload, stream_of(header))
                self._mark = DRAIN
                return DRAIN
        elif self._held:
            stream = stream_of(header)
            if stream in self._hold_queue.streams:  # behind its stream's waiting frames
                self._hold(header, payload, stream)
                self._mark = DRAIN
                return DRAIN
        self._send_frame(header, payload, tried)
        return self._mark

    # -- bulk frames held back (head-of-line blocking) -------------------------------

    def _bulk_ahead(self) -> int:
        """Bytes a frame entering the ring now would wait behind."""
        tx = self._tx
        if tx is None:
            return 0
        try:
            self._reap()
            return tx.cap - tx.free() + self._queued + self._ledger.ref_bytes
        except ProtocolError as exc:
            self._tx_failed(exc)
            return 0

    def _must_hold(self, n: int) -> bool:
        """Whether a bulk frame of ``n`` bytes waits: the cap or more is ahead of it (so
        the reader has up to the cap + one frame to work on, never nothing)."""
        del n
        return self._bulk_cap > 0 and self._bulk_ahead() >= self._bulk_cap

    def _hold(self, header: bytes, payload: memoryview | bytes, stream: bytes) -> None:
        first = not self._held
        self._hold_queue.push(header, payload, stream)
        if first:
            self._arm_for_held()

    def _arm_for_held(self) -> None:
        """Have the reader ring once it reads or pulls more (then ``_release_held``); if
        it did so in the meantime, release on the loop's next turn."""
        tx = self._tx
        if tx is None or self._tx_dead:
            return
        self._arm_writer(tx)
        if not self._must_hold(len(self._held[0][1])):
            asyncio.get_running_loop().call_soon(self._release_held)

    def _release_held(self) -> None:
        """Send held frames while the bulk ahead allows; re-arm if some still wait. Wakes
        the drain's waiter, whose condition includes the held frames."""
        held = self._held
        if not held or self._tx_dead or self.lost or self._tx is None:
            return
        for header, payload in self._hold_queue.release(self._may_release):
            self._send_frame(header, payload)
            if self._tx_dead or self._tx is None:
                return
        if held:
            self._arm_for_held()
        drain = self._ring_drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    def _may_release(self, n: int) -> bool:
        """Whether a held frame of ``n`` payload bytes may enter the ring now."""
        return n < BULK_MIN or not self._must_hold(n)

    def _flush_held(self) -> None:
        """Send every held frame regardless of the cap (closing)."""
        for header, payload, _ in self._hold_queue.take_all():
            if self._tx_dead or self.lost or self._tx is None:
                break
            self._send_frame(header, payload)

    def _drop_held(self) -> None:
        self._hold_queue.clear()

    # -- into the ring, on the socket or by reference --------------------------------

    def _socket_frame(self, header: bytes, payload: memoryview | bytes, tx: Ring) -> bool:
        """Write a small frame (below the by-reference threshold) on the socket if it may go
        there now: True if written. It may after frames there the reader has not taken yet
        (for their order), and when the reader sleeps (a doorbell would be written: that
        one write carries the frame, and neither side touches the ring) with everything
        this side wrote into the ring read and every reference pulled, so that nothing sent
        before can arrive after it (the ring's counters in one call, Ring.socket_turn:
        where ranks outnumber cores almost every small frame goes this way); never while
        frames wait in the queue or the link is failing."""
        n = len(payload)
        pull_min = self.policy.pull_min
        if (
            n <= SOCKET_FRAME_MAX
            and (n < pull_min or pull_min <= 0)
            and self.shm
            and not self._queue
            and not (self.ring_broken or self.lost or self.closed or self._tx_dead)
            and (transport := self.transport) is not None
            and not transport.is_closing()
            and tx.socket_turn(
                self._socket_sent, self._ledger.refs_sent, self._rung_reader, SOCKET_FRAMES_AHEAD
            )
        ):  # behind a SOCKET_FRAME byte
            transport.write(SOCKET_FRAME + header + payload if n else SOCKET_FRAME + header)
            self._socket_sent += 1
            self.bytes_sent += n
            self.frames_sent += 1
            self._mark = None
            return True
        return False

    def _send_frame(
        self, header: bytes, payload: memoryview | bytes, socket_tried: bool = False
    ) -> None:
        """Into the ring (or the queue for it) now, by reference where that applies, or, if
        small, on the socket (``socket_tried``: :meth:`_socket_frame` said no already)."""
        n = len(payload)
        tx = self._tx
        pull_min = self.policy.pull_min
        if n <= JOIN_MAX and (n < pull_min or pull_min <= 0) and tx is not None and not self._queue:
            # The common small frame: on the socket (_socket_frame), else header and
            # payload as one write into the ring.
            if not socket_tried and self._socket_frame(header, payload, tx):
                return
            try:
                if not self._socket_ahead(tx) and tx.free() >= len(header) + n:
                    tx.write(memoryview(header + payload if n else header))
                    self.bytes_sent += n
                    self.frames_sent += 1
                    self._publish(tx)
                    self._mark = None
                    return
            except ProtocolError:
                pass  # the general path below reports it
        view = memoryview(payload)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.bytes_sent += n
        self.frames_sent += 1
        if tx is None:
            raise self.failure or PeerDisconnected(
                f"link to {self.describe()} is closed", self.peer
            )
        ref = 0
        if self._by_reference(tx, n):
            # by reference: the reader copies the payload out of this process's memory
            header = REF_MAGIC_BYTES + header[KIND_AT:] + REF_DESC.pack(cma.address(view), n)
            ref = self._ledger.by_reference(view, n)
            n = 0
        idle = not self._queue  # else the queue waits for space: the doorbell resumes it
        if idle:
            try:
                if not self._socket_ahead(tx) and (
                    tx.free() >= len(header) + n  # the common case: straight in
                ):
                    tx.write(memoryview(header))
                    if n:
                        tx.write(view)
                    self._publish(tx)
                    self._mark = (0, ref) if ref else None
                    return
            except ProtocolError as exc:
                if header[KIND_AT] == ABORT:  # the group is failing: this must still reach the peer
                    self.ring_broken = True
                    self._send_escaped(header, payload)
                self._tx_failed(exc)
                return
        self._queue.append(memoryview(header))
        if n:
            self._queue.append(view)
        self._queued += len(header) + n
        self._mark = self._ledger.queued(len(header) + n, ref)
        if idle:
            self._pump()

    def _socket_ahead(self, tx: Ring) -> int:
        """Frames sent on the socket that the reader has not taken yet: while there are
        any, a frame may not enter the ring (the reader could read it first)."""
        sent = self._socket_sent
        if not sent:
            return 0
        ahead = sent - tx.socket_taken()
        if not 0 <= ahead <= SOCKET_FRAMES_AHEAD:
            raise ProtocolError(
                f"corrupt shared-memory ring: the reader took {sent - ahead} socket "
                f"frames of {sent}"
            )
        return ahead

    def _send_escaped(self, header: bytes, payload: memoryview | bytes) -> None:
        """Send an ABORT on the socket, behind an escape byte (the rings are broken)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise self.failure or PeerDisconnected(
                f"link to {self.describe()} is closed", self.peer
            )
        transport.write(ESCAPE + header + bytes(payload))

    def _by_reference(self, ring: Ring | None, nbytes: int) -> bool:
        """Whether a payload of ``nbytes`` through ``ring`` goes as a reference record."""
        return (
            self.shm
            and ring is not None
            and nbytes >= self.policy.pull_min > 0
            and ring.pulls_enabled()
        )

    # -- the queue for space in the ring ---------------------------------------------

    def _pump(self) -> None:
        """Copy queued pieces into the outgoing ring while it has space."""
        tx, queue, ledger = self._tx, self._queue, self._ledger
        if tx is None or self._tx_dead:
            return
        try:
            if queue and self._socket_ahead(tx):
                # After the socket's frames: the reader rings as it takes them.
                self._arm_writer(tx)
                if self._socket_ahead(tx):
                    if self._ledger.waits and self._marks_released():
                        self._wake_drain()
                    return
            free = tx.free()
            wrote = False
            while queue:
                if not free:
                    if wrote:
                        self._publish(tx)
                        wrote = False
                    self._arm_writer(tx)
                    free = tx.free()
                    if not free:
                        if self._ledger.waits and self._marks_released():
                            self._wake_drain()
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
                ledger.queue_out += n
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
            self.ring_bell()

    def _flushed(self) -> None:
        drain = self._ring_drain
        # (_all_pulled fails the drain itself on a corrupt pull count: check again after)
        if (
            drain is not None
            and not drain.done()
            and (self._marks_released() if self._ledger.waits else self._all_pulled())
            and not drain.done()
        ):
            drain.set_result(None)
        if self._close_pending and self.transport is not None:
            self._close_pending = False
            self._end_socket()

    # -- payloads sent by reference --------------------------------------------------

    def _reap(self) -> None:
        """Let go of the payloads the reader has pulled.

        Raises:
            ProtocolError: the reader reports more pulls than references were sent.
        """
        tx = self._tx
        if tx is None:
            return
        if self._ledger.let_go(tx.pulled()) and not self._queue:
            # Whoever reaps the last reference wakes the drain: another in-flight operation
            # may reap here (write_buffer_size) before the doorbell that the drain awaits.
            drain = self._ring_drain
            if drain is not None and not drain.done():
                drain.set_result(None)

    def _arm_writer(self, tx: Ring) -> None:
        """Arm the writer's flag of ``tx`` with a new generation, so that the reader rings
        once it reads or pulls more (the fence orders the flag before a last look)."""
        self._wgen += 1
        tx.arm_writer(self._wgen)
        fence()

    def _all_pulled(self) -> bool:
        """Whether every payload sent by reference has been pulled; if not, the writer's
        flag is armed (a new generation) so that the reader rings once it pulls more."""
        tx, refs = self._tx, self._ledger.refs
        if not refs or tx is None or self._tx_dead:
            return True
        try:
            self._reap()
            if refs:
                self._arm_writer(tx)
                self._reap()
        except ProtocolError as exc:
            self._tx_failed(exc)
            return True
        return not refs

    # -- a failed ring, the doorbell's hook, the waiters -------------------------------

    def _tx_failed(self, exc: ProtocolError) -> None:
        """The outgoing ring is corrupt (the reader's counters are implausible): write
        nothing more into it, report ``exc`` (the ABORT that causes goes on the socket,
        escaped) and close the link; the socket is closed, not reset, so the ABORT
        arrives."""
        self._tx_dead = True
        self.ring_broken = True
        self._queue.clear()
        self._queued = 0
        self._ledger.drop()
        self._drop_held()
        if self._ring_drain is not None and not self._ring_drain.done():
            self._ring_drain.set_exception(exc)
            self._ring_drain.exception()
        self._raise_error(exc)
        self.close()  # (the fabric's failure has closed it already, as a rule)

    def write_pending(self) -> None:
        if self._queue:
            self._pump()
        else:
            self._flushed()
        if self._held:
            self._release_held()

    def write_buffer_size(self) -> int:
        """Bytes queued for the ring plus bytes sent by reference and not yet pulled."""
        if not self.shm:
            return super().write_buffer_size()
        if self._ledger.refs:
            try:
                self._reap()
            except ProtocolError as exc:
                self._tx_failed(exc)
        return self._queued + self._ledger.ref_bytes + self._hold_queue.nbytes

    def _marks_released(self) -> bool:
        """Whether the mark of a waiter (``wait_released``) is released now; if none is
        and payloads are still to be pulled, the writer's flag is armed again (a new
        generation) so that the reader rings once it pulls more (as ``_all_pulled``)."""
        waits = self._ledger.waits
        if any(self.released(m) for m in waits):
            return True
        tx = self._tx
        if tx is None or self._tx_dead or not self._ledger.refs:
            return False
        self._arm_writer(tx)
        return any(self.released(m) for m in waits)

    def _wake_drain(self) -> None:
        """The frames of a waiter's mark have left: its waiter (and any other) looks again."""
        drain = self._ring_drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    def _end_socket(self) -> None:
        """Half-close the socket and read on until the peer closes too, as a TCP link
        does: a reset could destroy frames this side sent on the socket that the peer has
        not read yet (an ABORT above all; frames in the ring survive it)."""
        self.stop_bells()  # nothing may be written after the end of the stream
        self.half_close()


def bulk_cap() -> int:
    """``AIOCOLLECT_SHM_BULK_CAP`` in bytes (0, the default, or unparsable: no cap)."""
    try:
        return max(0, int(os.environ.get(BULK_CAP_ENV, "") or 0))
    except ValueError:
        return 0
