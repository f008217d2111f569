"""Shared-memory links between ranks on one host: frames through rings in a sealed memfd
segment, wake-ups and liveness through the TCP connection that carried the handshake.

A link starts as a plain stream link (:class:`~aiocollect.transport.tcp.StreamLink`, frames
on the socket, as TCP's). The connecting rank asks for
shared memory in its hello; the accepting rank creates a segment (two rings, see
:mod:`aiocollect.transport.shm_ring`) and offers its descriptor in its welcome; the
connecting rank opens it through ``/proc``, checks and maps it and answers ``shm-ok`` (or
``shm-fail``, and both sides stay on TCP when the transport was ``auto``). From then on the
socket carries doorbell bytes and small frames:

- Frames (the same headers as on TCP) are copied into the outgoing ring by ``send`` and out
  of the incoming ring straight into the posted receive's memory (or a staging buffer).
- A writer rings the doorbell (writes one byte) only when the reader announced, in the ring,
  that it is about to sleep; a reader rings it only when the writer announced that it waits
  for space. Any byte makes the receiving loop drain its incoming ring and continue its
  queued writes, so idle links cost nothing and a stream of frames costs one wake-up.
- Small frames on the socket: a frame of at most ``SOCKET_FRAME_MAX`` payload bytes (below the
  by-reference threshold) goes on the socket, behind one ``SOCKET_FRAME`` byte, when the reader
  sleeps (its flag is armed, so a doorbell would be written anyway) and has read
  everything this side put into the ring and pulled every reference: the one write then
  carries the frame, and neither side touches the ring (where ranks outnumber cores and
  readers do not spin, every small frame went ring, doorbell, wake-up, ring). While the
  reader has not counted all of them taken (``socket_taken`` in the ring), the next small
  frames follow on the socket (at most ``SOCKET_FRAMES_AHEAD``) and nothing enters the ring,
  so frames reach the peer in the order they were sent.
- ``send`` never blocks: what does not fit is queued (the payload is referenced, not
  copied, until it is in the ring, as with TCP) and written as the reader frees space;
  ``write_buffer_size`` is the queued bytes and ``drained`` waits for the queue to empty.
- Single copy: when the peer's probe showed it can read this process's memory, a payload
  of at least ``policy.pull_min`` bytes goes as a *reference record* (address and length,
  :mod:`aiocollect.transport.shm_ring`) and the reader copies it straight from the sender's
  array into its posted receive (:mod:`aiocollect.transport.cma`). The payload counts in
  ``write_buffer_size`` until the reader reports it pulled, so ``drained`` waits for
  that, exactly as for bytes still queued.
- An operation's end waits only for its own frames (``sent_mark``): nothing for a frame
  that went straight into the ring, else its place in the queue and its reference's
  turn among the pulls (both advance in order), not for other operations' bulk frames
  queued or unpulled on the same link.
- Head-of-line blocking (off unless ``AIOCOLLECT_SHM_BULK_CAP`` is set to a byte count):
  a *bulk* frame (payload of at least ``tcp.BULK_MIN`` bytes) enters the ring only while
  the bulk bytes ahead of it (unread in the ring, queued for it, or sent by reference and
  not yet pulled) are under the cap; otherwise it waits in the link's bulk queue, and the
  writer's flag is armed so that the reader rings as it makes progress. Other frames enter
  the ring at once, ahead of the waiting bulk frames, unless a frame of their stream
  ``(kind, gid, seq, slot)`` is waiting. Off by default: every release then waits for the
  reader's doorbell, which on the shared 2-core machine cost 35-45 % of bulk bandwidth
  at 1 and 2 MiB (docs/benchmarks.md, *Head-of-line blocking*).
- The socket closing (a SIGKILLed peer's kernel closes it) is the loss of the peer; what
  the peer put in the ring before is still read first, so an ABORT frame is never lost.
- A rank that finds a ring corrupt (either direction) sends its ABORT on the socket
  instead, after an escape byte (:mod:`aiocollect.transport.shm_socket`), so that the peer
  hears who failed and why even when the ring it would read is the broken one.

Modules: ``shm_transport`` (the ``shm`` and ``auto`` transports and their listener),
``shm_setup`` (the handshake upgrade), ``shm_ring`` (segments and rings, no event loop),
``shm_reader`` (the receiving half: parking, spinning, backpressure) with ``shm_socket``
(the socket's bytes, sans-IO) and ``shm_pulls`` (the pull queue), ``shm_ledger`` (what
sent payloads wait for, sans-IO), ``stream_queue`` (held bulk frames, shared with TCP) and
this one (the link: setup, sending, closing). The classes: ``StreamLink`` (tcp.py: the
socket side) <- ``RingReader`` (receiving) <- ``ShmLink`` (sending); each uses only the
declared interface of the one below it (listed in its docstring), never its underscored state
(docs/design.md, "Stream links and the shared-memory link"). docs/shm.md has the design
and the measurements.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque

from aiocollect.errors import PeerDisconnected, ProtocolError
from aiocollect.transport import cma
from aiocollect.transport.base import DRAIN, Handshaker, LinkCaps, LinkEvents, SendMark
from aiocollect.transport.shm_ledger import SendLedger
from aiocollect.transport.shm_reader import (
    PUBLISH_EVERY,
    SPIN_ENV,
    SPIN_SECONDS,
    RingReader,
    ShmPolicy,
    spin_budget,
)
from aiocollect.transport.shm_ring import REF_DESC, REF_MAGIC_BYTES, Ring, Segment, fence
from aiocollect.transport.shm_setup import ShmSetup
from aiocollect.transport.shm_socket import (
    ESCAPE,
    SOCKET_FRAME,
    SOCKET_FRAME_MAX,
    SOCKET_FRAMES_AHEAD,
)
from aiocollect.transport.stream_queue import StreamQueue
from aiocollect.transport.stream_send import BULK_MIN, JOIN_MAX
from aiocollect.transport.wire import ABORT, KIND_AT, stream_of

log = logging.getLogger("aiocollect.transport.shm")

#: Bulk bytes ahead in a ring above which bulk frames wait in the link (0: never).
BULK_CAP_ENV = "AIOCOLLECT_SHM_BULK_CAP"


class ShmLink(RingReader):
    """A peer link through shared-memory rings, falling back to plain TCP (``auto``) when
    the peer does not take up the offer.

    Args:
        role: ``"connector"`` (asks for shared memory) or ``"acceptor"`` (creates it).
        required: shared memory or failure (``transport="shm"``); else fall back to TCP.
        policy: spin and ring capacity, shared by the rank's links (rendezvous sets them
            once every rank's record is known).
    """

    def __init__(
        self,
        events: LinkEvents,
        max_frame: int,
        handshaker: Handshaker,
        *,
        role: str,
        required: bool = False,
        policy: ShmPolicy | None = None,
    ) -> None:
        policy = policy or ShmPolicy()
        self._shm_setup = ShmSetup(
            handshaker, self._activate, role, required, lambda: policy.capacity
        )
        super().__init__(events, max_frame, self._shm_setup, policy)
        self._segment: Segment | None = None
        self._tx: Ring | None = None
        self._tx_dead = False
        self._caps_final: LinkCaps | None = None  # caps once pulls work both ways
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

    def _activate(self, segment: Segment, rx: int, peer_pid: int) -> None:
        self._segment = segment
        self._tx = segment.rings[1 - rx]
        self.attach(segment.rings[rx], peer_pid)
        if self.peer_pid is None:  # (a TCP socket's peer: the handshake says who)
            self.peer_pid = peer_pid or None

    # -- connection lifecycle --------------------------------------------------------------

    def connection_lost(self, exc: Exception | None) -> None:
        self.read_final()
        if self.shm:
            self._queue.clear()
            self._queued = 0
            self._ledger.drop()
            self._drop_held()
        drain = self._ring_drain
        if drain is not None and not drain.done():
            drain.set_exception(
                PeerDisconnected(f"link to {self.describe()} closed with data queued", self.peer)
            )
            drain.exception()  # mark retrieved: waiters may have gone
        try:
            super().connection_lost(exc)
        finally:
            self._shm_setup.discard()
            self._release()

    def handshake_failed(self, exc: BaseException) -> None:
        self._shm_setup.discard()
        super().handshake_failed(exc)

    def pause_writing(self) -> None:
        if not self.shm:
            super().pause_writing()

    def resume_writing(self) -> None:
        if not self.shm:
            super().resume_writing()

    def _release(self) -> None:
        segment, self._segment = self._segment, None
        self._tx = None
        self._caps_final = None
        self.detach()
        if segment is not None:
            segment.close()

    # -- sending ---------------------------------------------------------------------------

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

    # -- bulk frames held back (head-of-line blocking) --------------------------------------

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

    # -- small frames on the socket ---------------------------------------------------------

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

    @property
    def frames_on_socket(self) -> int:
        """Small frames this link has sent on its socket instead of through the ring
        (the reader slept with everything read)."""
        return self._socket_sent

    @property
    def frames_by_reference(self) -> int:
        """Frames this link has sent by reference (the peer pulled their payloads)."""
        return self._ledger.refs_sent

    def _by_reference(self, ring: Ring | None, nbytes: int) -> bool:
        """Whether a payload of ``nbytes`` through ``ring`` goes as a reference record."""
        return (
            self.shm
            and ring is not None
            and nbytes >= self.policy.pull_min > 0
            and ring.pulls_enabled()
        )

    @property
    def caps(self) -> LinkCaps:
        """In shared memory mode: polled from the loop (the ring reader spins itself), and
        pulls (and sends by reference) from ``policy.pull_min`` on, in each direction once
        that direction's reader has checked it can read the writer's memory (the peer's
        check may end after this side's handshake), and reads (exposes) one-sided where
        it pulls (sends by reference). On TCP fallback, the stream's."""
        if self._caps_final is not None and self.shm:
            return self._caps_final  # (asked per frame sent: a pulls flag never goes back)
        stream = super().caps
        if not self.shm:
            return stream
        rx = self._ref_min(self.rx)
        tx = self._ref_min(self._tx)
        caps = LinkCaps(
            pull_min=rx,
            reference_min=tx,
            local=stream.local,
            polls=True,
            reads=rx > 0,
            exposes=tx > 0,
        )
        if rx and tx:
            self._caps_final = caps
        return caps

    def _ref_min(self, ring: Ring | None) -> int:
        """The smallest payload through ``ring`` that goes by reference (0: none)."""
        return self.policy.pull_min if self._by_reference(ring, self.policy.pull_min) else 0

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

    # -- payloads sent by reference ----------------------------------------------------------

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

    def _spin_step(self, until: float | None) -> tuple[float | None, bool]:
        """One look of a busy-wait for the reader's pulls: the wait's deadline (set at the
        first look, kept once passed, so a wait spins once) and whether to spin this turn
        (False once it passed or when spinning is off)."""
        if self.policy.spin <= 0:
            return until, False
        now = time.perf_counter()
        if until is None:
            until = now + self.policy.spin
        return until, now < until

    async def drained(self) -> None:
        """Wait until everything queued is in the ring and every payload sent by
        reference has been pulled (spinning first, like a waiting reader, when the policy
        spins; then asleep until the reader's doorbell)."""
        if not self.shm:
            await super().drained()
            return
        spin_until = None
        while self._queue or self._ledger.refs or self._held:
            if self.lost or self._tx_dead:
                raise self.failure or PeerDisconnected(
                    f"link to {self.describe()} closed", self.peer
                )
            if self._held:
                # _release_held (on the reader's doorbell) wakes the drain
                if self._ring_drain is None or self._ring_drain.done():
                    self._ring_drain = asyncio.get_running_loop().create_future()
                await asyncio.shield(self._ring_drain)
                continue
            if not self._queue:
                if self.write_buffer_size() == 0:
                    return
                spin_until, spinning = self._spin_step(spin_until)
                if spinning:
                    await asyncio.sleep(0)
                    continue
                if self._all_pulled():
                    continue
            if self._ring_drain is None or self._ring_drain.done():
                self._ring_drain = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._ring_drain)

    # -- per-frame release (Link.sent_mark) ---------------------------------------------------

    def sent_mark(self, prev: SendMark = None) -> SendMark:
        """The last frame's mark, merged with ``prev``: ``(q, r)``, its bytes are in the
        ring once ``q`` bytes ever queued have been written there, and its payload is
        free once ``r`` references have been pulled (both count in order); None when it
        went straight into the ring; :data:`DRAIN` when it was held back (bulk)."""
        if not self.shm:
            return super().sent_mark(prev)
        mark = self._mark
        if prev is None or mark == prev:
            return mark
        return SendLedger.merge(mark, prev)

    def released(self, mark: SendMark) -> bool:
        if mark is None:
            return True
        if not self.shm or mark == DRAIN:
            return super().released(mark)
        if self.lost or self._tx_dead:
            return False  # (wait_released raises the failure)
        ledger = self._ledger
        if ledger.released(mark):
            return True
        if not ledger.in_ring(mark):
            return False
        try:
            self._reap()  # (its reference may have been pulled since)
        except ProtocolError as exc:
            self._tx_failed(exc)
            return False
        return ledger.released(mark)

    async def wait_released(self, mark: SendMark) -> None:
        """Wait for ``mark`` alone (other frames on the link may stay queued): like
        :meth:`drained`, spinning first while only pulls are outstanding, then asleep until
        the reader's doorbell (the writer's flag armed)."""
        if mark is None:
            return
        if not self.shm or mark == DRAIN:
            await super().wait_released(mark)
            return
        spin_until = None
        waits = self._ledger.waits
        waits.append(mark)
        try:
            while not self.released(mark):
                if self.lost or self._tx_dead or self._tx is None:
                    raise self.failure or PeerDisconnected(
                        f"link to {self.describe()} closed", self.peer
                    )
                if self._ledger.in_ring(mark):  # only its pull is outstanding
                    spin_until, spinning = self._spin_step(spin_until)
                    if spinning:
                        await asyncio.sleep(0)
                        continue
                    self._arm_writer(self._tx)  # the reader rings once it pulls more
                    if self.released(mark):
                        return
                if self._ring_drain is None or self._ring_drain.done():
                    self._ring_drain = asyncio.get_running_loop().create_future()
                await asyncio.shield(self._ring_drain)
        finally:
            waits.remove(mark)

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
        self.discarding = True
        transport = self.transport
        if transport is None or self.lost:
            return
        self.stop_holding()  # skip whatever the peer still sends, so it is never stuck
        if self._held and not self._tx_dead and not self.ring_broken:
            self._flush_held()
        if self._queue and not self._tx_dead and not self.ring_broken:
            self._close_pending = True
            self.reset_later()  # (the queue may never drain)
        else:
            self._end_socket()

    def _end_socket(self) -> None:
        """Half-close the socket and read on until the peer closes too, as a TCP link
        does: a reset could destroy frames this side sent on the socket that the peer has
        not read yet (an ABORT above all; frames in the ring survive it)."""
        self.stop_bells()  # nothing may be written after the end of the stream
        self.half_close()

    def abort(self) -> None:
        if self.shm:
            self.discarding = True  # nothing more is read, as on a reset TCP connection
            self._queue.clear()
            self._queued = 0
            self._ledger.drop()
            self._drop_held()
        super().abort()

    def describe(self) -> str:
        base = super().describe()
        return f"{base[:-1]}, shm)" if self.shm and base.endswith(")") else base


def bulk_cap() -> int:
    """``AIOCOLLECT_SHM_BULK_CAP`` in bytes (0, the default, or unparsable: no cap)."""
    try:
        return max(0, int(os.environ.get(BULK_CAP_ENV, "") or 0))
    except ValueError:
        return 0


__all__ = [
    "SPIN_ENV",
    "SPIN_SECONDS",
    "ShmLink",
    "ShmPolicy",
    "spin_budget",
]
