"""A TCP (or TLS) link and its small-frame lane: a second connection between the same two
ranks that carries small frames, so that they never wait behind the bulk bytes already in
the main connection's socket buffers (which user space cannot reorder).

- When: a lane is dialed only once its link first carries bulk, that is when either rank
  sends a frame of ``BULK_MIN`` (64 KiB) bytes or more on it: only then can a small frame
  find bulk ahead of it, and a link that only ever carries small frames keeps one
  connection (one descriptor, one connect). Until the lane is up, every frame takes the
  main connection: the first bulk transfer does not wait for it, and small frames take the
  lane as soon as it is up. The trigger costs the small-frame path nothing: the send side
  looks in its bulk branch only (``SendSide._first_bulk``, unset once called), the read
  side in its general branch only (:meth:`TcpLink.open_frame`; a bulk frame never fits the
  read-ahead buffer, so it always comes that way); both are disarmed once the lane is due.
- Who dials: always the rank that connected the link (:meth:`TcpLink.arm_lane`, set up by
  :mod:`aiocollect.rendezvous.ondemand`), when it sends bulk or reads the peer's first bulk
  frame. The peer's first bulk frame is the one that needs the lane on the peer's side, and
  it reaches the connecting rank at once (bulk frames behind it wait, not it), so the
  lane comes up about one connect and handshake after the first bulk send of either rank.
  Having one rank dial keeps the handshake as it is (the acceptor admits a lane only for a
  link it accepted from that rank), needs no tie-break between two ranks dialing at once
  (each direction of a ring allreduce carries bulk), and sends the lane the same way as its
  link: through the same listener address, so through the same fault proxy in tests
  (``testing/proxynet.py`` gives each (reader, target) pair its own), and over TLS with the
  same certificates. A link of a sub-group made by ``split`` is its parent's link, with
  its lane; an elastic generation's links are new links, armed alike. The listener of a
  group whose links take lanes therefore stays open with the group.
- Setting up: the connecting rank dials through the peer's listener with the same
  handshake, ``lane: true`` in its hello (:mod:`aiocollect.rendezvous.ondemand`), where
  its process has a descriptor to spare (``_fdlimit.reserve_lane``; the acceptor checks
  too, ``_fdlimit.lane_fits``): a lane is optional, so the descriptor checks count one per
  link and a group that fits with one connection per link is never refused for lanes.
  Once the handshake succeeded it makes the connection its link's lane and says so on it
  (:meth:`TcpLink.attach_lane` writes the handshake message ``attached``,
  ``LANE_ATTACHED``); only then does the peer's listener hand the connection to the link
  (:meth:`TcpLink.take_lane`). So a lane given up while it is set up (a connect that timed
  out, on either side of the peer's welcome) was taken by neither link: each goes on with
  its one connection, as where a peer offers no lanes. ``AIOCOLLECT_TCP_LANES=1`` turns
  lanes off (one connection per link).
- Which frames: a frame whose payload is below ``min(LANE_MAX, max_frame)`` bytes and which
  begins its stream (chunk 0): a one-frame message or operation, a control frame. A stream
  of several frames begins with a full chunk (``chunk_bytes``, at least that limit), so all
  its frames take the main connection: the frames of one stream keep their order. The
  choice costs the send path one comparison per frame where a link has no lane
  (:meth:`~aiocollect.transport.stream_send.SendSide.send`).
- Reading: the lane's frames enter the link's mailbox beside the main connection's current
  frame (``_begin_aside``), or in one step. One that fails the link (an ABORT, a refused
  frame) fails the current frame's receive as well (the mailbox does).
- Closing: a GOODBYE goes on both connections, and the link passes it on only once both
  copies arrived (or the lane ended), so that nothing the peer sent before it on either
  connection is still on its way when the group hears that the peer closed. An ABORT goes
  on both too (the first to arrive counts): on the lane it overtakes bulk, on the link's
  connection it comes before that connection's end. Losing either connection breaks the
  link, as losing its one connection does without a lane: a lane that fails, at once; a
  lane the peer closed, once the link's own connection has stayed open ``LINGER`` seconds
  longer (a peer that closes the link closes both).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from aiocollect._fdlimit import descriptors_per_link
from aiocollect.errors import InternalError, PeerDisconnected
from aiocollect.transport.base import Aside, Handshaker, Link, LinkEvents
from aiocollect.transport.handshake_stream import pack
from aiocollect.transport.stream_send import BULK_MIN
from aiocollect.transport.tcp import StreamLink
from aiocollect.transport.wire import GOODBYE, Header

log = logging.getLogger("aiocollect.transport.tcp")

#: Frames with a payload below this (and below the link's ``max_frame``) that begin their
#: stream take the lane: what is not bulk (``stream_send.BULK_MIN``).
LANE_MAX = BULK_MIN
#: The handshake message (its ``t``) that ends a lane's handshake: the connector made the
#: connection its link's lane (rendezvous/handshake.py).
LANE_ATTACHED = "attached"
_ATTACHED = pack({"t": LANE_ATTACHED})
#: A payload size no frame reaches (``TcpLink._bulk_read_at`` of a link whose lane is
#: not this side's to dial, or is dialed already).
_NEVER = sys.maxsize


def lanes_enabled() -> bool:
    """Whether TCP links open their small-frame lane (``AIOCOLLECT_TCP_LANES``, default 2:
    yes; 1: no)."""
    return descriptors_per_link() == 2


class TcpLink(StreamLink):
    """A peer link over one TCP (or TLS) connection, and its small-frame lane once it is up
    (module docstring)."""

    def __init__(self, events: LinkEvents, max_frame: int, handshaker: Handshaker) -> None:
        super().__init__(events, max_frame, handshaker)
        self._lane: LaneLink | None = None
        #: The lane is being dialed (by this side), or up and not ended.
        self._lane_open = False
        #: The main connection's GOODBYE while the lane may still bring frames sent before
        #: its own copy; whether the lane's copy arrived; set while the lane ends a frame.
        self._held_goodbye: bytes | None = None
        self._lane_goodbye = False
        self.lane_frame = False
        #: Whether the last GOODBYE read on the link's own connection says that a copy
        #: went on the lane (its chunk field, ``stream_send.LANE_COPY``).
        self._goodbye_copied = False
        #: Called once this link first carries bulk, where its lane is this side's to dial
        #: (:meth:`arm_lane`); frames read with a payload of this many bytes or more call
        #: it (never, unless armed: the read side's general path compares, once per frame).
        self._dial_lane: Callable[[TcpLink], None] | None = None
        self._bulk_read_at = _NEVER

    @property
    def laned(self) -> bool:
        """Whether the link's small-frame lane is up (two connections)."""
        return self._lane is not None

    # -- the lane's setup ---------------------------------------------------------------------

    def wants_lane(self) -> bool:
        """Whether this link should get a lane: lanes are on, it has none and is open."""
        return (
            lanes_enabled()
            and self._lane is None
            and not self._lane_open
            and not (self.closed or self.lost)
            and self.handshake is None
        )

    def arm_lane(self, dial: Callable[[TcpLink], None]) -> None:
        """Call ``dial(self)`` (which dials this link's lane, on this side) once the link first
        carries bulk: this side sends, or reads, a frame of ``BULK_MIN`` bytes or more.
        Only the send path's bulk branch and the read path's general branch look."""
        self._dial_lane = dial
        self._first_bulk = self._bulk_now
        self._bulk_read_at = BULK_MIN

    def _bulk_now(self) -> None:
        """The link's first bulk frame, sent or read: dial its lane (once)."""
        dial, self._dial_lane = self._dial_lane, None
        self._first_bulk = None
        self._bulk_read_at = _NEVER
        if dial is not None and self.wants_lane():
            dial(self)

    def lane_coming(self) -> None:
        """This side dials the lane now: a GOODBYE waits for its copy on the lane (or for
        the lane's end) from now on."""
        self._lane_open = True
        self._hold_goodbyes()

    def lane_failed(self, exc: BaseException) -> None:
        """The lane this side dialed could not be made: the link goes on without one."""
        log.debug("link to %s: no small-frame lane: %r", self.describe(), exc)
        self._lane_open = False
        self._release_goodbye()

    def take_lane(self, conn: StreamLink) -> bool:
        """Make ``conn`` (an accepted connection whose lane handshake with this link's
        peer succeeded, paused since) this link's lane. False if the link has ended or has
        one already (the caller closes ``conn``)."""
        if self._lane is not None or self.closed or self.lost:
            return False
        if conn.transport is None or conn.lost:
            return False
        lane = LaneLink(self, None, self.max_frame)
        lane.adopt(conn)
        self._hold_goodbyes()
        self._use_lane(lane)
        return True

    def attach_lane(self, lane: LaneLink) -> None:
        """Make ``lane`` (dialed by this side, its handshake succeeded) this link's lane:
        tell the peer (``LANE_ATTACHED``, before any frame) and send small frames on it.
        From now on, losing it breaks the link."""
        if self.closed or self.lost or lane.transport is None or lane.lost:
            lane.abort()
            self.lane_failed(PeerDisconnected("the link ended first", self.peer))
            return
        lane.transport.write(_ATTACHED)
        self._use_lane(lane)

    def _use_lane(self, lane: LaneLink) -> None:
        """Send small frames on ``lane`` and read its frames, from now on."""
        assert lane.transport is not None
        self._lane = lane
        self._lane_open = True
        self._lane_write = lane.transport.write
        self._lane_max = min(LANE_MAX, self.max_frame)
        lane.start_reading()

    def _hold_goodbyes(self) -> None:
        """From now on a GOODBYE is passed on once both copies arrived."""
        if not isinstance(self.events, _GoodbyeHold):
            self.events = _GoodbyeHold(self.events, self)

    # -- the lane's end -----------------------------------------------------------------------

    def lane_lost(self, lane: LaneLink, exc: BaseException | None) -> None:
        """The lane's connection ended: small frames take the main connection again. Unless
        this link is closing, the link breaks: at once where the lane failed (``exc``),
        else (the peer closed it) once ``LINGER`` seconds pass without the main connection
        ending too, as it does when the peer closes the link. A lane this side dialed and
        gave up before making it this link's lane (:meth:`attach_lane`) changes nothing."""
        if lane is not self._lane:
            return
        self._lane_max = 0
        self._lane_open = False
        self._release_goodbye()
        if self.closed or self.lost or self.transport is None:
            return
        if exc is None:
            self.reset_later()
            return
        log.warning("link to %s: its small-frame lane failed (%s)", self.describe(), exc)
        self.transport.abort()  # connection_lost reports the link's end

    def on_goodbye(self, payload: bytes) -> bool:
        """A GOODBYE arrived: True to pass it on now, False to hold or drop it. The main
        connection's copy passes at once unless the peer sent a copy on the lane (its
        header says so) that has not arrived, while the lane may still bring it; the
        lane's copy passes the main one's if that is held."""
        if self.lane_frame:
            self._lane_goodbye = True
            held, self._held_goodbye = self._held_goodbye, None
            return held is not None  # (else the main connection's copy passes, later)
        if self._lane_goodbye or not self._goodbye_copied or not self._lane_open:
            return True
        self._held_goodbye = payload
        return False

    def _release_goodbye(self) -> None:
        """The lane ended or never came: pass on the main connection's GOODBYE if held."""
        held, self._held_goodbye = self._held_goodbye, None
        if held is not None:
            self.events.on_control(self, GOODBYE, held)

    def open_frame(self, h: Header) -> memoryview | None:
        if h.kind == GOODBYE:  # (a call per frame read in the general way: bulk, control)
            self._goodbye_copied = h.chunk == 1
        elif h.length >= self._bulk_read_at:  # (the peer's first bulk frame: a lane now)
            self._bulk_now()
        return super().open_frame(h)

    # -- the link's end, for both connections -----------------------------------------------

    def connection_lost(self, exc: Exception | None) -> None:
        self._lane_max = 0
        lane = self._lane
        if lane is not None and not lane.lost:
            lane.abort()
        super().connection_lost(exc)

    def close(self) -> None:
        lane = self._lane
        if lane is not None:
            self._lane_max = 0
            lane.close()
        super().close()

    def abort(self) -> None:
        self._lane_max = 0
        if self._lane is not None:
            self._lane.abort()
        super().abort()

    async def wait_closed(self) -> None:
        await super().wait_closed()
        if self._lane is not None:
            await self._lane.wait_closed()

    def _staging_full(self) -> None:
        super()._staging_full()
        if self._lane is not None:
            self._lane.pause_for_staging(True)

    def _staging_relieved(self) -> None:
        super()._staging_relieved()
        if self._lane is not None:
            self._lane.pause_for_staging(False)


class LaneLink(StreamLink):
    """The small-frame lane of a :class:`TcpLink` (``owner``): a stream link whose frames
    go into its owner's mailbox, beside the frame the owner's connection is reading. Its
    own ``events`` report only its errors and its end to the owner."""

    def __init__(
        self,
        owner: TcpLink,
        handshaker: Handshaker | None,
        max_frame: int,
    ) -> None:
        events = _LaneEvents(owner)
        if handshaker is None:  # (an accepted connection: adopted after its handshake)
            handshaker = _Done()
        super().__init__(events, max_frame, handshaker)
        self.owner = owner
        self._aside: Aside | None = None
        # The one-step receives go straight to the owner's mailbox (no call added per frame).
        self._take_posted = owner._take_posted  # type: ignore[method-assign]
        self._whole_frame = owner._whole_frame  # type: ignore[method-assign]

    def adopt(self, conn: StreamLink) -> None:
        """Take over ``conn``'s connection (its handshake over, its reading paused)."""
        transport = conn.transport
        assert transport is not None
        self.transport = transport
        self.address, self.peer = conn.address, conn.peer
        self._caps, self._tls = conn._caps, conn._tls
        self.handshake = None
        self.ready.set_result(self)
        transport.set_protocol(self)

    def start_reading(self) -> None:
        """Read frames: the handshake paused this connection until its link took it."""
        self._transport_paused = True
        self._sync_reading()

    def pause_for_staging(self, paused: bool) -> None:
        """Pause reading while the owner's staging is full (``paused``), else resume."""
        if paused:
            self._staging_full()
        else:
            self._staging_relieved()

    def describe(self) -> str:
        return f"the small-frame lane of {self.owner.describe()}"

    # -- frames into the owner's mailbox ------------------------------------------------------

    def _begin_frame(self, h: Header) -> memoryview | None:
        begun = self.owner._begin_aside(h)
        if begun is None:
            return None
        view, self._aside = begun
        return view

    def _end_frame(self) -> None:
        token, self._aside = self._aside, None
        if token is not None:
            owner = self.owner
            owner.lane_frame = True  # (a GOODBYE ending now came on the lane)
            try:
                owner._end_aside(token)
            finally:
                owner.lane_frame = False


class _LaneEvents:
    """What a lane reports: its errors as its owner's, its end to its owner."""

    def __init__(self, owner: TcpLink) -> None:
        self.owner = owner

    def on_header(self, link: Link, header: Header) -> None:
        raise InternalError("a lane's frames go to its link's mailbox")

    def on_control(self, link: Link, kind: int, payload: bytes) -> None:
        raise InternalError("a lane's frames go to its link's mailbox")

    def on_error(self, link: Link, exc: BaseException) -> None:
        self.owner.events.on_error(self.owner, exc)

    def on_lost(self, link: Link, exc: BaseException | None) -> None:
        assert isinstance(link, LaneLink)
        self.owner.lane_lost(link, exc)


class _GoodbyeHold:
    """A laned link's events: the fabric's, except that a GOODBYE is passed on once both
    connections brought theirs (:meth:`TcpLink.on_goodbye`). ``on_header`` is the
    fabric's own method (no call added per frame)."""

    def __init__(self, events: LinkEvents, link: TcpLink) -> None:
        self.inner = events
        self.link = link
        self.on_header = events.on_header
        self.on_error = events.on_error
        self.on_lost = events.on_lost

    def on_control(self, link: Link, kind: int, payload: bytes) -> None:
        if kind == GOODBYE and not self.link.on_goodbye(payload):
            return
        self.inner.on_control(link, kind, payload)


class _Done:
    """The handshaker of an adopted connection, whose handshake is over."""

    def start(self) -> list[dict[str, object]]:
        return []

    def on_message(self, msg: dict[str, object]) -> tuple[list[dict[str, object]], int | None]:
        raise InternalError("an adopted lane runs no handshake")


__all__ = ["LANE_ATTACHED", "LANE_MAX", "LaneLink", "TcpLink", "lanes_enabled"]
