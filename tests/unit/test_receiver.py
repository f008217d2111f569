"""Receivers posted with Link.post (what one-frame operations are, engine/small.py):
``landed()`` called synchronously as the frame lands, a staged frame copied at post time
instead (no call), ``failed(exc)`` when the link fails, even when it fails while a frame
beside the current one begins or ends (an ABORT on a TCP link's lane while a bulk frame
is arriving on its own connection), a mismatching staged frame refused, and a receiver
that raises does not break the link's reading.

The link under test is the real mailbox (aiocollect.transport.base.Link); the transport
half is a minimal in-test subclass that feeds whole frames the way every transport does
(``_begin_frame``, copy, ``_end_frame``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiocollect.errors import MismatchError, PeerDisconnected
from aiocollect.transport.base import Link
from aiocollect.transport.wire import ABORT, DATA, Header, Key


class _Events:
    def on_header(self, link: Link, header: Header) -> None:
        pass

    def on_control(self, link: Link, kind: int, payload: bytes) -> None:
        pass

    def on_error(self, link: Link, exc: BaseException) -> None:
        raise AssertionError(f"unexpected link error {exc!r}")

    def on_lost(self, link: Link, exc: BaseException | None) -> None:
        pass


class _FedLink(Link):
    def feed(self, slot: int, payload: bytes) -> None:
        h = Header(DATA, 1, 0, 1, 0, 0, 0, slot, -1, len(payload), len(payload))
        dest = self._begin_frame(h)
        assert dest is not None
        dest[:] = payload
        self._end_frame()

    def send(self, header: bytes, payload: memoryview | bytes) -> None:
        raise NotImplementedError

    def write_buffer_size(self) -> int:
        return 0

    async def drained(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _key(slot: int) -> Key:
    return Key(DATA, 0, 0, slot, 0)


class _Receiver:
    def __init__(self, size: int, expect: Any = None) -> None:
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.expect = expect
        self.calls: list[Any] = []

    def landed(self) -> None:
        self.calls.append(("landed", bytes(self.buf)))

    def failed(self, exc: BaseException) -> None:
        self.calls.append(("failed", exc))


def _link() -> _FedLink:
    link = _FedLink(_Events(), 1 << 20)
    link.peer = 1
    return link


@pytest.mark.timeout(10)
async def test_landed_is_called_synchronously_when_the_frame_lands() -> None:
    link = _link()
    recv = _Receiver(3)
    assert link.post(_key(1), recv) is False
    assert link.is_posted(_key(1))
    link.feed(1, b"abc")
    assert recv.calls == [("landed", b"abc")]  # before feed returned: no loop pass
    assert not link.is_posted(_key(1))


@pytest.mark.timeout(10)
async def test_a_staged_frame_is_copied_at_post_time_without_a_call() -> None:
    link = _link()
    link.feed(2, b"hello")  # nobody posted: staged
    recv = _Receiver(5)
    assert link.post(_key(2), recv) is True
    assert bytes(recv.buf) == b"hello"
    assert recv.calls == []
    assert link.early_bytes == 0


@pytest.mark.timeout(10)
async def test_failure_calls_failed_and_a_failed_link_refuses_posts() -> None:
    link = _link()
    recv = _Receiver(1)
    link.post(_key(3), recv)
    err = PeerDisconnected("gone", 1)
    link.fail(err)
    assert recv.calls == [("failed", err)]
    with pytest.raises(PeerDisconnected):
        link.post(_key(4), _Receiver(1))


@pytest.mark.timeout(10)
async def test_a_staged_frame_of_another_size_is_refused() -> None:
    errors: list[BaseException] = []

    class _Recording(_Events):
        def on_error(self, link: Link, exc: BaseException) -> None:
            errors.append(exc)

    link = _FedLink(_Recording(), 1 << 20)
    link.peer = 1
    link.feed(5, b"four")
    with pytest.raises(MismatchError):
        link.post(_key(5), _Receiver(3))
    assert errors
    assert isinstance(errors[0], MismatchError)


@pytest.mark.timeout(10)
async def test_a_raising_receiver_is_logged_and_reading_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class _Bad(_Receiver):
        def landed(self) -> None:
            raise RuntimeError("bug above the link")

    link = _link()
    link.post(_key(6), _Bad(1))
    good = _Receiver(1)
    link.post(_key(7), good)
    link.feed(6, b"x")
    link.feed(7, b"y")
    assert good.calls == [("landed", b"y")]
    assert "receive completion failed" in caplog.text


@pytest.mark.timeout(10)
async def test_post_recv_futures_still_work() -> None:
    link = _link()
    fut = link.post_recv(_key(8), memoryview(bytearray(2)))
    link.feed(8, b"ok")
    assert fut.done()
    assert fut.result() is None
    staged_first = _link()
    staged_first.feed(9, b"z")
    assert staged_first.post_recv(_key(9), memoryview(bytearray(1))).done()
    await asyncio.sleep(0)


class _Failing(_Events):
    """The fabric's part: an ABORT or a reported error fails the link, synchronously."""

    def __init__(self) -> None:
        self.err = PeerDisconnected("rank 1 aborted the group", 1)

    def on_control(self, link: Link, kind: int, payload: bytes) -> None:
        assert kind == ABORT
        link.fail(self.err)

    def on_error(self, link: Link, exc: BaseException) -> None:
        link.fail(exc)


def _mid_frame(events: _Events) -> tuple[_FedLink, _Receiver]:
    """A link whose current frame (slot 1, 8 bytes, its receive posted) is half-arrived."""
    link = _FedLink(events, 1 << 20)
    link.peer = 1
    recv = _Receiver(8)
    link.post(_key(1), recv)
    dest = link._begin_frame(Header(DATA, 1, 0, 1, 0, 0, 0, 1, -1, 8, 8))
    assert dest is not None
    dest[:4] = b"half"
    return link, recv


@pytest.mark.timeout(10)
async def test_an_abort_beside_the_current_frame_fails_its_receive() -> None:
    events = _Failing()
    link, recv = _mid_frame(events)
    begun = link._begin_aside(Header(ABORT, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    assert begun is not None
    link._end_aside(begun[1])
    assert recv.calls == [("failed", events.err)]
    with pytest.raises(PeerDisconnected):
        link.post(_key(2), _Receiver(1))


@pytest.mark.timeout(10)
async def test_a_refused_frame_beside_the_current_one_fails_its_receive() -> None:
    link, recv = _mid_frame(_Failing())
    link.post(_key(3), _Receiver(2))
    assert link._begin_aside(Header(DATA, 1, 0, 1, 0, 0, 0, 3, -1, 5, 5)) is None  # 5 != 2
    assert [call for call, _ in recv.calls] == ["failed"]
    assert isinstance(recv.calls[0][1], MismatchError)
