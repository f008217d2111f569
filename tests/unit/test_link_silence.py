"""A host that stops acknowledging: the setting (``AIOCOLLECT_LINK_SILENCE``), the kernel's
keep-alives on a link to another host, what ``TCP_INFO`` says of a healthy connection,
and the engine's rule (engine/liveness.py: silent on two looks in a row, no
acknowledgement in between). The namespace tests (tests/hosts/test_lost_host.py) cut a
real host off."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from typing import Any, cast

import pytest

from aiocollect.engine.fabric import Fabric
from aiocollect.errors import PeerDisconnected
from aiocollect.transport import sockets
from aiocollect.transport.base import Link

pytestmark = [pytest.mark.timeout(10)]


@pytest.mark.parametrize(
    ("raw", "want", "warns"),
    [("", 3.0, False), ("0", 0.0, False), ("10", 10.0, False), ("2.5", 2.5, False),
     ("0.5", 2.0, True), ("-1", 3.0, True), ("soon", 3.0, True), ("inf", 3.0, True)],
)  # fmt: skip
def test_the_setting(raw: str, want: float, warns: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "aiocollect.transport.tcp")
    sockets._WARNED.clear()
    assert sockets.link_silence({sockets.LINK_SILENCE_ENV: raw}) == want
    assert bool(caplog.records) == warns, caplog.records


@pytest.fixture
def connected() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    with a, b:
        yield a, b


@pytest.mark.parametrize(
    ("silence", "idle", "count"), [(3.0, 2, 2), (10.0, 5, 6), (2.0, 1, 2), (600.0, 474, 127)]
)
def test_keep_alives_end_about_a_second_after_the_silence(
    connected: tuple[socket.socket, socket.socket], silence: float, idle: int, count: int
) -> None:
    """The kernel resets the connection idle + count x 1 s after the last packet."""
    a, _ = connected
    assert sockets.keep_alive(a, silence)
    assert a.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == idle
    assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
    assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == count
    assert idle + count == silence + 1


def test_off_sets_nothing_and_a_healthy_link_is_not_silent(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    a, b = connected
    assert not sockets.keep_alive(a, 0.0)
    assert a.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
    a.sendall(b"x" * 1000)
    assert b.recv(1000)
    assert sockets.unanswered(a) == 0.0  # nothing waits for an acknowledgement
    a.close()
    assert sockets.unanswered(a) == 0.0  # (a closed socket says nothing)


class _Quiet:
    """A link to another host whose silence the test sets."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.quiet: float | None = 0.0
        self.closed = False
        self.failed: list[BaseException] = []

    def unanswered(self) -> float | None:
        return self.quiet

    def describe(self) -> str:
        return f"rank {self.peer} (10.0.0.{self.peer}:1234)"

    def fail(self, exc: BaseException, drop_early: bool = True) -> None:
        self.failed.append(exc)

    def send(self, header: bytes, payload: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _fabric(links: list[_Quiet]) -> Fabric:
    fabric = Fabric(rank=0, world_size=5, max_frame=64)
    fabric.hosts = [0, 1, 1, 2, 3]
    fabric.links.update({q.peer: cast(Link, q) for q in links})
    fabric.liveness.silence = 3.0
    return fabric


def test_a_link_silent_on_two_looks_breaks_the_group_naming_its_host() -> None:
    one, two, three = _Quiet(1), _Quiet(2), _Quiet(3)
    fabric = _fabric([one, two, three])
    look = fabric.liveness.look
    one.quiet = 3.2
    look(100.0)  # silent once: could be a live host's probe answer on its way
    look(100.2)  # (too soon after the last look: not a look)
    assert fabric.failure is None
    one.quiet = 0.3
    look(100.5)  # it answered in between
    one.quiet = 3.6
    look(101.0)
    assert fabric.failure is None
    one.quiet, three.quiet, two.quiet = 4.1, 3.0, None
    look(101.5)  # no answer since the last look: unreachable
    exc = fabric.failure
    assert isinstance(exc, PeerDisconnected), exc
    assert exc.rank == 1
    assert str(exc).startswith("rank 1 (10.0.0.1:1234) unreachable: its host acknowledged")
    assert "ranks on that host: [1, 2]" in str(exc)
    assert one.failed == [exc]
    assert three.failed == [exc]


def test_several_silent_hosts_are_named_and_off_means_off() -> None:
    one, three = _Quiet(1), _Quiet(3)
    fabric = _fabric([one, three])
    one.quiet = three.quiet = 5.0
    fabric.liveness.look(10.0)
    one.quiet = three.quiet = 5.5
    fabric.liveness.look(10.5)
    assert "the hosts of ranks [3] went silent too" in str(fabric.failure)

    quiet = _Quiet(1)
    off = _fabric([quiet])
    off.liveness.silence = 0.0
    quiet.quiet = 50.0
    off.liveness.look(10.0)
    quiet.quiet = 51.0
    off.liveness.look(11.0)
    assert off.failure is None
