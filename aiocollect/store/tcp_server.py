"""The TCP store server and the standalone ``aiocollect store`` command.

One asyncio server; per connection, one reading loop plus a task per pending ``get``/``wait``,
all in a TaskGroup owned by that connection. Waits sleep on futures of a :class:`KeyTable`
with deadlines (no polling). Anything malformed from a client closes that connection only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from aiocollect import _auth
from aiocollect._deadline import Deadline
from aiocollect.errors import AiocollectError, ProtocolError
from aiocollect.store import _wire
from aiocollect.store.memory import KeyTable

log = logging.getLogger("aiocollect.store.tcp")

DEFAULT_PORT = 29500


class _Connection:
    """One client connection: its stream and its pending waits by request id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.waits: dict[int, asyncio.Task[None]] = {}

    async def send(self, msg: object) -> None:
        self.writer.writelines(_wire.encode(msg))
        await self.writer.drain()


class TCPStoreServer:
    """An asyncio TCP store server.

    Args:
        host: address to bind; ``None`` or ``""`` binds every interface (IPv4, plus IPv6
            where available, on the same port).
        port: port to bind; 0 picks a free one (see :attr:`port`).
        secret: when set, each client must prove it (HMAC challenge-response) before any
            request is read; failures are logged and close that connection only.
        max_frame: largest accepted message in bytes.
        handshake_timeout: seconds a new connection has to complete the handshake.

    Use ``await server.start()`` (or ``async with``) and ``await server.close()``.
    """

    def __init__(
        self,
        host: str | None,
        port: int,
        *,
        secret: bytes | str | None = None,
        max_frame: int = _wire.MAX_FRAME,
        handshake_timeout: float = 10.0,
    ) -> None:
        self.host = host or None
        self._requested_port = port
        self._secret = _auth.as_secret(secret)
        self._max_frame = max_frame
        self._handshake_timeout = handshake_timeout
        self._table = KeyTable()
        self._servers: list[asyncio.Server] = []
        self._handlers: set[asyncio.Task[Any]] = set()
        self._conns: set[_Connection] = set()
        self._closed = asyncio.Event()
        self._port = 0

    @property
    def port(self) -> int:
        """The bound port (valid after :meth:`start`)."""
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` as clients would dial it (``0.0.0.0`` for all interfaces)."""
        host = self.host or "0.0.0.0"
        return f"[{host}]:{self._port}" if ":" in host else f"{host}:{self._port}"

    async def start(self) -> None:
        """Bind and start accepting connections.

        Raises:
            OSError: the address could not be bound (e.g. ``EADDRINUSE``).
        """
        if self.host is not None:
            await self._listen(self.host, self._requested_port)
            return
        # Bound separately so that port 0 yields the same port for both families.
        await self._listen("0.0.0.0", self._requested_port)
        if socket.has_ipv6:
            with contextlib.suppress(OSError):
                await self._listen("::", self._port, ipv6_only=True)

    async def _listen(self, host: str, port: int, ipv6_only: bool = False) -> None:
        if ipv6_only:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((host, port))
            except OSError:
                sock.close()
                raise
            server = await asyncio.start_server(self._handle, sock=sock)
        else:
            server = await asyncio.start_server(self._handle, host, port)
        self._servers.append(server)
        if not self._port:
            self._port = server.sockets[0].getsockname()[1]

    async def __aenter__(self) -> TCPStoreServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def serve_forever(self) -> None:
        """Return once :meth:`close` has been called (cancel it to stop waiting)."""
        await self._closed.wait()

    async def close(self) -> None:
        """Stop listening, close every client connection and cancel pending waits.
        Idempotent."""
        self._closed.set()
        for server in self._servers:
            server.close()
        for conn in list(self._conns):
            conn.writer.transport.abort()  # ends the reads and any drain blocked on the peer
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._closed.is_set():  # accepted just before close(); its handler ran after
            writer.transport.abort()
            return
        self._handlers.add(task)
        conn = _Connection(reader, writer)
        self._conns.add(conn)
        try:
            if await self._handshake(conn):
                await self._serve(conn)
        except (ConnectionError, asyncio.IncompleteReadError):
            log.debug("store client %s disconnected", conn.peer)
        except AiocollectError as exc:
            log.warning("closing store connection from %s: %s", conn.peer, exc)
        except TimeoutError:
            log.warning("store client %s did not complete the handshake in time", conn.peer)
        except asyncio.CancelledError:
            # Only close() and loop shutdown cancel handlers; nobody awaits this task, and
            # asyncio would log a cancelled connection callback as an error.
            log.debug("store connection from %s cancelled", conn.peer)
        finally:
            self._conns.discard(conn)
            writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer.wait_closed()
            self._handlers.discard(task)

    async def _handshake(self, conn: _Connection) -> bool:
        """Greet the client and check its proof; False if it failed (already logged)."""
        nonce_s = _auth.new_nonce() if self._secret is not None else None
        await conn.send(_wire.hello(nonce_s))
        if self._secret is None or nonce_s is None:
            return True
        async with asyncio.timeout(self._handshake_timeout):
            msg = await _wire.read_frame(conn.reader, _wire.MAX_HANDSHAKE_FRAME)
        nonce_c = _wire.check_client_proof(self._secret, nonce_s, msg)
        if nonce_c is None:
            log.warning("store client %s failed authentication; closing", conn.peer)
            with contextlib.suppress(ConnectionError):
                await conn.send([False, "authentication failed"])
            return False
        await conn.send([True, _wire.server_proof(self._secret, nonce_s, nonce_c)])
        return True

    async def _serve(self, conn: _Connection) -> None:
        error: Exception | None = None
        async with asyncio.TaskGroup() as tg:
            try:
                while True:
                    msg = await _wire.read_frame(conn.reader, self._max_frame)
                    await self._dispatch(conn, _wire.parse_request(msg), tg)
            except (ConnectionError, asyncio.IncompleteReadError, AiocollectError) as exc:
                error = exc  # raised below: a TaskGroup would wrap it in an ExceptionGroup
            finally:
                # Whatever ended the loop ends the pending waits too (no answers owed).
                for task in list(conn.waits.values()):
                    task.cancel()
        if error is not None:
            raise error

    async def _dispatch(
        self, conn: _Connection, req: _wire.Request, tg: asyncio.TaskGroup
    ) -> None:
        table = self._table
        if req.op == "cancel":
            task = conn.waits.get(req.target)
            if task is not None:
                task.cancel()
            return
        if req.op in ("get", "wait"):
            if req.rid in conn.waits:
                raise ProtocolError(f"request id {req.rid} reused while pending")
            if req.op == "get" and (value := table.get_now(req.key)) is not None:
                await self._answer(conn, req.rid, _wire.OK, value)
                return
            if req.op == "wait" and not table.missing(req.keys):
                await self._answer(conn, req.rid, _wire.OK, None)
                return
            task = tg.create_task(self._wait(conn, req))
            conn.waits[req.rid] = task
            task.add_done_callback(lambda _: conn.waits.pop(req.rid, None))
            return
        result: object = None
        status = _wire.OK
        try:
            if req.op == "set":
                table.set(req.key, req.value)
            elif req.op == "add":
                result = table.add(req.key, req.amount)
            elif req.op == "check":
                result = table.check(req.keys)
            else:  # delete
                result = table.delete(req.key)
        except AiocollectError as exc:
            status, result = _wire.ERROR, str(exc)
        await self._answer(conn, req.rid, status, result)

    async def _wait(self, conn: _Connection, req: _wire.Request) -> None:
        deadline = Deadline.after(req.timeout)
        try:
            if req.op == "get":
                value = await self._table.get(req.key, deadline)
                if value is None:
                    await self._answer(conn, req.rid, _wire.TIMEOUT, [req.key])
                else:
                    await self._answer(conn, req.rid, _wire.OK, value)
            else:
                missing = await self._table.wait(req.keys, deadline)
                status = _wire.TIMEOUT if missing else _wire.OK
                await self._answer(conn, req.rid, status, missing or None)
        except ConnectionError:
            conn.writer.close()  # the reading loop notices and ends the connection
        except Exception:
            log.exception("store request %s from %s failed; closing", req.op, conn.peer)
            conn.writer.close()

    async def _answer(self, conn: _Connection, rid: int, status: int, payload: object) -> None:
        try:
            frame = _wire.encode([rid, status, payload])
        except (TypeError, ValueError, OverflowError) as exc:  # e.g. a counter beyond 64 bits
            frame = _wire.encode([rid, _wire.ERROR, f"cannot encode the answer: {exc}"])
        conn.writer.writelines(frame)
        await conn.writer.drain()


async def serve_store(
    host: str | None,
    port: int,
    secret: bytes | str | None = None,
    *,
    ready: Callable[[TCPStoreServer], object] | None = None,
) -> None:
    """Run a TCP store server until cancelled.

    Args:
        host: address to bind (``None``: every interface).
        port: port to bind (0: a free one).
        secret: shared secret clients must prove, or None.
        ready: called with the started server (e.g. to print its address).

    Raises:
        OSError: the address could not be bound.
    """
    server = TCPStoreServer(host, port, secret=secret)
    await server.start()
    try:
        if ready is not None:
            ready(server)
        await server.serve_forever()
    finally:
        await server.close()


def store_main(argv: list[str]) -> int:
    """``aiocollect store``: run a standalone TCP store until SIGINT/SIGTERM.

    Prints ``aiocollect store listening on HOST:PORT`` once ready. The secret comes from
    ``--secret`` or else ``AIOCOLLECT_SECRET``. Returns the process exit status.
    """
    parser = argparse.ArgumentParser(
        prog="aiocollect store",
        description="Standalone TCP store server for multi-node aiocollect jobs.",
    )
    parser.add_argument("--host", default=None, help="address to bind (default: all interfaces)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: pick a free one)")
    parser.add_argument(
        "--secret",
        default=None,
        help="shared secret clients must prove (default: $AIOCOLLECT_SECRET)",
    )
    args = parser.parse_args(argv)
    secret = args.secret if args.secret is not None else os.environ.get("AIOCOLLECT_SECRET")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        asyncio.run(_run_until_signal(args.host, args.port, _auth.as_secret(secret)))
    except OSError as exc:
        print(f"aiocollect store: cannot listen on port {args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _run_until_signal(host: str | None, port: int, secret: bytes | None) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(
        serve_store(
            host,
            port,
            secret,
            ready=lambda srv: print(
                f"aiocollect store listening on {srv.address}"
                f" (secret {'required' if secret else 'not required'})",
                flush=True,
            ),
        )
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


__all__ = ["DEFAULT_PORT", "TCPStoreServer", "serve_store", "store_main"]
