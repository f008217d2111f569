"""Link: one connection to one peer, with a tag mailbox matching frames to posted receives.

Concrete transports (tcp, memory, shm, ...; made by a
:class:`~aiocollect.transport.interface.Transport`) feed incoming bytes through
:meth:`Link._begin_frame` and :meth:`Link._end_frame` and implement the sending half.
Everything above the transport talks to a link through ``post_recv``, ``send``,
``drained``, ``close`` and ``caps`` (:class:`LinkCaps`, the one thing algorithms may ask a
link about itself). :mod:`aiocollect.testing.link_suite` checks all of what follows.

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
  key, so frames of different keys may land in any order.
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
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from aiocollect.errors import InternalError, MismatchError, ProtocolError
from aiocollect.transport.staging import POOL
from aiocollect.transport.wire import CONTROL, Header, Key
from aiocollect.types import dtype_label

log = logging.getLogger("aiocollect.transport")

#: Most a link stages of frames that arrived before their receive was posted: payload bytes
#: plus ``STAGED_FRAME_COST`` per frame for its bookkeeping. A peer that sends more than
#: that ahead of this rank's receives (frames nobody will post, or a program far out of
#: step) is cut off with ProtocolError instead of exhausting memory. Read when a link is
#: created.
MAX_EARLY_BYTES = 1 << 30
#: What staging one frame costs besides its payload, measured (tests/failure/test_flood.py):
#: the link's key, header, buffer and dict entry (~520 bytes), and when the frame is the
#: first of an operation not called yet, the fabric's entry for it (~300 more), dict
#: growth included.
STAGED_FRAME_COST = 1024

#: Bytes of early frames (no receive posted yet) a link holds before it stops reading from
#: its peer; the peer's sends then wait in TCP flow control instead of growing our memory.
STAGING_LIMIT = 64 * 1024 * 1024


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


class _Recv:
    """The receiver behind :meth:`Link.post_recv`: a future."""

    __slots__ = ("expect", "fut", "view")

    def __init__(
        self, view: memoryview, fut: asyncio.Future[None], expect: Fingerprint | None
    ) -> None:
        self.view = view
        self.fut = fut
        self.expect = expect

    def landed(self) -> None:
        if not self.fut.done():
            self.fut.set_result(None)

    def failed(self, exc: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(exc)
            self.fut.exception()  # an op may fail on another future first


def land(recv: Receiver, src: memoryview | bytes | bytearray | None = None) -> None:
    """Complete ``recv`` (a receive a transport took with ``Link._take_posted``), copying
    ``src`` (its length) into it first when given: ``recv.landed()``, a bug in it logged
    rather than breaking the link's reading."""
    if src is not None and len(src):
        recv.view[:] = src
    try:
        recv.landed()
    except Exception:
        log.exception("receive completion failed")


#: A frame begun beside the current one (:meth:`Link._begin_aside`): its header, and the
#: receive or the staging buffer its payload goes to.
Aside = tuple[Header, Receiver | None, bytearray | None]

#: What :meth:`Link.sent_mark` returns: None (nothing to wait for), :data:`DRAIN`, or a
#: transport's own pair of positions (see :meth:`Link.sent_mark` of the transport).
SendMark = tuple[int, int] | None
#: The mark "until the link's user-space buffer drains" (every frame queued before).
DRAIN: SendMark = (-1, -1)


class Link(abc.ABC):
    """One peer connection. ``peer`` is the peer's world rank (-1 until the handshake ends)."""

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
        self._failure: BaseException | None = None
        self._posted: dict[Key, Receiver] = {}
        self._early: dict[Key, tuple[Header, bytearray]] = {}
        self._early_bytes = 0
        self._early_frames = 0
        self._staging_over = False  # _staging_full called, _staging_relieved not since
        self.early_limit = MAX_EARLY_BYTES
        self._frame: Header | None = None
        self._frame_recv: Receiver | None = None
        self._frame_staging: bytearray | None = None
        self._asides: list[Aside] = []  # frames begun beside the current one, not ended
        self._recv_loop: asyncio.AbstractEventLoop | None = None  # the loop receives run on

    # -- receiving -------------------------------------------------------------------------

    def post_recv(
        self, key: Key, view: memoryview, expect: Fingerprint | None = None
    ) -> asyncio.Future[None]:
        """Receive the frame with ``key`` into ``view`` (exact length). With ``expect``,
        the frame's fingerprint must equal it. The future fails with the link's failure if
        the link breaks first."""
        loop = self._recv_loop
        if loop is None:  # asyncio.get_running_loop() costs a getpid() call: once a link
            loop = self._recv_loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        try:
            if self._take_early(key, view, expect):
                fut.set_result(None)
                return fut
        except Exception as exc:
            fut.set_exception(exc)
            fut.exception()
            return fut
        self._posted[key] = _Recv(view, fut, expect)
        return fut

    def post(self, key: Key, recv: Receiver) -> bool:
        """Post ``recv`` for the frame with ``key``, without a future (the one-frame
        operations of engine/small.py are their own receivers). Returns True if the frame
        had arrived already: its payload is now in ``recv.view`` and the link will not call
        ``recv`` at all; False if it is posted: the link calls ``recv.landed()`` or
        ``recv.failed(exc)`` later, never from inside this call.

        Raises:
            the link's failure if it failed; MismatchError if the staged frame does not
            match ``recv`` (the link has reported it, which breaks the group).
        """
        if (self._early or self._failure is not None) and self._take_early(
            key, recv.view, recv.expect
        ):
            return True
        self._posted[key] = recv
        return False

    def _take_early(self, key: Key, view: memoryview, expect: Fingerprint | None) -> bool:
        """Copy the staged frame ``key`` into ``view`` if there is one (True), raising if
        it does not match or the link failed; False: nothing staged, post it."""
        if self._early:
            early = self._early.pop(key, None)
            if early is not None:  # arrived before the peer closed: still good
                h, data = early
                self._early_bytes -= len(data)
                self._early_frames -= 1
                if self._staging_over and self._early_bytes <= STAGING_LIMIT // 2:
                    self._staging_over = False
                    self._staging_relieved()
                if not self._check(h, len(view), expect):
                    raise self._failure or MismatchError(f"frame {key} rejected")
                view[:] = data
                POOL.give(data)  # copied out: nothing holds it now (staging.py)
                return True
        if self._failure is not None:
            raise self._failure
        return False

    def has_frame(self, key: Key) -> bool:
        """Whether a frame with ``key`` arrived (or is arriving) with no receive posted."""
        return (
            key in self._early
            or (
                self._frame is not None
                and self._frame_staging is not None
                and self._frame.key == key
            )
            or any(staging is not None and h.key == key for h, _, staging in self._asides)
        )

    def unpost(self, key: Key) -> None:
        """Withdraw a posted receive (used when an operation is abandoned)."""
        self._posted.pop(key, None)

    def _check(self, h: Header, want: int, expect: Fingerprint | None) -> bool:
        if expect is not None and h.fingerprint != expect:
            self._raise_error(
                MismatchError(
                    f"rank {self.peer} sent a message of {h.elems} x {dtype_label(h.dtype)} "
                    f"(tag {h.slot}) but this rank receives {expect[2]} x "
                    f"{dtype_label(expect[1])}"
                )
            )
            return False
        if h.length == want:
            return True
        self._raise_error(
            MismatchError(
                f"frame {h.key} from rank {self.peer} carries {h.length} bytes but this rank "
                f"expects {want}: the ranks passed buffers of different sizes"
            )
        )
        return False

    def _raise_error(self, exc: BaseException) -> None:
        self.events.on_error(self, exc)

    def _begin_frame(self, h: Header) -> memoryview | None:
        """Called by the transport once a header is parsed; returns where the payload goes,
        or None if the link must stop reading (the error has been reported)."""
        self._frame = h
        self.frames_received += 1
        if h.kind in CONTROL:
            self._frame_staging = bytearray(h.length)
            return memoryview(self._frame_staging)
        dest = self._route(h, h.key)
        if dest is None:
            return None
        if isinstance(dest, bytearray):  # (a kept buffer: the payload overwrites all of it)
            self._frame_staging = dest
            return memoryview(dest)
        self._frame_recv = dest
        return dest.view

    def _whole_frame(
        self, h: Header, payload: memoryview | bytes | bytearray, key: Key | None = None
    ) -> bool:
        """The DATA or P2P frame ``h`` (``key``: its key, if at hand) with its whole
        ``payload`` (``h.length`` bytes) at hand: what :meth:`_begin_frame`, the copy and
        :meth:`_end_frame` would do, in one step. False if the link must stop reading (the
        error has been reported)."""
        self.frames_received += 1
        if key is None:
            key = h.key
        dest = self._route(h, key)
        if dest is None:
            return False
        self.bytes_received += h.length
        if isinstance(dest, bytearray):
            dest[:] = payload
            self._stage(key, h, dest)
        else:
            land(dest, payload)
        return True

    def _route(self, h: Header, key: Key) -> Receiver | bytearray | None:
        """Where the payload of data frame ``h`` (``key``) goes: its posted receive (checked
        and taken out of the mailbox), a staging buffer of its length (staging.py), or
        None: refused, the error reported."""
        try:
            self.events.on_header(self, h)
        except Exception as exc:  # MismatchError, ProtocolError
            self._raise_error(exc)
            return None
        recv = self._posted.get(key)
        if recv is not None:
            if not self._check(h, len(recv.view), recv.expect):
                return None  # the receive stays posted and fails with the link
            del self._posted[key]
            return recv
        refusal = self._refuse_staging(h, key)
        if refusal is not None:
            self._raise_error(refusal)
            return None
        return POOL.take(h.length)

    def _refuse_staging(self, h: Header, key: Key) -> ProtocolError | None:
        """Why a frame (``h``, its ``key``) with no posted receive cannot be staged, if it
        cannot."""
        if key in self._early:  # a second copy would silently replace the first
            return ProtocolError(f"{self.describe()} sent frame {key} twice")
        frames = self._early_frames + 1
        cost = self._early_bytes + h.length + frames * STAGED_FRAME_COST
        if cost > self.early_limit:
            return ProtocolError(
                f"{self.describe()} sent more than this rank has receives for: "
                f"{frames} frames ({self._early_bytes + h.length} bytes) staged would "
                f"exceed the limit of {self.early_limit} bytes (MAX_EARLY_BYTES in "
                "aiocollect.transport.base)"
            )
        return None

    def _end_frame(self) -> None:
        """Called by the transport when the current frame's payload is complete."""
        h = self._frame
        assert h is not None
        self.bytes_received += h.length
        recv, staging = self._frame_recv, self._frame_staging
        self._frame = self._frame_recv = self._frame_staging = None
        if h.kind in CONTROL:
            self.events.on_control(self, h.kind, bytes(staging or b""))
            return
        if recv is not None:
            land(recv)
            return
        assert staging is not None
        key = h.key
        late = self._posted.get(key)  # posted while the payload was arriving
        if late is not None:
            if self._check(h, len(late.view), late.expect):
                del self._posted[key]
                late.view[:] = staging
                POOL.give(staging)  # the transport has finished writing it
                land(late)
            return
        self._stage(key, h, staging)

    def _stage(self, key: Key, h: Header, staging: bytearray) -> None:
        """Keep frame ``h`` (``key``, its payload in ``staging``) until its receive is
        posted."""
        self._early[key] = (h, staging)
        self._early_bytes += len(staging)
        self._early_frames += 1
        if self._early_bytes > STAGING_LIMIT:
            self._staging_over = True
            self._staging_full()

    def _take_posted(self, key: Key, length: int, fp: Fingerprint) -> Receiver | None:
        """A transport's one-step receive: the receive posted for frame ``key`` if the
        frame (``length`` payload bytes, fingerprint ``fp``) matches it exactly, taken out
        of the mailbox and the frame counted as received: the transport then copies the
        payload into its ``view`` and calls ``landed()``. None for anything else (nothing
        posted, another length or fingerprint): the transport then takes the general path
        (``_begin_frame``), which checks, routes or stages the frame and reports errors."""
        recv = self._posted.get(key)
        if recv is None or len(recv.view) != length or recv.expect != fp:
            return None
        del self._posted[key]
        self.frames_received += 1
        self.bytes_received += length
        return recv

    def _begin_aside(self, h: Header) -> tuple[memoryview, Aside] | None:
        """Begin frame ``h`` as :meth:`_begin_frame` does, but beside the current frame,
        which stays current: returns where the payload goes and the token to end it with
        (:meth:`_end_aside`), once all of it is in place. None: refused, as for
        ``_begin_frame`` (the error has been reported; no ``_end_aside``)."""
        saved = (self._frame, self._frame_recv, self._frame_staging)
        self._frame = self._frame_recv = self._frame_staging = None
        try:
            dest = self._begin_frame(h)
            token: Aside = (h, self._frame_recv, self._frame_staging)
        finally:
            self._frame, self._frame_recv, self._frame_staging = saved
        if dest is None:
            return None
        self._asides.append(token)
        return dest, token

    def _end_aside(self, token: Aside) -> None:
        """The payload of the frame begun by :meth:`_begin_aside` is complete (a frame the
        link was failed during is dropped: its receive failed with the link)."""
        for i, t in enumerate(self._asides):
            if t is token:
                del self._asides[i]
                break
        else:
            return
        saved = (self._frame, self._frame_recv, self._frame_staging)
        self._frame, self._frame_recv, self._frame_staging = token
        try:
            self._end_frame()
        finally:
            self._frame, self._frame_recv, self._frame_staging = saved

    def fail(self, exc: BaseException, drop_early: bool = True) -> None:
        """Fail every posted receive (and any posted later) with ``exc``. Frames that
        already arrived stay receivable unless ``drop_early``."""
        if self._failure is None:
            self._failure = exc
        posted, self._posted = self._posted, {}
        if self._frame_recv is not None:  # its payload was arriving: it never will now
            posted[("in-progress",)] = self._frame_recv  # type: ignore[index]
            self._frame_recv = None
        for i, (_, recv, _) in enumerate(self._asides):  # (likewise)
            if recv is not None:
                posted[("aside", i)] = recv  # type: ignore[index]
        self._asides = []
        for recv in posted.values():
            try:
                recv.failed(exc)
            except Exception:
                log.exception("receive failure handler failed")
        if drop_early:
            self._early.clear()
            self._early_bytes = 0
            self._early_frames = 0

    def _staging_full(self) -> None:  # noqa: B027 - optional hook
        """Frames nobody has posted a receive for exceed ``STAGING_LIMIT``: a transport
        that can should stop reading until receives consume them (backpressure)."""

    def _staging_relieved(self) -> None:  # noqa: B027 - optional hook
        """Staged frames fell below half the limit: reading may resume."""

    @property
    def early_bytes(self) -> int:
        return self._early_bytes

    @property
    def failure(self) -> BaseException | None:
        """What the link was failed with (:meth:`fail`), if it was."""
        return self._failure

    def is_posted(self, key: Key) -> bool:
        """Whether a receive for ``key`` is posted and waiting for its frame."""
        return key in self._posted

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

    def describe(self) -> str:
        return f"rank {self.peer}"
