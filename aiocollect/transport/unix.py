"""Unix-domain stream sockets between ranks on one host (the socket of ``auto`` and ``shm``
links).

A link between two processes on one host needs a socket even in shared memory mode: it
carries the handshake, the doorbells, small frames to a sleeping reader and the peer's
liveness (the kernel closes it when the process dies). Over TCP loopback every such write
runs the whole TCP stack on both ends (segments, acknowledgements, timers); a Unix-domain
socket hands the bytes straight to the peer's queue. Four ranks on two cores, a minimal
4-byte star: 71 µs per allreduce over Unix sockets against 92 µs over TCP loopback, 24 %
less CPU (``tools/op_cpu.py -n 4`` with ``AIOCOLLECT_UNIX_SOCKET=0`` and without; docs/design.md,
*Same-host links on a Unix socket*).

The listener binds a socket in Linux's *abstract* namespace (``\\0aiocollect-<pid>-<random>``:
no file to create, clean up or leak, gone with the process) and publishes the name in its
record beside its TCP address. A rank connecting to a peer on its host (same hostname and
boot id) tries that name first and falls back to TCP when it cannot connect (another
network namespace has its own abstract names, for one). Nothing else changes: the same
handshake (and its secret) runs over it, and protected mode counts a Unix peer as local,
which it is.

``AIOCOLLECT_UNIX_SOCKET=0`` keeps every link on TCP (for comparisons); Unix sockets are
used only on Linux.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import sys
from collections.abc import Callable, Mapping

log = logging.getLogger("aiocollect.transport.unix")

#: Set to ``0`` to keep links between ranks on one host on TCP loopback.
UNIX_ENV = "AIOCOLLECT_UNIX_SOCKET"
#: Prefix of the abstract names (after the leading NUL byte).
PREFIX = "aiocollect-"


def _setting(env: Mapping[str, str] | None) -> str:
    return (os.environ if env is None else env).get(UNIX_ENV, "").strip()


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether links to ranks on this host may use Unix sockets: on Linux (abstract
    names), unless ``AIOCOLLECT_UNIX_SOCKET`` (in ``env``, default ``os.environ``) is
    ``0``, ``false``, ``no`` or ``off``."""
    off = _setting(env).lower() in ("0", "false", "no", "off")
    return sys.platform.startswith("linux") and not off


def describe(env: Mapping[str, str] | None = None) -> str:
    """What same-host links connect over here, for ``aiocollect info``."""
    if enabled(env):
        return "unix sockets"
    if not sys.platform.startswith("linux"):
        return f"tcp sockets: no abstract Unix sockets on {sys.platform}"
    return f"tcp sockets: {UNIX_ENV}={_setting(env)}"


def _address(name: str) -> str:
    return "\0" + name


async def serve(factory: Callable[[], asyncio.BaseProtocol]) -> tuple[asyncio.Server, str]:
    """Listen on a new abstract Unix socket; returns the server and its name (for the
    record; without the leading NUL byte).

    Raises:
        OSError: no Unix sockets here.
    """
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(_address(name))
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
        server = await asyncio.get_running_loop().create_unix_server(factory, sock=sock)
    except BaseException:
        sock.close()
        raise
    return server, name


async def dial(name: str, factory: Callable[[], asyncio.BaseProtocol]) -> None:
    """Connect to the abstract Unix socket ``name`` with the protocol ``factory`` makes
    (called only once connected, so a failed attempt leaves the protocol unused).

    Raises:
        OSError: nobody listens on ``name`` in this network namespace, or no Unix sockets.
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, _address(name))
        await loop.create_unix_connection(factory, sock=sock)
    except BaseException:
        sock.close()
        raise


def valid_name(value: object) -> bool:
    """Whether a record's ``unix`` field is a name this module would have made."""
    return (
        isinstance(value, str)
        and value.startswith(PREFIX)
        and len(value) <= 100
        and value.isprintable()
    )
