"""The receive hook of Link.post_recv: called synchronously as a posted frame lands, never
for a staged frame or a failure, and a failing hook does not break the link's reading.

The link under test is the real mailbox (aiocollect.transport.base.Link); the transport
half is a minimal in-test subclass that feeds whole frames the way every transport does
(``_begin_frame``, copy, ``_end_frame``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiocollect.errors import PeerDisconnected
from aiocollect.transport.base import Link
from aiocollect.transport.wire import DATA, Header


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


def _key(slot: int) -> tuple[int, int, int, int, int]:
    return (DATA, 0, 0, slot, 0)


@pytest.mark.timeout(10)
async def test_hook_runs_synchronously_when_the_frame_lands() -> None:
    link = _FedLink(_Events(), 1 << 20)
    seen: list[Any] = []
    buf = bytearray(4)
    fut = link.post_recv(
        _key(1), memoryview(buf), hook=lambda f: seen.append((f.done(), bytes(buf)))
    )
    assert seen == []
    link.feed(1, b"abcd")
    assert seen == [(True, b"abcd")]  # before any loop pass, result already set
    assert fut.done()
    assert fut.result() is None


@pytest.mark.timeout(10)
async def test_hook_not_called_for_staged_frames_or_failures() -> None:
    link = _FedLink(_Events(), 1 << 20)
    calls: list[int] = []
    link.feed(2, b"early")  # no receive yet: staged
    fut = link.post_recv(_key(2), memoryview(bytearray(5)), hook=lambda f: calls.append(2))
    assert fut.done()
    assert calls == []
    failing = link.post_recv(_key(3), memoryview(bytearray(1)), hook=lambda f: calls.append(3))
    link.fail(PeerDisconnected("gone", 1))
    assert calls == []
    with pytest.raises(PeerDisconnected):
        await failing


@pytest.mark.timeout(10)
async def test_a_failing_hook_is_logged_and_reading_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    link = _FedLink(_Events(), 1 << 20)

    def bad(_: asyncio.Future[None]) -> None:
        raise RuntimeError("bug above the link")

    first = link.post_recv(_key(4), memoryview(bytearray(1)), hook=bad)
    second = link.post_recv(_key(5), memoryview(bytearray(1)))
    link.feed(4, b"x")
    link.feed(5, b"y")
    assert first.done()
    assert second.done()
    assert "receive hook failed" in caplog.text
