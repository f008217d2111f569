"""The receiving half of a shared-memory link, inside the ring: reading frames out of the
incoming ring, pulling referenced payloads, parking, spinning, backpressure and waking the
peer's writer (see :mod:`aiocollect.transport.shm`).

:class:`RingReader` is a :class:`~aiocollect.transport.tcp.StreamLink` (the socket side);
:class:`~aiocollect.transport.shm_doorbell.DoorbellReader` completes it with what reaches
the half from the socket and the mailbox, and the link's sending half
(:mod:`aiocollect.transport.shm_writer`) and setup (:mod:`aiocollect.transport.shm`) build
on that.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

from aiocollect.errors import PeerDisconnected, ProtocolError
from aiocollect.transport import cma
from aiocollect.transport.base import Handshaker, LinkEvents
from aiocollect.transport.mailbox import land
from aiocollect.transport.shm_pulls import PULL_STEP, PullQueue
from aiocollect.transport.shm_ring import (
    REF_DESC,
    REF_MAGIC_BYTES,
    Ring,
    configured_capacity,
    fence,
)
from aiocollect.transport.shm_socket import (
    BELL,
)
from aiocollect.transport.tcp import StreamLink
from aiocollect.transport.wire import (
    DATA,
    HEADER,
    HEADER_SIZE,
    KIND_AT,
    MAGIC,
    MAGIC_BYTES,
    P2P,
    Header,
    Key,
    parse_header,
)

log = logging.getLogger("aiocollect.transport.shm")
_unpack_header = HEADER.unpack_from
_new_key = tuple.__new__
#: A write at least this large is published (and the reader woken) before the next one, so
#: the reader copies out while the writer copies in.
PUBLISH_EVERY = 64 * 1024
#: How long a DATA frame whose receive is not posted yet may wait in the ring (instead of
#: being copied to a staging buffer) for the receive; once per operation.
PARK_SECONDS = 0.002
#: Only frames this large are parked: staging a small one costs less than the extra turn
#: of the event loop that reading it after ``post_recv`` takes.
PARK_MIN = 64 * 1024
#: How long a reader keeps looking at its ring, with a receive waiting or after its last
#: input, before it sleeps (only while the host has a core per local rank;
#: AIOCOLLECT_SHM_SPIN_US overrides it, 0 = off). Measured in docs/shm.md.
SPIN_SECONDS = 200e-6
SPIN_ENV = "AIOCOLLECT_SHM_SPIN_US"
REF_SIZE = HEADER_SIZE + REF_DESC.size


@dataclass
class ShmPolicy:
    """Settings shared by the shared-memory links of one rank, filled in by rendezvous.

    ``spin``: seconds a reader with a receive waiting keeps looking at its ring (between
    the event loop's other work) before it sleeps until a doorbell; see :func:`spin_budget`.
    ``capacity``: bytes per ring of the segments this rank creates (it accepts what its
    peers offer); see :func:`~aiocollect.transport.shm_ring.configured_capacity`.
    ``pull_min``: the smallest payload sent by reference on links whose peer can pull
    (0: never); see :func:`~aiocollect.transport.cma.threshold`.
    """

    spin: float = 0.0
    capacity: int = field(default_factory=configured_capacity)
    pull_min: int = field(default_factory=cma.threshold)


def spin_budget(local_ranks: int) -> float:
    """Seconds a waiting reader spins before it sleeps: AIOCOLLECT_SHM_SPIN_US, else
    SPIN_SECONDS, and only while ``local_ranks`` (ranks on this host) are no more than this
    process's cores, since a spinning rank would take the core its peer needs."""
    raw = os.environ.get(SPIN_ENV, "")
    try:
        spin = max(0.0, float(raw)) * 1e-6 if raw else SPIN_SECONDS
    except ValueError:
        log.warning("ignoring %s=%r: not a number", SPIN_ENV, raw)
        spin = SPIN_SECONDS
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return spin if local_ranks <= cores else 0.0


class RingReader(StreamLink):
    """Reading frames out of the incoming ring once the link is in shared memory mode
    (:meth:`attach`); before that, and on TCP fallback, a plain stream link.

    It uses only :class:`~aiocollect.transport.tcp.StreamLink`'s declared interface (and
    Link's transport contract), and keeps its own frame state: in shared memory mode the
    socket carries no frames, so the stream's frame parser stays idle. Its state is the
    receiving half's, shared with :class:`~aiocollect.transport.shm_doorbell.DoorbellReader`
    (the socket's bytes and the mailbox's events). What the sending half may use: ``shm``
    and ``rx`` (read-only), ``policy``, ``ring_broken`` (a ring failed: the ABORT goes on
    the socket, escaped; either half sets it), :meth:`attach`/:meth:`detach`,
    :meth:`ring_bell`/:meth:`stop_bells`, :meth:`read_final`, :meth:`stop_holding`, and the
    hook :meth:`write_pending`, which every doorbell ends with.
    """

    def __init__(
        self, events: LinkEvents, max_frame: int, handshaker: Handshaker, policy: ShmPolicy
    ) -> None:
        super().__init__(events, max_frame, handshaker)
        self.shm = False  # set once both sides have the segment mapped
        self.policy = policy
        self._loop = asyncio.get_running_loop()
        #: The incoming ring, while the link is in shared memory mode.
        self.rx: Ring | None = None
        self._rx_dead = False
        self._rx_paused = False  # too many early frames staged: leave the rest in the ring
        self._parked: Key | None = None
        self._parked_in_ring = False  # the parked frame holds the ring (else the pulls)
        self._parked_op: tuple[int, int] | None = None
        self._unparked_op: tuple[int, int] | None = None
        self._park_timer: asyncio.TimerHandle | None = None
        self._spin_until: float | None = None
        self._rgen = 1  # our reader's sleep generation; a new segment starts armed at 1
        self._rung_writer = 0  # the peer writer's generation we last rang for
        self._peer_pid = 0  # whose memory reference records point into
        #: Reference records taken out of the ring, to pull in order, and the pull under
        #: way; its streams (kind, group, seq, slot) with queued or underway pulls, bound
        #: (tested per frame read).
        self._pulls = PullQueue()
        self._pull_streams = self._pulls.streams
        self._resume: asyncio.Handle | None = None  # the next pull step, at the loop's next turn
        self._desc = bytearray(REF_DESC.size)
        self._desc_view = memoryview(self._desc)
        #: A ring failed: an ABORT goes on the socket (escaped).
        self.ring_broken = False
        # The frame being read out of the ring (the stream's parser has its own).
        self._rhdr = bytearray(HEADER_SIZE)
        self._rhdr_view = memoryview(self._rhdr)
        self._rpayload: memoryview | None = None  # where its payload goes
        self._rgot = 0  # payload bytes of it read so far
        self._socket_taken = 0  # socket frames taken
        self._socket_unacked = False  # taken, not yet counted in the ring (staging full)
        self._bells_off = False  # the socket's stream is ending (stop_bells)

    def attach(self, rx: Ring, peer_pid: int) -> None:
        """Enter shared memory mode: frames come through ``rx``; reference records point
        into the memory of process ``peer_pid``."""
        self.rx = rx
        self._peer_pid = peer_pid
        self._pulls.peer_pid = peer_pid
        self.shm = True

    def expose(self, buf: memoryview) -> bytes:
        """The token of ``buf`` for the peer's ``process_vm_readv`` (its address and length
        here: :func:`~aiocollect.transport.cma.token`); nothing is registered, so
        :meth:`unexpose` has nothing to end (:meth:`Link.expose`)."""
        return cma.token(buf)

    def read_exposed(self, token: bytes, offset: int, into: memoryview) -> None:
        """Copy ``len(into)`` bytes from ``offset`` of what the peer exposed as ``token``
        into ``into`` (``process_vm_readv``; only where this side's pull check worked:
        ``caps.reads``). A token that is malformed, a range outside the exposed length, or
        a range the peer's memory does not back is malformed input: the link fails (the
        group breaks) and so does the call (:meth:`Link.read_exposed`). Callable from a
        worker thread too (the pull collectives' bulk worker, engine/bulk.py): the link's
        failure is then reported on the event loop's thread.

        Raises:
            PeerDisconnected: the link is down, or the peer process is gone.
            ProtocolError: the token or range is bad, or this side may not read the
                peer's memory although it said it would.
        """
        if self.rx is None or self._rx_dead or not self.shm:
            raise self.failure or PeerDisconnected(
                f"link to {self.describe()} is closed", self.peer
            )
        try:
            addr = cma.locate(token, offset, len(into))
            if into:
                cma.pull(self._peer_pid, into, addr)
        except ProcessLookupError:
            raise PeerDisconnected(
                f"{self.describe()} is gone (its memory could not be read)", self.peer
            ) from None
        except ValueError as exc:
            err = ProtocolError(f"{self.describe()} sent a bad one-sided token: {exc}")
            self._read_failed(err)
            raise err from None
        except OSError as exc:
            err = ProtocolError(
                f"{self.describe()} gave an address its memory does not back ({exc})"
            )
            self._read_failed(err)
            raise err from None

    def _read_failed(self, err: ProtocolError) -> None:
        """Fail the link for a bad one-sided read (:meth:`read_exposed`), on the event
        loop's thread whichever thread read."""
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # (no loop runs in this thread: a worker thread)
            here = False
        if here:
            self._rx_failed(err)
        else:
            self._loop.call_soon_threadsafe(self._rx_failed, err)

    def detach(self) -> None:
        """Let go of the incoming ring (its segment is being closed)."""
        self.rx = None

    def write_pending(self) -> None:
        """Hook: continue queued writes (the sending half); every doorbell ends with it."""

    def ring_bell(self) -> None:
        """Write one doorbell byte on the socket (while it is open and not half-closed)."""
        transport = self.transport
        if (
            transport is not None
            and not self.lost
            and not self._bells_off
            and not transport.is_closing()
        ):
            transport.write(BELL)

    def stop_bells(self) -> None:
        """Ring no more doorbells (the sending half is about to end the socket's stream)."""
        self._bells_off = True

    def _count_socket_frames(self) -> None:
        """Tell the writer how many socket frames this side has taken (so that it may
        write into the ring again), unless staging is full: then the writer soon stops at
        SOCKET_FRAMES_AHEAD, as it would at a full ring."""
        rx = self.rx
        if self._rx_paused or rx is None or self._rx_dead:
            self._socket_unacked = True
            return
        self._socket_unacked = False
        self._ring_writer(rx.publish_socket_taken(self._socket_taken))

    def _service(self, spin: bool = True) -> None:
        """A doorbell rang (or reading may resume, or a spin ended): read what arrived,
        start the pulls it queued, then write what waits for space. ``spin``: whether
        running out of input may start a spin (not when one just ended)."""
        if self.lost:
            return
        rx = self.rx
        if rx is not None and not self._rx_dead:
            try:
                self._read_ring(rx, spin)
                if self._resume is None and not self._rx_dead:
                    self._pull_step(rx)
            except ProtocolError as exc:
                self._rx_failed(exc)
        self.write_pending()

    def _read_ring(self, rx: Ring, spin: bool = True) -> None:
        while self._consume(rx):
            if self._spin_until is not None:
                return  # a spin is on: it looks again on the loop's next turn
            if spin and self.policy.spin > 0:
                self._start_spin(rx)
                return
            # Out of input: say so in the ring, then look once more (the writer checks the
            # flag after publishing, so at least one of the two sees the other).
            self._rgen += 1
            rx.arm_reader(self._rgen)
            fence()
            if not self._has_input(rx):
                return

    def _start_spin(self, rx: Ring) -> None:
        # Not sleeping: the writer need not ring (it sees 0). The spin arms the flag, and
        # looks once more, before it ends, so no frame goes unnoticed.
        rx.arm_reader(0)
        self._spin_until = time.perf_counter() + self.policy.spin
        self._loop.call_soon(self._spin_tick)

    def _spin_tick(self) -> None:
        """One look at the ring between the event loop's other work (each turn polls the
        sockets without blocking), while a receive waits on this link and for
        ``policy.spin`` seconds after the last input (the next operation's frames usually
        follow within that). Frames found this way cost no doorbell and no wake-up; after
        ``policy.spin`` seconds without input the reader arms its flag and sleeps."""
        rx = self.rx
        if rx is None or self.lost or self._rx_dead:
            self._spin_until = None
            return
        try:
            hold = self._rx_paused or (self._parked is not None and self._parked_in_ring)
            if self._resume is not None:  # a pull goes on (and reads the ring) on its own
                self._spin_until = time.perf_counter() + self.policy.spin
            elif not hold and self._has_input(rx):
                self._spin_until = time.perf_counter() + self.policy.spin
                self._service()
            elif hold or time.perf_counter() >= (self._spin_until or 0):
                # A last read before sleeping, and the pulls it queued: no doorbell comes
                # for what arrived during the spin (the writer rings only a sleeping reader).
                self._spin_until = None
                self._service(spin=False)
                return
        except ProtocolError as exc:
            self._spin_until = None
            self._rx_failed(exc)
            return
        self._loop.call_soon(self._spin_tick)

    def read_final(self) -> None:
        """The socket closed: read what the peer put in the ring before it went, holding
        nothing back (no parking, no backpressure)."""
        self._unpark()
        rx = self.rx
        if rx is None or self._rx_dead:
            return
        try:
            self._consume(rx, final=True)
            self._pull_step(rx, final=True)
        except ProtocolError as exc:
            self._rx_failed(exc)

    def _has_input(self, rx: Ring) -> bool:
        need = 1 if self._rpayload is not None or self.discarding else HEADER_SIZE
        return rx.available() >= need

    def _consume(self, rx: Ring, final: bool = False) -> bool:
        """Take frames out of the ring: whole headers, then each payload straight into the
        memory ``_begin_frame`` chose (one copy). Returns True when it stopped for lack of
        input, False when it holds back (a parked frame, backpressure, a dead stream)."""
        avail = rx.available()
        try:
            while not self._rx_dead and (final or not self.lost):
                if self.discarding:
                    self._rx_paused = False
                    rx.skip(avail)
                    avail = rx.available()
                    if not avail:
                        return True
                    continue
                payload = self._rpayload
                if payload is not None:
                    if not avail and not (avail := rx.available()):
                        return True
                    got = self._rgot
                    n = min(avail, len(payload) - got)
                    rx.read(payload[got : got + n])
                    avail -= n
                    self._rgot = got = got + n
                    if got == len(payload):
                        self._rpayload = None
                        self._rgot = 0
                        if got >= PUBLISH_EVERY and not final:  # let the writer go on
                            rx.publish_tail()
                            self._wake_writer(rx)
                        self._end_frame()
                    continue
                if not final and (
                    self._rx_paused or (self._parked is not None and self._parked_in_ring)
                ):
                    return False
                if avail < HEADER_SIZE and (avail := rx.available()) < HEADER_SIZE:
                    # The writer is not short of space (the ring is not full), so it will
                    # publish the rest of the header without our help.
                    return True
                if (
                    not self._pull_streams
                    and not final
                    and (off := rx.pos % rx.cap) <= rx.cap - HEADER_SIZE
                ):
                    # The common small frame in one step (as StreamLink._fast_frame): a
                    # DATA or P2P frame wholly in the ring whose receive is posted with its
                    # fingerprint and length. Its header is read where it lies in the ring
                    # (unless it wraps): the writer does not touch unread bytes.
                    magic, kind, coll, rop, dtype, gid, chunk, seq, slot, root, elems, n = (
                        _unpack_header(rx.data, off)
                    )
                    if (
                        magic == MAGIC
                        and kind in (DATA, P2P)
                        and (avail >= HEADER_SIZE + n or rx.available() >= HEADER_SIZE + n)
                    ):
                        recv = self._take_posted(
                            _new_key(Key, (kind, gid, seq, slot, chunk)),
                            n,
                            (coll, dtype, elems, rop, root),
                        )
                        if recv is not None:
                            rx.pos += HEADER_SIZE
                            if n:
                                rx.read(recv.view)
                            avail = max(0, avail - HEADER_SIZE - n)
                            land(recv)
                            continue
                rx.peek(self._rhdr_view)
                ref = self._rhdr[:KIND_AT] == REF_MAGIC_BYTES
                if ref:
                    if avail < REF_SIZE and (avail := rx.available()) < REF_SIZE:
                        return True  # the writer publishes the rest on its own, as above
                    self._rhdr[:KIND_AT] = MAGIC_BYTES
                h = parse_header(self._rhdr, self.max_frame)
                if not ref and self._pull_streams and h.key[:4] in self._pull_streams:
                    if not final:
                        return False  # after its stream's pulls, in order (_pull_step)
                    self._pull_step(rx, final=True)
                if (
                    not ref
                    and not final
                    and h.kind == DATA
                    and h.length >= PARK_MIN
                    and not self.is_posted(h.key)
                    and self._park(h, in_ring=True)
                ):
                    return False
                rx.skip(HEADER_SIZE)
                avail -= HEADER_SIZE
                if ref:
                    rx.read(self._desc_view)
                    avail -= REF_DESC.size
                    addr, length = REF_DESC.unpack(self._desc)
                    if length != h.length or not length or addr == 0 or h.kind not in (DATA, P2P):
                        raise ProtocolError(
                            f"{self.describe()} sent a bad reference record: {length} bytes "
                            f"at {addr:#x} for a frame of {h.length}"
                        )
                    stream = h.key[:4]
                    self._pulls.add(h, addr, stream)  # pulled in turn (_pull_step)
                    continue
                if (dest := self.open_frame(h)) is not None:
                    self._rpayload = dest
                    self._rgot = 0
            return False
        finally:
            if not self._rx_dead and not final:
                rx.publish_tail()
                self._wake_writer(rx)

    def stop_holding(self) -> None:
        """The link is closing: hold nothing back in the ring any more (no backpressure,
        no parked frame), so that whatever the peer still sends is consumed and the peer
        is never stuck; reading goes on at the loop's next turn."""
        if self._rx_paused or self._parked is not None:
            self._rx_paused = False
            self._unpark()
            if self._socket_unacked:
                self._count_socket_frames()
            self._loop.call_soon(self._service)

    # -- pulls: payloads copied straight out of the peer's memory ----------------------------

    def _pull_step(self, rx: Ring, final: bool = False) -> None:
        """Copy the next step of the queued referenced payloads out of the peer's memory
        (at most PULL_STEP bytes; all of them when ``final``); the next step follows on the
        loop's next turn. A frame whose receive is not posted yet waits for it as the
        ring's frames do (parking, then staging), and while staging is full; the ring is
        read on meanwhile."""
        pulls = self._pulls
        while True:
            if self.discarding or self.failure is not None:
                pulls.clear()  # (the link is failing: its receives fail with it)
                return
            if pulls.current is None:
                if not pulls.pending:
                    return
                h = pulls.pending[0][0]
                if not final:
                    if self._parked is not None and not self._parked_in_ring:
                        return  # waits for its receive (post_recv) or the park's end
                    if not self.is_posted(h.key):
                        if self._rx_paused:
                            return  # staging is full: wait until it is relieved
                        if h.kind == DATA and h.length >= PARK_MIN and self._park(h, in_ring=False):
                            return
                if not pulls.begin(self._begin_aside(h)):
                    # refused (the link is failing): nothing to copy, the pull is over
                    self.discarding = True
                    self._count_pull(rx)
                    continue
            try:
                token = pulls.copy(PULL_STEP)
            except ProcessLookupError:
                # the peer is gone: its socket's end reports that; nothing more can be read
                self._rx_dead = True
                return
            except OSError as exc:
                raise ProtocolError(
                    f"{self.describe()} sent a reference its memory does not back ({exc})"
                ) from None
            if token is not None:  # the payload is complete
                self._count_pull(rx)
                self._end_aside(token)
            if final:
                continue  # nothing else runs before the end is reported
            # after the callbacks the frame's receive just scheduled (one reduction per pull)
            self._resume = self._loop.call_soon(self._resume_reading)
            return

    def _resume_reading(self) -> None:
        self._resume = None
        self._service()

    def _count_pull(self, rx: Ring) -> None:
        """Tell the writer that one more reference record is done with."""
        rx.publish_pulled(self._pulls.pulled)
        self._wake_writer(rx)

    # -- parking: a frame whose receive is not posted yet stays in the ring ----------------

    def _park(self, h: Header, in_ring: bool) -> bool:
        """Leave the frame ``h`` in the ring (``in_ring``; else at the head of the pulls)
        until its receive is posted (saving the staging copy), for at most PARK_SECONDS
        per operation; False to stage it now."""
        op = (h.gid, h.seq)
        if op == self._unparked_op:
            return False  # this operation's receives were slow once: stage the rest
        self._parked = h.key
        self._parked_in_ring = in_ring
        self._parked_op = op
        self._park_timer = asyncio.get_running_loop().call_later(PARK_SECONDS, self._park_expired)
        return True

    def _park_expired(self) -> None:
        self._park_timer = None
        self._unparked_op = self._parked_op
        self._unpark()
        self._service()

    def _unpark(self) -> None:
        self._parked = None
        if self._park_timer is not None:
            self._park_timer.cancel()
            self._park_timer = None

    def _wake_writer(self, rx: Ring) -> None:
        fence()
        self._ring_writer(rx.writer_sleep())

    def _ring_writer(self, gen: int) -> None:
        """Ring the writer that sleeps with generation ``gen`` (read after a fence), once
        per generation (0: it is awake)."""
        if gen and gen != self._rung_writer:
            self._rung_writer = gen
            self.ring_bell()

    def _rx_failed(self, exc: ProtocolError) -> None:
        """The incoming ring or frame stream is corrupt: never read it again, and send the
        ABORT that reporting it causes on the socket, not through the rings."""
        self._rx_dead = True
        self.ring_broken = True
        self._raise_error(exc)
