"""In-process links for ranks that share one event loop (tests, simulations).

Frames are copied at send time and delivered with ``loop.call_soon``, so ordering, early
frames and failures behave as on a socket.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from aiocollect.errors import PeerDisconnected, RendezvousError
from aiocollect.transport.base import (
    SAME_THREAD,
    Handshaker,
    Link,
    LinkCaps,
    LinkEvents,
    Rejection,
    SendMark,
)
from aiocollect.transport.interface import LinkSetup, Listener, Record, Transport
from aiocollect.transport.wire import parse_header

log = logging.getLogger("aiocollect.transport.memory")

_listeners: dict[str, tuple[Callable[[], MemoryLink], Callable[[MemoryLink], None]]] = {}
_ids = itertools.count()


class MemoryLink(Link):
    """One end of an in-process link pair."""

    def __init__(self, events: LinkEvents, max_frame: int, handshaker: Handshaker) -> None:
        super().__init__(events, max_frame)
        self.handshaker = handshaker
        self.other: MemoryLink | None = None
        self._loop = asyncio.get_running_loop()

    @property
    def caps(self) -> LinkCaps:
        return SAME_THREAD

    def send(self, header: bytes, payload: memoryview | bytes) -> SendMark:
        other = self.other
        if self.closed or other is None:
            raise self._failure or PeerDisconnected(
                f"link to rank {self.peer} is closed", self.peer
            )
        self._loop.call_soon(other._deliver, header, bytes(payload))
        self.bytes_sent += len(payload)
        self.frames_sent += 1
        return None  # (copied)

    def _deliver(self, header: bytes, data: bytes) -> None:
        if self.closed:
            return
        try:
            h = parse_header(header, self.max_frame)
        except Exception as exc:
            self._raise_error(exc)
            return
        dest = self._begin_frame(h)
        if dest is None:
            self.abort()
            return
        dest[:] = data
        self._end_frame()

    def write_buffer_size(self) -> int:
        return 0

    async def drained(self) -> None:
        if self.closed and self.other is None:
            raise PeerDisconnected(f"link to rank {self.peer} is closed", self.peer)

    def close(self) -> None:
        self._shutdown()

    def abort(self) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        other, self.other = self.other, None
        if other is not None:
            self._loop.call_soon(other._peer_closed)

    def _peer_closed(self) -> None:
        self.other = None
        if not self.closed:
            self.closed = True
            self.events.on_lost(self, None)


def listen(make_link: Callable[[], MemoryLink], on_link: Callable[[MemoryLink], None]) -> str:
    """Register an in-process listener; returns its address."""
    address = f"memory-{next(_ids)}"
    _listeners[address] = (make_link, on_link)
    return address


def unlisten(address: str) -> None:
    _listeners.pop(address, None)


def connect(address: str, link: MemoryLink) -> MemoryLink:
    """Pair ``link`` with a new link at ``address`` and run both handshakes.

    Raises:
        RendezvousError: nothing listens at ``address``; handshake errors as raised.
    """
    try:
        make_link, on_link = _listeners[address]
    except KeyError:
        raise RendezvousError(f"no in-process listener at {address}") from None
    acceptor = make_link()
    inbox: list[tuple[MemoryLink, dict[str, Any]]] = [
        (link, m) for m in acceptor.handshaker.start()
    ]
    done: dict[int, int] = {}
    while inbox:
        target, msg = inbox.pop(0)
        source = acceptor if target is link else link
        try:
            replies, peer = target.handshaker.on_message(msg)
        except Rejection as rej:
            inbox.append((source, rej.reply))
            if target is acceptor:
                log.warning("rejected an in-process connection: %s", rej.error)
                continue
            raise rej.error from None
        inbox.extend((source, r) for r in replies)
        if peer is not None:
            target.peer = peer
            done[id(target)] = peer
    if len(done) != 2:
        raise RendezvousError(f"in-process handshake with {address} did not complete")
    link.other, acceptor.other = acceptor, link
    on_link(acceptor)
    return link


class MemoryListener(Listener):
    """An in-process listener: its record's ``address`` names it in this process. A
    variant of the in-process link (tests/transport/example_onesided.py) subclasses it,
    naming its own ``transport`` and ``link_type``."""

    #: The record's ``transport``: what the listener speaks.
    transport = "memory"
    #: The links it makes.
    link_type: type[MemoryLink] = MemoryLink

    def __init__(self, setup: LinkSetup) -> None:
        self.setup = setup
        make = self.link_type
        address = listen(
            lambda: make(setup.events, setup.max_frame, setup.acceptor()), setup.on_link
        )
        self.record: Record = {"transport": self.transport, "address": address}

    async def connect(self, record: Record, handshaker: Handshaker) -> Link:
        link = self.link_type(self.setup.events, self.setup.max_frame, handshaker)
        return connect(str(record["address"]), link)

    def close(self) -> None:
        unlisten(str(self.record["address"]))


class MemoryTransport(Transport):
    """``memory``: ranks of one process, one event loop (what ``auto`` means with a
    ``memory://`` store)."""

    name = "memory"
    in_process = True

    async def listen(self, setup: LinkSetup) -> Listener:
        return MemoryListener(setup)


MEMORY = MemoryTransport()
