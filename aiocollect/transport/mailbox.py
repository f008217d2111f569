"""The tag mailbox of a link (:class:`Mailbox`, the base of
:class:`~aiocollect.transport.base.Link`): posted receives matched to arriving frames by
key, and frames that arrive before their receive is posted staged until it is (the
receive-side contract a transport keeps to is in :mod:`aiocollect.transport.base`)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiocollect.errors import MismatchError, ProtocolError
from aiocollect.transport.staging import POOL
from aiocollect.transport.wire import CONTROL, Header, Key
from aiocollect.types import dtype_label

if TYPE_CHECKING:
    from aiocollect.transport.base import Aside, Fingerprint, LinkEvents, Receiver

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


class Mailbox:
    """The receiving half of :class:`~aiocollect.transport.base.Link` (its only base):
    ``post_recv``/``post`` on the user's side, ``_begin_frame``/``_end_frame`` and the
    other transport hooks (``base.TRANSPORT_HOOKS``) on the transport's, ``fail``. It
    reads the link's ``events``, ``peer`` and counters, and reports errors through the
    link's ``_raise_error``."""

    events: LinkEvents
    peer: int
    frames_received: int
    bytes_received: int

    if TYPE_CHECKING:

        def describe(self) -> str: ...

        def _raise_error(self, exc: BaseException) -> None: ...

    def __init__(self) -> None:
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
            self.events.on_header(self, h)  # type: ignore[arg-type]  # (self: a Link)
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
                "aiocollect.transport.mailbox)"
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
            self.events.on_control(self, h.kind, bytes(staging or b""))  # type: ignore[arg-type]
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
            if self._failure is not None:  # failed meanwhile, the current frame set aside
                self._fail_current(self._failure)
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
            self._end_frame()  # (an ABORT, a refused frame: may fail the link)
        finally:
            self._frame, self._frame_recv, self._frame_staging = saved
            if self._failure is not None:  # failed meanwhile, the current frame set aside
                self._fail_current(self._failure)

    def _fail_current(self, exc: BaseException) -> None:
        """Fail the receive of the current frame, if any, with ``exc``: the link failed
        while a frame beside it began or ended (:meth:`_begin_aside`, :meth:`_end_aside`:
        an ABORT on a TCP link's lane, a refused frame), so :meth:`fail` did not see it."""
        recv, self._frame_recv = self._frame_recv, None
        if recv is not None:
            try:
                recv.failed(exc)
            except Exception:
                log.exception("receive failure handler failed")

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

    def _staging_full(self) -> None:
        """Frames nobody has posted a receive for exceed ``STAGING_LIMIT``: a transport
        that can should stop reading until receives consume them (backpressure)."""

    def _staging_relieved(self) -> None:
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
