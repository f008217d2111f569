"""The TCP store: ``tcp://HOST:PORT`` and the embedded-server election.

The host rank starts a :class:`TCPStoreServer` when nothing listens at the address yet; the
others retry connecting until it is up. The client (:class:`TCPStore`) lives in
:mod:`aiocollect.store.tcp_client`, the server in :mod:`aiocollect.store.tcp_server`, the
``aiocollect store`` command in :mod:`aiocollect.store.tcp_command`; all are re-exported
here.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress

from aiocollect._deadline import Deadline
from aiocollect.errors import StoreError, StoreTimeout, UsageError
from aiocollect.store.base import DEFAULT_TIMEOUT
from aiocollect.store.tcp_client import TCPStore, describe_error, format_address
from aiocollect.store.tcp_command import serve_store, store_main
from aiocollect.store.tcp_server import DEFAULT_PORT, TCPStoreServer

#: Longest single connection attempt (connect + handshake) while retrying.
ATTEMPT_TIMEOUT = 10.0
RETRY_MIN = 0.010
RETRY_MAX = 0.200
#: Seconds the host rank waits for a store at a port it found in use (another process that
#: won the race to host it listens within milliseconds; a port held by some other socket,
#: such as a client connection's ephemeral port, never answers).
TAKEN_GRACE = 5.0

_Retryable = (OSError, TimeoutError, asyncio.IncompleteReadError)


def _bind_host(host: str) -> str | None:
    """Where the embedded server listens: the address itself for loopback literals, else
    every interface (a hostname may resolve to 127.0.1.1 locally but not for peers)."""
    if host == "localhost":
        return host
    try:
        return host if ipaddress.ip_address(host).is_loopback else None
    except ValueError:
        return None


def _attempt_timeout(deadline: Deadline) -> float:
    remaining = deadline.remaining()
    return ATTEMPT_TIMEOUT if remaining is None else min(ATTEMPT_TIMEOUT, remaining)


async def _dial(store: TCPStore, timeout: float) -> None:
    """One connection attempt (a seam for tests)."""
    await store._open(timeout)


async def connect_tcp_store(
    host: str,
    port: int,
    *,
    is_host: bool,
    secret: bytes | str | None = None,
    insecure: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> TCPStore:
    """Connect to the TCP store at ``host:port``, starting it first on the host rank.

    The host rank (``is_host``) starts an embedded :class:`TCPStoreServer` when nothing
    listens at ``host:port`` yet; the returned client owns it (``close()`` stops it). With
    ``port=0`` it always starts one, on a free port (``store.port``). Other ranks retry
    connecting with a backoff from 10 ms to 200 ms until ``timeout``.

    Args:
        host: the store's address (rank 0's host).
        port: the store's port.
        is_host: whether this rank may host the embedded server.
        secret: shared secret for the HMAC handshake, or None.
        insecure: an embedded server without a secret accepts other hosts too (default:
            this host only, see :class:`TCPStoreServer`).
        timeout: seconds to keep trying; also the store's default timeout.

    Returns:
        A connected client.

    Raises:
        StoreTimeout: no store answered at the address in time (the message names it).
        StoreError: the embedded server could not be started, the peer is not a store,
            the store refused us (protected mode: no secret and another host), or (host
            rank) the port is held by a socket that is no store.
        AuthenticationError: the secret was not proven by one side.
        UsageError: ``port`` is 0 on a non-host rank.
    """
    deadline = Deadline.after(timeout)
    if is_host:
        store = await _host(host, port, secret, insecure, timeout, deadline)
        if store is not None:
            return store
        # The port is taken: by a store another process started (it answers at once), or
        # by a socket that is no store (then say so instead of waiting out the timeout).
        remaining = deadline.remaining()
        grace = TAKEN_GRACE if remaining is None else min(TAKEN_GRACE, remaining)
        try:
            return await _connect_with_retry(host, port, secret, timeout, Deadline.after(grace))
        except StoreTimeout:
            raise StoreError(
                f"cannot host the TCP store at {format_address(host, port)}: the port is in "
                f"use, but no store answers there within {grace:g}s (another program, or an "
                "outgoing connection's ephemeral port, holds it; pick a port outside "
                "net.ipv4.ip_local_port_range, e.g. via MASTER_PORT or AIOCOLLECT_STORE)"
            ) from None
    elif port == 0:
        raise UsageError("port 0 (pick a free port) is only valid on the host rank")
    return await _connect_with_retry(host, port, secret, timeout, deadline)


async def _host(
    host: str,
    port: int,
    secret: bytes | str | None,
    insecure: bool,
    timeout: float,
    deadline: Deadline,
) -> TCPStore | None:
    """Connect to a store already there, else start one; None if another process won the
    race for the port (connect to it then)."""
    if port != 0:
        store = TCPStore(host, port, secret=secret, timeout=timeout)
        try:
            await _dial(store, _attempt_timeout(deadline))
            return store
        except _Retryable:
            await store.close()
    server = TCPStoreServer(_bind_host(host), port, secret=secret, insecure=insecure)
    try:
        await server.start()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE and port != 0:
            return None
        msg = f"cannot start the TCP store server on {format_address(host, port)}: {exc}"
        raise StoreError(msg) from exc
    store = TCPStore(host, server.port, secret=secret, timeout=timeout)
    store.server = server
    try:
        await store.connect(timeout=deadline.remaining())
    except BaseException:
        await store.close()
        raise
    return store


async def _connect_with_retry(
    host: str, port: int, secret: bytes | str | None, timeout: float, deadline: Deadline
) -> TCPStore:
    delay = RETRY_MIN
    last: BaseException | None = None
    while True:
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            break
        store = TCPStore(host, port, secret=secret, timeout=timeout)
        try:
            await _dial(store, _attempt_timeout(deadline))
            return store
        except _Retryable as exc:
            last = exc
            await store.close()
        except BaseException:
            await store.close()
            raise
        remaining = deadline.remaining()
        await asyncio.sleep(delay if remaining is None else min(delay, remaining))
        delay = min(RETRY_MAX, delay * 2)
    hint = f" (last error: {describe_error(last)})" if last is not None else ""
    raise StoreTimeout(
        f"could not connect to the TCP store at {format_address(host, port)} within"
        f" {timeout:g}s{hint}; is rank 0 or `aiocollect store` running there?"
    )


__all__ = [
    "DEFAULT_PORT",
    "TCPStore",
    "TCPStoreServer",
    "connect_tcp_store",
    "format_address",
    "serve_store",
    "store_main",
]
