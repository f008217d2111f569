"""Link: one connection to one peer, with a tag mailbox matching frames to posted receives.

Concrete transports (tcp, memory, shm, ...; made by a
:class:`~aiocollect.transport.interface.Transport`) feed incoming bytes through
:meth:`Link._begin_frame` and :meth:`Link._end_frame` and implement the sending half.
Everything above the transport talks to a link through ``post_recv``, ``send``,
``drained``, ``close`` and ``caps`` (:class:`LinkCaps`, the one thing algorithms may ask a
link about itself). :mod:`aiocollect.testing.link_suite` checks all of what follows. The
mailbox itself, with its staging limits, is Link's base class
(:mod:`aiocollect.transport.mailbox`); this module holds the contract, the protocols and
types of the seam, and Link's sending half and one-sided reads.

The receive-side contract, what a transport must keep to:

- Loop thread only: ``_begin_frame`` and ``_end_frame`` run on the event loop's thread (a
  transport that polls from another thread, such as a completion queue, hands each
  completion over with ``loop.call_soon_threadsafe``), with a header decoded by
  ``wire.parse_header(buf, max_frame)``, so lengths are bounded first.
- One frame at a time: after ``_begin_frame`` returns a view, write exactly
  ``header.length`` bytes into it, then call ``_end_frame()`` exactly once per accepted
  header, before the next ``_begin_frame``. The view may be the posted receive's own
  memory; the payload may arrive in pieces across loop passes, and receives may be posted
  meanwhile (the mailbox checks for one when the frame ends).
- Frames beside the current one: a transport whose payloads complete out of the order it
  reads their headers in (shared memory pulls referenced payloads out of the peer's memory
  while it reads on) begins such a frame with ``_begin_aside`` and ends it with
  ``_end_aside(token)``; the frame read meanwhile stays current. Receivers match frames by
  key, so frames of different keys may land in any order. Either call may fail the link
  (an ABORT ends, a frame is refused): the current frame's receive then fails with it.
- A whole data frame at once: a DATA or P2P frame whose payload is already at hand may go
  through ``_whole_frame(header, payload)`` instead, which does what ``_begin_frame``, the
  copy and ``_end_frame`` would, in one step (no frame is current meanwhile).
- When ``_begin_frame`` returns None (``_whole_frame`` False), the error has gone to
  ``events.on_error`` (the fabric fails and closes the link): read nothing more into the
  mailbox, and no ``_end_frame``.
- Nothing after ``fail``: whoever fails a link closes it, and a closed link delivers no
  more frames (it may go on reading and discarding bytes so that the peer's flush
  completes).
- Report the connection's end once through ``events.on_lost`` (not for a connection whose
  handshake failed).

A transport subclass uses Link's protected members named in :data:`TRANSPORT_HOOKS` (the
receive path above, ``_raise_error`` to report an error, the staging hooks to override)
and its public ones (``failure``, ``is_posted``, ``post_recv``, the counters), nothing
else of Link's underscored state.

Sending: ``send`` never blocks (a transport may keep a reference to the payload, which
must stay unchanged until ``drained()``); frames of one stream (kind, group, seq, slot)
keep their order, other streams may overtake; ``send`` on a closed link, or one whose peer
is gone, raises ``PeerDisconnected``; ``drained()`` returns, or raises
``PeerDisconnected``, once the peer is gone; after a ``send``, ``sent_mark()`` marks that
frame and ``released(mark)`` / ``wait_released(mark)`` say when its payload has left user
memory (what an operation waits for before it ends); ``close()`` delivers what is queued
(an ABORT above all) before the connection ends, ``abort()`` ends it at once.

One-sided reads (optional; ``caps.reads`` / ``caps.exposes`` say where a link has them):
``expose(buf)`` lets the peer read ``buf`` and returns a token (bytes, at most
:data:`TOKEN_MAX`, opaque to all but the link kind) that an algorithm sends the peer in a
frame; the peer's link copies from it with ``read_exposed(token, offset, into)``;
``unexpose(token)`` ends the exposure. Tokens come from the network, so ``read_exposed``
checks them as far as the kind can (length, range, a live exposure) and a bad one is a
ProtocolError that breaks the group, never a crash or a read outside the exposed range.
All three run on the event loop's thread only (not thread-safe, like the rest of a link);
``read_exposed`` has copied the bytes when it returns. Shared memory implements them with
``process_vm_readv`` (transport/cma.py); tests/transport/example_onesided.py is the
smallest example.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from aiocollect.errors import InternalError, RendezvousError
from aiocollect.transport.mailbox import Mailbox
from aiocollect.transport.wire import Header


class LinkEvents(Protocol):
    """What a link reports upward (implemented by the engine's Fabric)."""

    def on_header(self, link: Link, header: Header) -> None:
        """A DATA/P2P header arrived; may raise MismatchError or ProtocolError."""

    def on_control(self, link: Link, kind: int, payload: bytes) -> None:
        """A control frame (ABORT, GOODBYE, PING, PONG) arrived."""

    def on_error(self, link: Link, exc: BaseException) -> None:
        """The link hit a protocol or matching error; it is being closed."""

    def on_lost(self, link: Link, exc: BaseException | None) -> None:
        """The connection closed (``exc`` is None for a clean EOF)."""


class Handshaker(Protocol):
    """Sans-IO handshake run over length-prefixed msgpack maps before the first frame."""

    def start(self) -> list[dict[str, Any]]:
        """Messages to send as soon as the connection is up."""

    def on_message(self, msg: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
        """Consume one message; return replies and, once complete, the peer's rank.

        Raises:
            AuthenticationError, RendezvousError, ProtocolError: the peer is rejected.
        """


class Rejection(Exception):
    """Raised by a handshaker to send ``reply`` to the peer, then fail with ``error``."""

    def __init__(self, reply: dict[str, Any], error: BaseException) -> None:
        super().__init__(str(error))
        self.reply = reply
        self.error = error


class Superseded(RendezvousError):
    """A connection refused because the pair's other connection stands (both ranks
    connected at once, links on demand): not a fault, so listeners do not log it."""


Fingerprint = tuple[int, int, int, int, int]


@dataclass(frozen=True, slots=True)
class LinkCaps:
    """A link's capability, as algorithms see it (they never ask what kind a link is).

    ``pull_min``: the smallest payload whose frames this side copies straight out of the
    peer's memory (so a frame whose receive is not posted yet costs nothing while it
    waits); 0 when it pulls none (transports that deliver bytes).
    ``reference_min``: the smallest payload ``send`` passes by reference (the peer pulls
    it; the sender does not copy it on the calling thread); 0 when ``send`` copies every
    payload, so a sender of large payloads yields to the event loop after each.
    ``local``: whether the peer is a process on this host (True), on another host
    (False), or not known (None: a link that is not a network socket, such as an
    in-process memory link, whose peer runs on this thread). The engine's busy-wait
    counts the local peers (engine/spin.py).
    ``polls``: the link polls for its frames from the event loop itself (shared memory's
    ring reader), so the engine's busy-wait leaves receives on it alone.
    ``same_thread``: the peer runs on this very thread (the in-process memory link), so
    every message of an operation costs this thread's CPU at both ends; the automatic
    algorithm choice then counts messages (collectives/select.py).
    ``reads``: this side reads, with :meth:`Link.read_exposed`, memory the peer exposed
    (:meth:`Link.expose` at the peer's end): one-sided reads, what the pull algorithms
    (collectives/pull.py) use.
    ``exposes``: the peer can read what this side exposes with :meth:`Link.expose` (the
    tokens it returns work at the peer's end). A pull algorithm exposes its buffer to the
    peers of links that say so and pushes the data to the others.
    """

    pull_min: int = 0
    reference_min: int = 0
    local: bool | None = None
    polls: bool = False
    same_thread: bool = False
    reads: bool = False
    exposes: bool = False

    def pulls(self, nbytes: int) -> bool:
        """Whether a frame of ``nbytes`` from the peer is pulled out of its memory."""
        return 0 < self.pull_min <= nbytes

    def copies(self, nbytes: int) -> bool:
        """Whether ``send`` copies a payload of ``nbytes`` on the calling thread."""
        return not 0 < self.reference_min <= nbytes


#: The most bytes a one-sided token (:meth:`Link.expose`) may take: a pull algorithm's
#: token frame has room for this many.
TOKEN_MAX = 64

#: What a link that delivers bytes and copies what it sends can do (the default).
COPIES = LinkCaps()
#: The same, for a link whose peer runs on this thread (the in-process memory link).
SAME_THREAD = LinkCaps(same_thread=True)


class Receiver(Protocol):
    """What a posted receive is to a link (:meth:`Link.post`): where the frame's payload
    goes (``view``, exact length), the fingerprint the frame must carry (``expect``, or
    None), and two calls, exactly one of which the link makes once: ``landed()`` when the
    payload is in place (synchronously from the transport's read path), ``failed(exc)``
    when the link fails first. Neither may raise (the link logs what does and reads on)."""

    view: memoryview
    expect: Fingerprint | None

    def landed(self) -> None: ...

    def failed(self, exc: BaseException) -> None: ...


#: Link's protected interface for transport subclasses: what they call (``_begin_frame``,
#: ``_end_frame``, ``_raise_error``) and the hooks they may override (``_staging_full``,
#: ``_staging_relieved``, ``_raise_error``). tests/unit/test_link_structure.py checks
#: that the shared-memory link's classes use nothing else underscored that is not their
#: own.
TRANSPORT_HOOKS = frozenset(
    {
        "_begin_aside",
        "_begin_frame",
        "_end_aside",
        "_end_frame",
        "_raise_error",
        "_staging_full",
        "_staging_relieved",
        "_take_posted",
        "_whole_frame",
    }
)


#: A frame begun beside the current one (:meth:`Link._begin_aside`): its header, and the
#: receive or the staging buffer its payload goes to.
Aside = tuple[Header, Receiver | None, bytearray | None]

#: What :meth:`Link.sent_mark` returns: None (nothing to wait for), :data:`DRAIN`, or a
#: transport's own pair of positions (see :meth:`Link.sent_mark` of the transport).
SendMark = tuple[int, int] | None
#: The mark "until the link's user-space buffer drains" (every frame queued before).
DRAIN: SendMark = (-1, -1)


class Link(Mailbox, abc.ABC):
    """One peer connection. ``peer`` is the peer's world rank (-1 until the handshake ends).
    Its receiving half, the tag mailbox (``post_recv``, ``post``, ``fail`` and the
    transport hooks), is its base :class:`~aiocollect.transport.mailbox.Mailbox`."""

    def __init__(self, events: LinkEvents, max_frame: int) -> None:
        self.peer = -1
        self.events = events
        self.max_frame = max_frame
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self.frames_received = 0
        self.goodbye_received = False
        #: The peer's process id where the kernel tells it (a Unix socket's SO_PEERCRED),
        #: else None: a same-host peer whose connection ends unexplained is blamed once
        #: its process has exited (engine.fabric, ``Fabric.on_lost``).
        self.peer_pid: int | None = None
        #: What the peer's GOODBYE reported: (operations called, digest, recent
        #: fingerprints) per group id, for the close handshake (engine.fabric).
        self.goodbye_digests: dict[int, tuple[int, int, list[Any]]] | None = None
        self.closed = False
        Mailbox.__init__(self)

    def _raise_error(self, exc: BaseException) -> None:
        """Report ``exc`` (a protocol or matching error) upward: ``events.on_error``, whose
        fabric fails and closes the link. A transport may override it to stop reading
        first, calling this version."""
        self.events.on_error(self, exc)

    # -- sending ---------------------------------------------------------------------------

    @abc.abstractmethod
    def send(self, header: bytes, payload: memoryview | bytes) -> SendMark:
        """Queue one frame. The payload memory must stay unchanged until ``drained()``, or
        until :meth:`released` holds for the mark returned: the frame's, as
        :meth:`sent_mark` ``(None)`` would give right after (None: the payload has left
        the caller's memory already)."""

    @property
    def caps(self) -> LinkCaps:
        """What this link can do for the algorithm using it, now (it may change once, as
        a link's handshake ends): the only thing algorithms ask a link about itself."""
        return COPIES

    # -- one-sided reads: memory the peer reads without this side's help ---------------------

    #: Whether this kind of link can tell that an exposure has ended: True where it keeps
    #: a table of live exposures (the in-process example, RDMA's deregistered memory
    #: regions), so that a read of an ended exposure's token is a ProtocolError; False where
    #: a token names memory directly (shared memory's ``process_vm_readv``), and only the
    #: algorithm's own frames keep reads inside an exposure's life.
    exposure_end_checked: bool = False

    def expose(self, buf: memoryview) -> bytes:
        """Let the peer read ``buf`` (a contiguous byte view, which may be read-only) with
        :meth:`read_exposed`: returns the token to send it, at most :data:`TOKEN_MAX`
        bytes, opaque to everyone but this kind of link. Only where ``caps.exposes``.

        Lifetime: the exposure lasts until :meth:`unexpose` (or until the link closes);
        meanwhile the caller keeps ``buf`` alive, and unchanged where the peer reads it (the
        algorithm's frames say when the peer has finished). Loop thread only, like every
        call of this section.

        Raises:
            InternalError: this link cannot expose memory to its peer (the default).
        """
        raise InternalError(f"the link to {self.describe()} cannot expose memory to its peer")

    def unexpose(self, token: bytes) -> None:
        """End the exposure ``token`` (from :meth:`expose` on this link): release what it
        holds (a registration, a table entry). Never raises: a token already ended, or one
        of a closed link, is ignored. Where :attr:`exposure_end_checked`, the peer's later
        reads of ``token`` fail with ProtocolError."""
        return  # (a link that exposes nothing holds nothing)

    def read_exposed(self, token: bytes, offset: int, into: memoryview) -> None:
        """Copy ``len(into)`` bytes from ``offset`` of the memory the peer exposed as
        ``token`` (which came from the network: checked) into ``into``, before returning
        (a link whose reads complete asynchronously waits for the completion). Only where
        ``caps.reads``.

        A bad token (malformed, of another link, ended where :attr:`exposure_end_checked`)
        or a range outside the exposure, where the token lets the link check it, is the
        peer's protocol error: the link reports it (``events.on_error``: the group breaks)
        and raises it; it never reads outside the exposed range it can check, and never
        crashes the process.

        Raises:
            ProtocolError: the token or the range is bad (above).
            PeerDisconnected: the link is down, or the peer process is gone.
            InternalError: this link cannot read its peer's memory (the default).
        """
        raise InternalError(f"the link to {self.describe()} cannot read its peer's memory")

    def pace_writes(self, pieces: bool) -> None:
        """Whether this link should hand large payloads to the kernel a piece per event-loop
        turn (``pieces``: the rank has a core of its own, so the loop's responsiveness is
        worth a few more system calls) or whole (ranks share cores: the system calls are
        what the other ranks wait for). The fabric says so once the group has formed
        (engine/fabric.py); links whose writes cannot hold the loop ignore it."""
        return  # (a link that writes no large payloads to a socket)

    def expect(self) -> None:
        """A receive posted on this link some time ago is about to be awaited. A link that
        polls for its own frames (``caps.polls``: shared memory) starts polling again, as it
        does when a receive is posted, where its spin policy allows; others do nothing.
        Algorithms that post their receives long before they wait for them (the pull
        collectives post a peer's last frames when they start) call it, so the wait spins
        instead of sleeping until a doorbell."""
        return  # (nothing to do for a link whose frames the loop's I/O delivers)

    @abc.abstractmethod
    def write_buffer_size(self) -> int:
        """Bytes queued in user space and not yet handed to the kernel."""

    @abc.abstractmethod
    async def drained(self) -> None:
        """Return once everything queued so far has left user space.

        Raises:
            the link's failure if it breaks first.
        """

    # -- per-frame release: whether a frame's payload still lies in the caller's memory ------

    def sent_mark(self, prev: SendMark = None) -> SendMark:
        """A mark for the frame the last ``send`` took, merged with ``prev`` (an earlier
        mark from this link, or None): :meth:`released` tells whether the payloads of all
        those frames have left the caller's memory, which an operation waits for before it
        ends, instead of for the whole link to drain (other operations' bulk frames queued
        on it, docs/benchmarks.md, *Head-of-line blocking*). None: they have already.

        The default, for links that cannot tell one frame from another: until
        ``write_buffer_size()`` is 0 (:data:`DRAIN`), unless it was 0 just after the send.
        """
        if prev is None and not self.write_buffer_size():
            return None
        return DRAIN

    def released(self, mark: SendMark) -> bool:
        """Whether the frames of ``mark`` (from :meth:`sent_mark`) have left user memory."""
        return mark is None or not self.write_buffer_size()

    async def wait_released(self, mark: SendMark) -> None:
        """Return once :meth:`released` holds for ``mark``.

        Raises:
            the link's failure if it breaks first.
        """
        if not self.released(mark):
            await self.drained()

    @abc.abstractmethod
    def close(self) -> None:
        """Flush what is queued, then close."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Close now, dropping what is queued."""

    async def wait_closed(self) -> None:
        """Return once the connection is gone after ``close()`` or ``abort()`` (the
        default: one loop pass, for links whose closing is done by then)."""
        await asyncio.sleep(0)

    def unanswered(self) -> float | None:
        """Seconds since the peer's host last acknowledged anything, where something
        sent on this link waits for that now (0.0 where nothing waits); None where the
        link cannot tell (links within this host, links that ended). The engine reads it
        while an operation waits, to find a host that vanished (docs/failures.md)."""
        return None

    def describe(self) -> str:
        return f"rank {self.peer}"
