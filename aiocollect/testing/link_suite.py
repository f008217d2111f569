"""Conformance checks every :class:`~aiocollect.transport.base.Link` must pass.

A transport is checked by one call: ``await check_link(make_pair)``, where ``make_pair``
is a :data:`PairFactory`: given the events object of each end and the largest frame, it
opens (as an async context manager) two links connected to each other, and on exit closes
them and waits until their connections are gone. Each check gets a fresh pair.
:func:`transport_pair` makes the pair factory of any registered
:class:`~aiocollect.transport.interface.Transport` (through its listeners, as rendezvous
does), so every transport of :mod:`aiocollect.transport.registry` is checked the same way;
:func:`memory_pair`, :func:`tcp_pair` (also TLS) and :func:`shm_pair` are the built-in
ones. :data:`LINK_CHECKS` lists the checks one by one for a test that parametrizes over
them.

What is checked is the contract of docs/design.md ("The Link contract"): frames of one
stream arrive in order and land in their posted receive; frames that arrive before their
receive is posted are staged, up to ``early_limit`` (then ProtocolError), and a receive
posted while its frame is half received still gets it; zero-length frames work for data
and control; the merged ``sent_mark`` of frames the peer has received is released;
``send`` after ``close`` raises an aiocollect error; ``drained()`` ends (or raises
PeerDisconnected) once the peer is gone; ``fail()`` fails posted and later receives;
``close()`` delivers a queued ABORT before the connection ends, ``abort()`` ends it at once.

Links that declare one-sided reads are checked for them by
:mod:`aiocollect.testing.onesided_suite`, with the same pair factories.

Each check raises AssertionError (with what went wrong) on a violation; every wait is
bounded by :data:`WAIT` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TypeVar

from aiocollect.errors import AiocollectError, PeerDisconnected, ProtocolError
from aiocollect.rendezvous.handshake import AcceptorHandshake, ConnectorHandshake
from aiocollect.tls import TLSConfig
from aiocollect.transport import host, memory, shm_transport, tcp_listener
from aiocollect.transport.base import Fingerprint, Handshaker, Link, LinkEvents, SendMark
from aiocollect.transport.interface import LinkSetup, Listener, Transport
from aiocollect.transport.wire import ABORT, DATA, P2P, PING, Header, Key, pack_header

#: Seconds any one wait of a check may take before the check fails.
WAIT = 20.0
#: The largest frame the pairs of these checks are made for.
MAX_FRAME = 64 << 20

PairFactory = Callable[
    [LinkEvents, LinkEvents, int], AbstractAsyncContextManager[tuple[Link, Link]]
]
T = TypeVar("T")


class Recorder:
    """The events of one end, recorded; stands in for the engine's Fabric. Like the
    Fabric, it fails and closes a link that reports an error."""

    def __init__(self) -> None:
        self.headers: list[Key] = []
        self.controls: list[tuple[int, bytes]] = []
        self.errors: list[BaseException] = []
        self.lost = asyncio.Event()
        self.changed = asyncio.Event()
        self.on_header_hook: Callable[[Header], None] | None = None

    def on_header(self, link: Link, header: Header) -> None:
        self.headers.append(header.key)
        self._changed()
        if self.on_header_hook is not None:
            self.on_header_hook(header)

    def on_control(self, link: Link, kind: int, payload: bytes) -> None:
        self.controls.append((kind, payload))
        self._changed()

    def on_error(self, link: Link, exc: BaseException) -> None:
        self.errors.append(exc)
        link.fail(exc)
        link.close()
        self._changed()

    def on_lost(self, link: Link, exc: BaseException | None) -> None:
        link.fail(PeerDisconnected(f"link to rank {link.peer} lost", link.peer))
        self.lost.set()
        self._changed()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def until(self, what: str, condition: Callable[[], bool]) -> None:
        """Wait (bounded) until ``condition()`` holds; it is re-checked at every event."""

        async def wait() -> None:
            while not condition():
                await self.changed.wait()

        await within(what, wait())


async def within(what: str, aw: Awaitable[T]) -> T:
    """``await aw``, failing the check if it takes longer than WAIT seconds."""
    try:
        async with asyncio.timeout(WAIT):
            return await aw
    except TimeoutError:
        raise AssertionError(f"timed out after {WAIT} s waiting for {what}") from None


def frame(kind: int, slot: int, payload: bytes, chunk: int = 0) -> tuple[Key, bytes]:
    """The key and packed header of a frame of group 0, op 0 carrying ``payload``."""
    h = Header(kind, 1, 0, 1, 0, chunk, 0, slot, -1, len(payload), len(payload))
    return h.key, pack_header(h)


def payload(n: int, salt: int) -> bytes:
    """``n`` bytes that differ from those of another ``salt``."""
    base = bytes((i * 7 + salt) & 0xFF for i in range(251))
    return (base * (n // 251 + 1))[:n]


async def _received(fut: asyncio.Future[None], buf: bytearray, want: bytes, what: str) -> None:
    await within(what, fut)
    assert bytes(buf) == want, f"{what}: the payload landed corrupted"


# -- the checks --------------------------------------------------------------------------


async def check_frames_in_order(make_pair: PairFactory) -> None:
    """Frames of a stream (same kind, group, seq and slot) arrive in chunk order, posted or
    not, whatever their sizes; each lands whole in its receive."""
    ra, rb = Recorder(), Recorder()
    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        sizes = [1, 300, 70_000, 3 << 20, 5, 1 << 20, 0, 64 << 10]
        frames = [
            (slot, chunk, payload(n, slot * 16 + chunk))
            for slot in (1, 2)
            for chunk, n in enumerate(sizes)
        ]
        pending = []
        for i, (slot, chunk, data) in enumerate(frames):
            if i % 2 == 0:  # half posted before, half after the frames are sent
                key, _ = frame(DATA, slot, data, chunk)
                buf = bytearray(len(data))
                pending.append((b.post_recv(key, memoryview(buf)), buf, data))
        for slot, chunk, data in frames:
            a.send(frame(DATA, slot, data, chunk)[1], data)
        for i, (slot, chunk, data) in enumerate(frames):
            if i % 2 == 1:
                key, _ = frame(DATA, slot, data, chunk)
                buf = bytearray(len(data))
                pending.append((b.post_recv(key, memoryview(buf)), buf, data))
        for fut, buf, data in pending:
            await _received(fut, buf, data, f"a frame of {len(data)} bytes")
        await within("the sender to drain", a.drained())
        for slot in (1, 2):
            chunks = [k[4] for k in rb.headers if k[3] == slot]
            assert chunks == sorted(chunks) == list(range(len(sizes))), (
                f"stream {slot} arrived out of order: chunks {chunks}"
            )
        assert b.early_bytes == 0, "staged frames were not released once received"


async def check_sent_marks(make_pair: PairFactory) -> None:
    """``sent_mark`` after each send, merged over small and large frames (by reference
    where the link pulls): once the peer has every frame, ``wait_released`` of the merged
    mark returns and ``released`` holds; a frame's own mark may be released sooner."""
    ra, rb = Recorder(), Recorder()
    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        mark: SendMark = None
        pending = []
        for i, n in enumerate((1000, 4 << 20, 10, 1 << 20)):
            data = payload(n, i)
            key, hdr = frame(P2P, 40 + i, data)
            buf = bytearray(n)
            pending.append((b.post_recv(key, memoryview(buf)), buf, data))
            a.send(hdr, data)
            mark = a.sent_mark(mark)
        for fut, buf, data in pending:
            await _received(fut, buf, data, f"a frame of {len(data)} bytes")
        await within("the sent frames' mark to be released", a.wait_released(mark))
        assert a.released(mark), f"mark {mark} not released after wait_released()"


async def check_early_frames(make_pair: PairFactory) -> None:
    """A frame that arrived before its receive is staged: posting then completes at once
    (the future is done on return) with its bytes, and the staging is released."""
    ra, rb = Recorder(), Recorder()
    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        data = payload(1000, 3)
        key, hdr = frame(P2P, 7, data)
        fence = payload(10, 4)
        fence_key, fence_hdr = frame(P2P, 7, fence, chunk=1)  # same stream: arrives after
        fence_buf = bytearray(len(fence))
        fence_fut = b.post_recv(fence_key, memoryview(fence_buf))
        a.send(hdr, data)
        a.send(fence_hdr, fence)
        await _received(fence_fut, fence_buf, fence, "the frame behind the early one")
        assert b.has_frame(key), "the early frame is not reported by has_frame"
        assert b.early_bytes == len(data), f"{b.early_bytes} bytes staged, want {len(data)}"
        buf = bytearray(len(data))
        fut = b.post_recv(key, memoryview(buf))
        assert fut.done(), "a staged frame must complete its receive during posting"
        await _received(fut, buf, data, "the staged frame")
        assert b.early_bytes == 0
        assert not b.has_frame(key)


async def check_staging_limit(make_pair: PairFactory) -> None:
    """More early frames than ``early_limit`` allows, or the same frame twice, break the
    link with ProtocolError; the peer then sees the connection end."""
    for duplicate in (False, True):
        await _overflow(make_pair, duplicate)


async def _overflow(make_pair: PairFactory, duplicate: bool) -> None:
    ra, rb = Recorder(), Recorder()
    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        b.early_limit = 48 * 1024
        data = payload(20_000, 5)
        for i in range(3):
            a.send(frame(DATA, 0 if duplicate else i, data)[1], data)
        await rb.until("the staging limit to break the link", lambda: bool(rb.errors))
        err = rb.errors[0]
        assert isinstance(err, ProtocolError), f"{err!r} is not a ProtocolError"
        assert ("twice" if duplicate else "MAX_EARLY_BYTES") in str(err), str(err)
        late = b.post_recv(frame(DATA, 9, b"x")[0], memoryview(bytearray(1)))
        await within("a receive on the broken link to fail", asyncio.wait([late]))
        assert isinstance(late.exception(), ProtocolError)
        await within("the peer to see the broken link close", ra.lost.wait())


async def check_post_while_arriving(make_pair: PairFactory) -> None:
    """A receive posted after a large frame's header arrived (its payload still on the
    way, on transports that deliver in pieces) gets the whole frame."""
    ra, rb = Recorder(), Recorder()
    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        data = payload(24 << 20, 6)
        key, hdr = frame(DATA, 3, data)
        buf = bytearray(len(data))
        loop = asyncio.get_running_loop()
        posted: asyncio.Future[asyncio.Future[None]] = loop.create_future()

        def post_soon(h: Header) -> None:
            if h.key == key:  # one loop pass later: mid-payload where it comes in pieces
                loop.call_soon(lambda: posted.set_result(b.post_recv(key, memoryview(buf))))

        rb.on_header_hook = post_soon
        a.send(hdr, data)
        fut = await within("the receive to be posted", posted)
        await _received(fut, buf, data, "the frame posted while arriving")
        await within("the sender to drain", a.drained())


async def check_zero_length(make_pair: PairFactory) -> None:
    """Zero-length data frames land in empty receives, posted or staged; a zero-length
    control frame reaches ``on_control`` with empty bytes."""
    ra, rb = Recorder(), Recorder()
    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        posted_key, posted_hdr = frame(DATA, 1, b"")
        fut = b.post_recv(posted_key, memoryview(bytearray(0)))
        a.send(posted_hdr, b"")
        early_key, early_hdr = frame(DATA, 1, b"", chunk=1)
        a.send(early_hdr, b"")
        a.send(pack_header(Header(PING, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0)), b"")
        await within("a posted zero-length frame", fut)
        await rb.until("the zero-length PING", lambda: bool(rb.controls))
        assert rb.controls == [(PING, b"")], rb.controls
        late = b.post_recv(early_key, memoryview(bytearray(0)))
        await within("a staged zero-length frame", late)


async def check_send_after_close(make_pair: PairFactory) -> None:
    """``send`` on a closed link, or on one whose peer is gone, raises an aiocollect
    error (PeerDisconnected), never a transport's own exception."""
    ra, rb = Recorder(), Recorder()
    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        a.close()
        _, hdr = frame(DATA, 1, b"abc")
        try:
            a.send(hdr, b"abc")
        except AiocollectError:
            pass
        else:
            raise AssertionError("send on a closed link did not raise")
        await within("the peer to see the close", rb.lost.wait())
        try:
            b.send(hdr, b"abc")
        except AiocollectError:
            pass
        else:
            raise AssertionError("send to a peer that closed did not raise")


async def check_drained_after_loss(make_pair: PairFactory) -> None:
    """``drained()`` with bytes queued ends once the peer is gone: it returns or raises
    PeerDisconnected, and never hangs."""
    ra, rb = Recorder(), Recorder()
    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        data = payload(32 << 20, 8)
        a.send(frame(DATA, 1, data)[1], data)
        b.abort()
        await within("the sender to see the loss", ra.lost.wait())
        with contextlib.suppress(PeerDisconnected):
            await within("drained() after the peer was lost", a.drained())


async def _staged(a: Link, b: Link, slot: int, data: bytes, what: str) -> Key:
    """Send ``data`` from ``a`` as frame (slot, chunk 0), unposted at ``b``, and a fence
    after it; return the frame's key once the fence arrived (the frame is staged)."""
    key, hdr = frame(DATA, slot, data)
    fence_key, fence_hdr = frame(DATA, slot, b"", chunk=1)
    fence = b.post_recv(fence_key, memoryview(bytearray(0)))
    a.send(hdr, data)
    a.send(fence_hdr, b"")
    await within(what, fence)
    return key


async def check_fail(make_pair: PairFactory) -> None:
    """``fail(exc)`` fails every posted receive and every one posted later with ``exc``;
    a frame staged before it stays receivable with ``drop_early=False``."""
    ra, rb = Recorder(), Recorder()
    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        data = payload(100, 9)
        staged_key = await _staged(a, b, 1, data, "the frames before fail()")
        posted = [b.post_recv(frame(DATA, s, b"xy")[0], memoryview(bytearray(2))) for s in (5, 6)]
        exc = PeerDisconnected("failed by the check", 0)
        b.fail(exc, drop_early=False)
        for fut in posted:
            assert fut.done(), "fail() left a receive posted"
            assert fut.exception() is exc, "fail() left a receive posted"
        later = b.post_recv(frame(DATA, 7, b"z")[0], memoryview(bytearray(1)))
        assert later.done(), "a receive posted after fail()"
        assert later.exception() is exc, "a receive posted after fail()"
        buf = bytearray(len(data))
        await _received(
            b.post_recv(staged_key, memoryview(buf)),
            buf,
            data,
            "a frame staged before fail(drop_early=False)",
        )


async def check_receivers(make_pair: PairFactory) -> None:
    """Receivers posted with ``post`` (the one-frame operations' form): a frame that
    arrives after the post lands in the receiver's view and its ``landed()`` is called
    once, with the payload already in place, small and large alike; a frame staged before
    the post is copied by ``post`` itself (True, no call); ``fail()`` calls ``failed``."""
    ra, rb = Recorder(), Recorder()
    loop = asyncio.get_running_loop()

    class _Receiver:
        def __init__(self, size: int) -> None:
            self.buf = bytearray(size)
            self.view = memoryview(self.buf)
            self.expect: Fingerprint | None = None
            self.calls: list[object] = []
            self.done: asyncio.Future[None] = loop.create_future()

        def landed(self) -> None:
            self.calls.append(bytes(self.buf))
            if not self.done.done():
                self.done.set_result(None)

        def failed(self, exc: BaseException) -> None:
            self.calls.append(exc)
            if not self.done.done():
                self.done.set_result(None)

    async with make_pair(ra, rb, MAX_FRAME) as (a, b):
        for slot, n in ((1, 4), (2, 3 << 20)):
            data = payload(n, slot)
            key, hdr = frame(DATA, slot, data)
            recv = _Receiver(n)
            assert b.post(key, recv) is False, "post() said a frame not sent yet had arrived"
            a.send(hdr, data)
            await within(f"a posted receiver of {n} bytes to land", recv.done)
            assert len(recv.calls) == 1, f"landed()/failed() called {len(recv.calls)} times"
            assert recv.calls[0] == data, f"the {n}-byte payload was not in place at landed()"
        data = payload(100, 3)
        key = await _staged(a, b, 3, data, "the frame to be staged")
        staged = _Receiver(len(data))
        assert b.post(key, staged) is True, "post() did not take the staged frame"
        assert bytes(staged.buf) == data, "post() did not copy the staged frame"
        assert staged.calls == [], "post() called the receiver of a staged frame"
        waiting = _Receiver(1)
        b.post(frame(DATA, 4, b"z")[0], waiting)
        exc = PeerDisconnected("failed by the check", 0)
        b.fail(exc)
        assert waiting.calls == [exc], f"fail() called the receiver with {waiting.calls}"


async def check_close_flushes_abort(make_pair: PairFactory) -> None:
    """``close()`` delivers what is queued, an ABORT behind a large frame included, before
    the peer sees the connection end; ``abort()`` ends the connection at once (what is
    queued may be lost) and the peer sees it end."""
    for how in ("close", "abort"):
        ra, rb = Recorder(), Recorder()
        async with make_pair(ra, rb, MAX_FRAME) as (a, b):
            bulk = payload(8 << 20, 10)
            key, hdr = frame(DATA, 1, bulk)
            buf = bytearray(len(bulk))
            fut = b.post_recv(key, memoryview(buf))
            a.send(hdr, bulk)
            reason = b"rank 0 failed: the check"
            a.send(pack_header(Header(ABORT, 0, 0, 0, 0, 0, 0, 0, -1, 0, len(reason))), reason)
            a.close() if how == "close" else a.abort()
            assert a.closed
            await within(f"the peer to see the link end after {how}()", rb.lost.wait())
            if how == "close":
                assert rb.controls == [(ABORT, reason)], (
                    f"the ABORT queued before close() did not arrive: {rb.controls}"
                )
                await _received(fut, buf, bulk, "the frame queued before close()")


LINK_CHECKS: tuple[Callable[[PairFactory], Awaitable[None]], ...] = (
    check_frames_in_order,
    check_sent_marks,
    check_early_frames,
    check_staging_limit,
    check_post_while_arriving,
    check_zero_length,
    check_send_after_close,
    check_drained_after_loss,
    check_fail,
    check_receivers,
    check_close_flushes_abort,
)


async def check_link(make_pair: PairFactory) -> None:
    """Run every check of :data:`LINK_CHECKS` on fresh pairs from ``make_pair`` (a link
    with one-sided reads: :func:`aiocollect.testing.onesided_suite.check_one_sided` too).

    Raises:
        AssertionError: the first check the transport fails, naming what went wrong.
    """
    for check in LINK_CHECKS:
        await check(make_pair)


# -- pairs of the built-in transports ----------------------------------------------------


def _handshakers() -> tuple[Handshaker, Handshaker]:
    """Connector (rank 0) and acceptor (rank 1) of a two-rank group without a secret."""
    return (
        ConnectorHandshake("link-suite", 0, 1, 2, None),
        AcceptorHandshake("link-suite", 1, 2, None, lambda peer: None),
    )


def transport_pair(
    transport: Transport,
    tls: tuple[TLSConfig, TLSConfig] | None = None,
    expect_pulls: bool | None = None,
) -> PairFactory:
    """A factory of two links made by ``transport`` exactly as rendezvous makes them: two
    listeners (ranks 0 and 1, each with its record, both prepared with both records) and
    rank 0 connecting to rank 1. ``tls``: each rank's contexts, for a transport that needs
    them. With ``expect_pulls``, the pair must (or must not) pull large payloads out of
    the sender's memory (:attr:`~aiocollect.transport.base.LinkCaps.pull_min`)."""

    @asynccontextmanager
    async def pair(
        ea: LinkEvents, eb: LinkEvents, max_frame: int
    ) -> AsyncIterator[tuple[Link, Link]]:
        hs_a, hs_b = _handshakers()
        accepted: asyncio.Future[Link] = asyncio.get_running_loop().create_future()
        listeners: list[Listener] = []
        links: list[Link] = []
        try:
            for rank, events, acceptor in ((0, ea, None), (1, eb, hs_b)):
                setup = LinkSetup(
                    rank=rank,
                    events=events,
                    max_frame=max_frame,
                    host="127.0.0.1",
                    acceptor=_only(acceptor),
                    on_link=accepted.set_result,
                    tls=None if tls is None else tls[rank],
                )
                listeners.append(await transport.listen(setup))
            records = {
                r: {**lst.record, **host.identity(), "rank": r} for r, lst in enumerate(listeners)
            }
            for listener in listeners:
                listener.prepare(records)
            links.append(await within("the connection", listeners[0].connect(records[1], hs_a)))
            links.append(await within("the accepted link", accepted))
            if expect_pulls is not None and links[0].caps.pulls(1 << 24) != expect_pulls:
                raise AssertionError(
                    f"the {transport.name} pair "
                    f"{'does not pull' if expect_pulls else 'pulls'} "
                    "large frames"
                )
            yield links[0], links[1]
        finally:
            for listener in listeners:
                listener.close()
            for link in links:
                link.abort()
            await within(
                "both connections to end", asyncio.gather(*(link.wait_closed() for link in links))
            )

    return pair


def _only(handshaker: Handshaker | None) -> Callable[[], Handshaker]:
    """An acceptor factory handing out ``handshaker`` (the pair accepts one link)."""

    def acceptor() -> Handshaker:
        if handshaker is None:
            raise AssertionError("the connecting rank accepted a connection")
        return handshaker

    return acceptor


#: Two in-process links (:mod:`aiocollect.transport.memory`).
memory_pair = transport_pair(memory.MEMORY)


def tcp_pair(
    server_ssl: ssl.SSLContext | None = None, client_ssl: ssl.SSLContext | None = None
) -> PairFactory:
    """A factory of two links over one loopback TCP connection, TLS when given the
    ``ssl.SSLContext`` of each side (:mod:`aiocollect.transport.tcp`)."""
    if server_ssl is None or client_ssl is None:
        return transport_pair(tcp_listener.TCP)
    return transport_pair(
        tcp_listener.TLS, (TLSConfig(client_ssl, client_ssl), TLSConfig(server_ssl, server_ssl))
    )


def shm_pair(expect_pulls: bool | None = None) -> PairFactory:
    """A factory of two shared-memory links (:mod:`aiocollect.transport.shm`), required to
    be in shared memory. With ``expect_pulls``, the pair must (or must not) pull large
    payloads out of the sender's memory (AIOCOLLECT_SHM_PULL decides)."""
    return transport_pair(shm_transport.SHM, expect_pulls=expect_pulls)


__all__ = [
    "LINK_CHECKS",
    "MAX_FRAME",
    "WAIT",
    "PairFactory",
    "Recorder",
    "check_link",
    "memory_pair",
    "shm_pair",
    "tcp_pair",
    "transport_pair",
]
