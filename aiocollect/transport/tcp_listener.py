"""The listener of stream links (TCP, TLS; the shared-memory transport's listener builds on
it) and the ``tcp`` and ``tls`` transports: accepting connections, dialing peers, and
handing each link whose handshake succeeded to the rank.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
from collections.abc import Callable
from typing import Any

from aiocollect.errors import PeerDisconnected, RendezvousError
from aiocollect.transport.base import Handshaker, Link, Superseded
from aiocollect.transport.interface import LinkSetup, Listener, Record, Screen, Transport
from aiocollect.transport.sockets import Screened
from aiocollect.transport.tcp import StreamLink
from aiocollect.transport.tcp_link import LaneLink, TcpLink, lanes_enabled

log = logging.getLogger("aiocollect.transport.tcp")


async def listen(
    host: str,
    port: int,
    make_link: Callable[[], StreamLink],
    on_link: Callable[[StreamLink], None],
    ssl: ssl_module.SSLContext | None = None,
    screen: Screen | None = None,
) -> asyncio.Server:
    """Accept peer connections; ``on_link`` gets each link whose handshake succeeded.
    Failed handshakes are logged and closed; they never disturb the listener. ``screen``,
    when given, sees each connection first and may refuse it (its reply is sent, then the
    connection closed; the screen does its own logging)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        accepting(make_link, on_link, screen), host, port, ssl=ssl, reuse_address=True
    )


def accepting(
    make_link: Callable[[], StreamLink],
    on_link: Callable[[StreamLink], None],
    screen: Screen | None = None,
) -> Callable[[], StreamLink]:
    """The protocol factory of a listener of stream links (any ``loop.create_*_server``):
    see :func:`listen`."""

    def factory() -> StreamLink:
        link = make_link()
        link.screen = screen
        link.ready.add_done_callback(_accepted)
        return link

    def _accepted(fut: asyncio.Future[StreamLink]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if isinstance(exc, (Screened, Superseded)):
            return
        if exc is not None:
            log.warning("rejected an incoming connection: %s", exc)
            return
        on_link(fut.result())

    return factory


async def connect(
    host: str,
    port: int,
    link: StreamLink,
    ssl: ssl_module.SSLContext | None = None,
    server_hostname: str | None = None,
) -> StreamLink:
    """Connect ``link`` to ``host:port`` and run its handshake.

    Raises:
        OSError: the connection was refused. Handshake errors as raised by the handshaker.
    """
    loop = asyncio.get_running_loop()
    kwargs: dict[str, Any] = {}
    if ssl is not None:
        kwargs = {"ssl": ssl, "server_hostname": server_hostname or host}
    await loop.create_connection(lambda: link, host, port, **kwargs)
    return await link.ready


class SocketListener(Listener):
    """A rank's listener of stream links: TCP (or TLS) as it stands; a subclass may make
    other links on the same connections (:meth:`make_link`: shared memory) or use other
    sockets (:meth:`serve` and :meth:`dial`: a Unix socket, say).

    Its links get their small-frame lane (transport/tcp_link.py) where ``lanes`` (True
    unless ``AIOCOLLECT_TCP_LANES=1``, or for a subclass whose links are not TCP links):
    its record then says ``"lanes": 2``, and the rendezvous makes a lane only between two
    ranks whose records both say so (rendezvous/ondemand.py)."""

    #: Whether this kind of listener's links take small-frame lanes.
    offers_lanes = True

    def __init__(
        self,
        setup: LinkSetup,
        family: str,
        server_ssl: ssl_module.SSLContext | None = None,
        client_ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        self.setup = setup
        self.server_ssl, self.client_ssl = server_ssl, client_ssl
        self.record: Record = {"transport": family}
        #: Whether this listener's links get their small-frame lane.
        self.lanes = self.offers_lanes and lanes_enabled()
        if self.lanes:
            self.record["lanes"] = 2
        self._server: asyncio.Server | None = None
        #: Accepted connections still in their handshake (strangers, once rendezvous
        #: is over).
        self._handshaking: set[StreamLink] = set()

    def make_link(self, handshaker: Handshaker, record: Record | None) -> StreamLink:
        """The link for one connection: ``record`` is the peer's when connecting to it,
        None for an accepted connection."""
        del record
        return TcpLink(self.setup.events, self.setup.max_frame, handshaker)

    async def serve(self, factory: Callable[[], StreamLink]) -> asyncio.Server:
        """Start the server whose connections ``factory`` makes links for, and add its
        address to ``self.record``."""
        server = await asyncio.get_running_loop().create_server(
            factory,
            self.setup.host,
            0,
            ssl=self.server_ssl,
            reuse_address=True,
            backlog=self.setup.backlog,
        )
        self.record.update(address=self.setup.host, port=server.sockets[0].getsockname()[1])
        return server

    async def dial(self, record: Record, link: StreamLink) -> None:
        """Open the connection to the server that ``record`` names, for ``link``.

        Raises:
            OSError: the connection failed.
        """
        host, port = str(record["address"]), int(record["port"])
        kwargs: dict[str, Any] = {}
        if self.client_ssl is not None:
            kwargs = {"ssl": self.client_ssl, "server_hostname": host}
        await asyncio.get_running_loop().create_connection(lambda: link, host, port, **kwargs)

    async def connect_lane(self, record: Record, handshaker: Handshaker, link: TcpLink) -> LaneLink:
        """Open the small-frame lane of ``link`` (which this rank connected to the rank that
        published ``record``) and run ``handshaker`` (a lane's) over it.

        Raises:
            OSError: the connection failed. PeerDisconnected: it closed during the
            handshake. What the handshaker raises (the peer refused the lane).
        """
        lane = LaneLink(link, handshaker, self.setup.max_frame)
        lane.ready.add_done_callback(_retrieve)  # (a cancelled connect leaves it unawaited)
        try:
            await self.dial(record, lane)
            await lane.ready
        except BaseException:
            lane.abort()
            raise
        return lane

    def where(self, record: Record) -> str:
        """The address ``record`` names, for messages."""
        return f"{record.get('address')}:{record.get('port')}"

    async def start(self) -> None:
        setup = self.setup

        def accepted() -> StreamLink:
            link = self.make_link(setup.acceptor(), None)
            self._handshaking.add(link)
            link.ready.add_done_callback(lambda _: self._handshaking.discard(link))
            return link

        self._server = await self.serve(accepting(accepted, setup.on_link, setup.screen))

    async def connect(self, record: Record, handshaker: Handshaker) -> Link:
        rank, peer = self.setup.rank, int(record["rank"])
        link = self.make_link(handshaker, record)
        link.ready.add_done_callback(_retrieve)  # (a cancelled connect leaves it unawaited)
        try:
            await self.dial(record, link)
            return await link.ready
        except OSError as exc:
            raise RendezvousError(
                f"rank {rank} could not connect to rank {peer} at {self.where(record)}: {exc}"
            ) from None
        except PeerDisconnected as exc:  # closed before the handshake completed
            hint = (
                f" (rank {peer} may have rejected this rank's TLS certificate)"
                if self.client_ssl is not None
                else ""
            )
            raise RendezvousError(
                f"rank {rank} could not link to rank {peer} at {self.where(record)}: {exc}{hint}"
            ) from None

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._handshaking):  # asyncio.Server.close() leaves them open
            if not link.ready.done():  # (this rank's own doing: nothing to warn about)
                link.ready.set_exception(Superseded("this rank stopped accepting links"))
            link.abort()
        self._handshaking.clear()


def _retrieve(ready: asyncio.Future[StreamLink]) -> None:
    """Mark a connecting link's failed handshake as seen: whoever connected it raises it,
    unless its connect was cancelled first (then the failure is no news to report)."""
    if not ready.cancelled():
        ready.exception()


class TcpTransport(Transport):
    """``tcp``: one TCP connection per link; ``tls`` (``tls=True``): mutual TLS on it."""

    def __init__(self, tls: bool = False) -> None:
        self.name = "tls" if tls else "tcp"
        self.needs_tls = tls

    def details(self) -> str | None:
        return ssl_module.OPENSSL_VERSION if self.needs_tls else None

    async def listen(self, setup: LinkSetup) -> Listener:
        tls = setup.tls if self.needs_tls else None
        listener = SocketListener(
            setup, self.name, tls.server if tls else None, tls.client if tls else None
        )
        await listener.start()
        return listener


TCP = TcpTransport()
TLS = TcpTransport(tls=True)
