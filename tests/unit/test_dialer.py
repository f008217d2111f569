"""The on-demand dialer (rendezvous/ondemand.py): a link that arrived between an
operation's look at its links and its dial is handed over, not connected again."""

from __future__ import annotations

from typing import Any, cast

import pytest

from aiocollect._deadline import Deadline
from aiocollect.rendezvous.ondemand import Dialer
from aiocollect.transport.base import Link

pytestmark = pytest.mark.timeout(10)


class _Arrived:
    """A link as the listener hands it over: only its peer is read, and nothing aborts it."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


async def test_a_link_that_arrived_before_the_dial_is_handed_over() -> None:
    """The peer's connection arrived (and was delivered) after the fabric listed the links
    it lacks but before its dial ran: the dial returns that link at once. (It used to
    connect, be refused as "already linked", and wait for a link that had already come:
    an operation hung until its deadline.) No listener is set, so a connect would fail."""
    delivered: list[Any] = []
    dialer = Dialer(0, 4, "g", None, b"job", delivered.append)
    link = _Arrived(3)
    dialer.on_link(cast(Link, link))
    assert delivered == [link]
    got = await dialer.dial(3, Deadline.after(1.0))
    assert got is link
    assert not link.aborted
