"""An example transport, registered by the tests only: links over Unix domain sockets.

It is what adding a transport takes (docs/design.md, "Adding a transport"): this one
module and one registry line (here ``registry.registered(UNIX)`` in the tests that use it;
a built-in one goes in ``aiocollect.transport.registry.BUILTIN``). Its links are the TCP
link's (a stream link works over any asyncio stream transport); only where the listener
listens and how a peer reaches it differ, and its records name a socket path, reachable
from ranks on the same host only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Callable, Mapping

from aiocollect.errors import RendezvousError
from aiocollect.transport import host
from aiocollect.transport.interface import LinkSetup, Listener, Record, Transport
from aiocollect.transport.tcp_link import TcpLink
from aiocollect.transport.tcp_listener import SocketListener


class UnixListener(SocketListener):
    """Listens on a fresh socket in a private directory, removed on close."""

    def __init__(self, setup: LinkSetup) -> None:
        super().__init__(setup, "unix")
        self._dir = tempfile.mkdtemp(prefix="aiocollect-unix-")
        self.path = os.path.join(self._dir, f"rank{setup.rank}.sock")

    async def serve(self, factory: Callable[[], TcpLink]) -> asyncio.Server:  # type: ignore[override]
        server = await asyncio.get_running_loop().create_unix_server(factory, self.path)
        self.record["path"] = self.path
        return server

    async def dial(self, record: Record, link: TcpLink) -> None:  # type: ignore[override]
        await asyncio.get_running_loop().create_unix_connection(lambda: link, str(record["path"]))

    def where(self, record: Record) -> str:
        return str(record.get("path"))

    def prepare(self, peers: Mapping[int, Record]) -> None:
        for rank, rec in peers.items():
            if not UNIX.accepts(rec):
                raise RendezvousError(
                    f"transport 'unix' links ranks of one host: rank "
                    f"{rank} runs on {rec.get('hostname')!r}"
                )

    def close(self) -> None:
        super().close()
        with contextlib.suppress(OSError):  # gone already, or never made
            os.remove(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


class UnixTransport(Transport):
    """``unix``: ranks on one host, one Unix domain socket per link."""

    name = "unix"

    def accepts(self, record: Record) -> bool:
        return super().accepts(record) and host.same_host(record)

    async def listen(self, setup: LinkSetup) -> Listener:
        listener = UnixListener(setup)
        await listener.start()
        return listener


UNIX = UnixTransport()
