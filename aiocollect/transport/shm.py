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
``shm_reader`` (the receiving half in the ring: consumption, pulls, parking, spinning,
backpressure) and ``shm_doorbell`` (the receiving half's input from the socket and the
mailbox) with ``shm_socket`` (the socket's bytes, sans-IO) and ``shm_pulls`` (the pull
queue), ``shm_writer`` (the sending half) with ``shm_ledger`` (what sent payloads wait for,
sans-IO) and ``stream_queue`` (held bulk frames, shared with TCP), and this one (the link:
setup, waiting for sent frames, closing). The classes: ``StreamLink`` (tcp.py: the socket
side) <- ``RingReader`` <- ``DoorbellReader`` (the receiving half) <- ``RingWriter`` <-
``ShmLink`` (the sending half); each half uses only the declared interface of the one below
it (listed in its docstring), never its underscored state; the two classes of a half share
that half's state (docs/design.md, "Stream links and the shared-memory link"). docs/shm.md
has the design and the measurements.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiocollect.errors import PeerDisconnected, ProtocolError
from aiocollect.transport.base import DRAIN, Handshaker, LinkCaps, LinkEvents, SendMark
from aiocollect.transport.shm_ledger import SendLedger
from aiocollect.transport.shm_reader import (
    SPIN_ENV,
    SPIN_SECONDS,
    ShmPolicy,
    spin_budget,
)
from aiocollect.transport.shm_ring import Ring, Segment
from aiocollect.transport.shm_setup import ShmSetup
from aiocollect.transport.shm_writer import RingWriter

log = logging.getLogger("aiocollect.transport.shm")


class ShmLink(RingWriter):
    """A peer link through shared-memory rings, falling back to plain TCP (``auto``) when
    the peer does not take up the offer. It completes the sending half
    (:class:`~aiocollect.transport.shm_writer.RingWriter`, whose state it shares) with the
    link's setup, the waits for sent frames (``drained``, ``sent_mark``, ``released``,
    ``wait_released``) and closing.

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
        self._caps_final: LinkCaps | None = None  # caps once pulls work both ways

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

    @property
    def frames_on_socket(self) -> int:
        """Small frames this link has sent on its socket instead of through the ring
        (the reader slept with everything read)."""
        return self._socket_sent

    @property
    def frames_by_reference(self) -> int:
        """Frames this link has sent by reference (the peer pulled their payloads)."""
        return self._ledger.refs_sent

    # -- what sent frames wait for (Link.drained, Link.sent_mark) ------------------------

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

    # -- closing -----------------------------------------------------------------------

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


__all__ = [
    "SPIN_ENV",
    "SPIN_SECONDS",
    "ShmLink",
    "ShmPolicy",
    "spin_budget",
]
