"""The TCP store server (its command line: :mod:`aiocollect.store.tcp_command`).

One asyncio server; per connection, one reading loop plus a task per pending ``get``/``wait``,
all in a TaskGroup owned by that connection. Waits sleep on futures of a :class:`KeyTable`
with deadlines (no polling). Anything malformed from a client closes that connection only.

What a client can cost the server is bounded: without a secret only this host may connect
(protected mode, :mod:`aiocollect._protect`); a connection must complete its first frame
within ``handshake_timeout`` and, once a frame has begun, keep it coming (no pause longer
than ``idle_timeout``); decoding is bounded (:func:`aiocollect.store._wire.decode`); frames
above 64 KiB being received at once share ``max_inflight`` bytes; what is stored is capped
by ``max_bytes`` and ``max_keys`` (a ``set``/``add`` beyond them fails with a clear
``StoreError`` on that client only); ``max_connections`` caps connections, and a
connection may have at most 4096 waits pending (naming 1 Mi keys in all).

Thousands of clients connecting at once (a large group's ranks) wait in a listen backlog
of net.core.somaxconn (:func:`listen_backlog`) instead of being dropped; each connection
holds a file descriptor, and when the process has none left the server says so once
(:mod:`aiocollect._fdlimit`) and accepts again as descriptors free up.

A large value never holds the loop in one go (:mod:`aiocollect.store._stream`): its frame
is gathered a chunk at a time, the table keeps a view of the value inside it (no copy),
and an answer carrying it is written a chunk at a time, under the transport's flow control.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from typing import Any

from aiocollect import _auth, _fdlimit, _protect
from aiocollect._deadline import Deadline
from aiocollect.errors import AiocollectError, ProtocolError
from aiocollect.store import _stream, _wire
from aiocollect.store._limits import Budget, Quota
from aiocollect.store.memory import KeyTable, Value

log = logging.getLogger("aiocollect.store.tcp")

DEFAULT_PORT = 29500
#: Defaults of the limits (see :class:`TCPStoreServer`).
MAX_BYTES = 1024 * 1024 * 1024
MAX_KEYS = 1024 * 1024
MAX_INFLIGHT = 256 * 1024 * 1024
MAX_CONNECTIONS = 16384
#: Listen backlog when net.core.somaxconn cannot be read, and the most asked for (the
#: kernel caps any backlog at somaxconn): a burst of thousands of connects (every rank of a
#: large group at once) waits in the backlog instead of being dropped.
BACKLOG_DEFAULT = 4096
BACKLOG_MAX = 65535
#: 30 s, not 10: with 4,096 clients connecting at once from one process on a 2-core
#: machine under load, 1,218 of them answered the greeting later than 10 s after it was
#: sent (tests/store/test_many_clients.py under ``pytest -n 2``).
HANDSHAKE_TIMEOUT = 30.0
IDLE_TIMEOUT = 10.0
#: Frames up to this size are read without reserving from ``max_inflight`` (rendezvous
#: traffic, so big transfers can never hold it up).
SMALL_FRAME = _wire.VIEW_MIN
#: Pending get/wait requests one connection may have, and keys they may name in all (each
#: costs a task and a waiter per key).
MAX_PENDING_WAITS = 4096
MAX_PENDING_WAIT_KEYS = 1024 * 1024
#: Longest error text sent back to a client.
_MAX_REASON = 1024


def listen_backlog() -> int:
    """The listen backlog of the server's sockets: net.core.somaxconn (the kernel's cap),
    at most BACKLOG_MAX; BACKLOG_DEFAULT where it cannot be read."""
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return max(1, min(int(f.read()), BACKLOG_MAX))
    except (OSError, ValueError):
        return BACKLOG_DEFAULT


class _Connection:
    """One client connection: its stream and its pending waits by request id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peername = peer
        self.sockname = writer.get_extra_info("sockname")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.frames = _stream.FrameWriter(writer)
        self.waits: dict[int, asyncio.Task[None]] = {}
        self.wait_keys = 0  # keys named by the pending waits

    async def send(self, msg: list[object]) -> None:
        await self.frames.send(*_wire.encode_frame(msg))


class TCPStoreServer:
    """An asyncio TCP store server.

    Args:
        host: address to bind; ``None`` or ``""`` binds every interface (IPv4, plus IPv6
            where available, on the same port).
        port: port to bind; 0 picks a free one (see :attr:`port`).
        secret: when set, each client must prove it (HMAC challenge-response) before any
            request is read; failures are logged and close that connection only.
        insecure: without a secret, accept connections from other hosts too. By default
            (protected mode) a server with no secret answers a connection from elsewhere
            with a message saying how to set a secret, and closes it.
        max_frame: largest accepted message in bytes (also the most one connection
            buffers).
        handshake_timeout: seconds a new connection has to complete its first frame (the
            handshake).
        idle_timeout: seconds a frame, once begun, may pause before the connection is
            closed (between frames a client may stay silent as long as it likes).
        max_inflight: bytes of large frames (over 64 KiB) received at once, all
            connections together; more wait their turn.
        max_bytes: quota of what is stored, keys and values together, in bytes; a
            ``set``/``add`` beyond it is refused with ``StoreError`` on that client.
        max_keys: quota of how many keys are stored; a ``set``/``add`` of a new key beyond
            it is refused the same way.
        max_connections: connections served at once; more are told so and closed.

    Use ``await server.start()`` (or ``async with``) and ``await server.close()``.
    """

    def __init__(
        self,
        host: str | None,
        port: int,
        *,
        secret: bytes | str | None = None,
        insecure: bool = False,
        max_frame: int = _wire.MAX_FRAME,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
        max_inflight: int = MAX_INFLIGHT,
        max_bytes: int = MAX_BYTES,
        max_keys: int = MAX_KEYS,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.host = host or None
        self._requested_port = port
        self._secret = _auth.as_secret(secret)
        self._insecure = bool(insecure)
        self._max_frame = max_frame
        self._handshake_timeout = handshake_timeout
        self._idle_timeout = idle_timeout
        self._budget = Budget(max_inflight)
        self._max_connections = max_connections
        self._table = KeyTable()
        self._quota = Quota(self._table, max_bytes, max_keys)
        self._servers: list[asyncio.Server] = []
        self._handlers: set[asyncio.Task[Any]] = set()
        self._conns: set[_Connection] = set()
        self._closed = asyncio.Event()
        self._port = 0
        self._restore_handler: Any = None
        self._out_of_fds_said = False

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
        else:
            # Bound separately so that port 0 yields the same port for both families.
            await self._listen("0.0.0.0", self._requested_port)
            if socket.has_ipv6:
                with contextlib.suppress(OSError):
                    await self._listen("::", self._port, ipv6_only=True)
        self._watch_accept_errors()

    def _watch_accept_errors(self) -> None:
        """Say once, in one line naming the limit and what to do, that accepting failed for
        want of file descriptors (the loop retries every second and would report each
        failure); other reports go to the loop's previous handler."""
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()

        def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            exc, sock = context.get("exception"), context.get("socket")
            ours = sock is not None and any(
                s.fileno() == sock.fileno() for server in self._servers for s in server.sockets
            )
            if ours and isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                if not self._out_of_fds_said:
                    self._out_of_fds_said = True
                    log.error(
                        "%s; new connections wait in the backlog meanwhile (said once)",
                        _fdlimit.exhausted(f"the TCP store at {self.address}"),
                    )
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handler)

        def restore() -> None:
            if loop.get_exception_handler() is handler:
                loop.set_exception_handler(previous)

        self._restore_handler = restore

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
            server = await asyncio.start_server(self._handle, sock=sock, backlog=listen_backlog())
        else:
            server = await asyncio.start_server(self._handle, host, port, backlog=listen_backlog())
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
        if self._restore_handler is not None:
            self._restore_handler()
            self._restore_handler = None

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
            if await self._admit(conn) and await self._handshake(conn):
                await self._serve(conn)
        except (ConnectionError, asyncio.IncompleteReadError):
            log.debug("store client %s disconnected", conn.peer)
        except AiocollectError as exc:
            log.warning("closing store connection from %s: %s", conn.peer, exc)
        except TimeoutError:
            # info, not warning: a peer that opens many connections must not flood the log
            log.info(
                "store client %s stalled (handshake or a frame not completed in time); closing",
                conn.peer,
            )
        except asyncio.CancelledError:
            # Only close() and loop shutdown cancel handlers; nobody awaits this task, and
            # asyncio would log a cancelled connection callback as an error.
            log.debug("store connection from %s cancelled", conn.peer)
        finally:
            self._conns.discard(conn)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await conn.frames.aclose()
            writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer.wait_closed()
            self._handlers.discard(task)

    async def _admit(self, conn: _Connection) -> bool:
        """Refuse, with a message, a connection from another host when there is no secret
        (protected mode) and one beyond ``max_connections``."""
        reason = None
        if (
            self._secret is None
            and not self._insecure
            and not _protect.is_local(conn.peername, conn.sockname)
        ):
            reason = _protect.refusal(f"the aiocollect TCP store at {self.address}", conn.peername)
            _protect.log_refusal(log, f"TCP store {self.address}", conn.peername)
        elif len(self._conns) > self._max_connections:
            reason = (
                f"the aiocollect TCP store at {self.address} serves at most "
                f"{self._max_connections} connections at once (max_connections)"
            )
            log.warning(
                "store refused a connection from %s: %d connections already",
                conn.peer,
                self._max_connections,
            )
        if reason is None:
            return True
        with contextlib.suppress(ConnectionError):
            await conn.send(_wire.refusal(reason))
        return False

    async def _handshake(self, conn: _Connection) -> bool:
        """Greet the client and check its first frame (its proof of the secret, or the
        empty one); False if it failed (already logged)."""
        nonce_s = _auth.new_nonce() if self._secret is not None else None
        await conn.send(_wire.hello(nonce_s))
        # Not asyncio.timeout: when the server is late (a burst of thousands of connects),
        # the client's frame and the deadline come in one turn of the loop, and the frame,
        # which arrived in time, must win.
        read = asyncio.ensure_future(_wire.read_frame(conn.reader, _wire.MAX_HANDSHAKE_FRAME))
        try:
            await asyncio.wait([read], timeout=self._handshake_timeout)
        finally:
            if not read.done():
                read.cancel()
                await asyncio.gather(read, return_exceptions=True)
        if read.cancelled():
            raise TimeoutError
        msg = read.result()
        if self._secret is None or nonce_s is None:
            if msg != _wire.NO_PROOF:
                raise ProtocolError("malformed store handshake")
            return True
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
                    msg = await self._read_request(conn)
                    await self._dispatch(conn, _wire.parse_request(msg), tg)
            except (
                ConnectionError,
                asyncio.IncompleteReadError,
                AiocollectError,
                TimeoutError,
            ) as exc:
                error = exc  # raised below: a TaskGroup would wrap it in an ExceptionGroup
            finally:
                # Whatever ended the loop ends the pending waits too (no answers owed).
                for task in list(conn.waits.values()):
                    task.cancel()
        if error is not None:
            raise error

    async def _read_request(self, conn: _Connection) -> Any:
        """Read and decode one frame: waiting for its first byte has no deadline, the rest
        must keep coming (``idle_timeout`` per pause), and a large body waits for its share
        of ``max_inflight`` first.

        Raises:
            ProtocolError: oversized or malformed. TimeoutError: the sender stalled.
            asyncio.IncompleteReadError, ConnectionError: the connection ended.
        """
        reader = conn.reader
        first = await reader.readexactly(1)
        async with asyncio.timeout(self._idle_timeout):
            rest = await reader.readexactly(_wire.HEADER.size - 1)
        (size,) = _wire.HEADER.unpack(first + rest)
        if size > self._max_frame:
            raise ProtocolError(
                f"store message of {size} bytes exceeds the limit of {self._max_frame}"
            )
        if size <= SMALL_FRAME:
            async with asyncio.timeout(self._idle_timeout):
                return _wire.decode(await reader.readexactly(size))
        await self._budget.acquire(size)
        try:
            body = await _stream.read_body(reader, size, self._idle_timeout, check=True)
        finally:
            self._budget.release(size)
        return _wire.decode(body)  # a large value: a view of body, not a copy

    async def _dispatch(self, conn: _Connection, req: _wire.Request, tg: asyncio.TaskGroup) -> None:
        table = self._table
        if req.op == "cancel":
            task = conn.waits.get(req.target)
            if task is not None:
                task.cancel()
            return
        if req.op in ("get", "wait", "multi_get"):
            if req.rid in conn.waits:
                raise ProtocolError(f"request id {req.rid} reused while pending")
            if req.op == "get" and (value := table.get_now(req.key)) is not None:
                await self._answer(conn, req.rid, _wire.OK, value)
                return
            if req.op == "wait" and not table.missing(req.keys):
                await self._answer(conn, req.rid, _wire.OK, None)
                return
            if req.op == "multi_get" and (values := table.values(req.keys)) is not None:
                await self._answer(conn, req.rid, *self._values_answer(values))
                return
            nkeys = max(1, len(req.keys))
            if (
                len(conn.waits) >= MAX_PENDING_WAITS
                or conn.wait_keys + nkeys > MAX_PENDING_WAIT_KEYS
            ):
                await self._answer(
                    conn,
                    req.rid,
                    _wire.ERROR,
                    (
                        f"too many waits pending on this connection (at most {MAX_PENDING_WAITS}"
                        f" waits naming {MAX_PENDING_WAIT_KEYS} keys in all)"
                    ),
                )
                return
            task = tg.create_task(self._wait(conn, req))
            conn.waits[req.rid] = task
            conn.wait_keys += nkeys

            def done(_: object, rid: int = req.rid, n: int = nkeys) -> None:
                conn.waits.pop(rid, None)
                conn.wait_keys -= n

            task.add_done_callback(done)
            return
        result: object = None
        status = _wire.OK
        try:
            if req.op == "set":
                self._quota.set(req.key, req.value)
            elif req.op == "add":
                result = self._quota.add(req.key, req.amount)
            elif req.op == "check":
                result = table.check(req.keys)
            else:  # delete
                result = self._quota.delete(req.key)
        except AiocollectError as exc:
            status, result = _wire.ERROR, str(exc)[:_MAX_REASON]
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
            elif req.op == "multi_get":
                values, missing = await self._table.get_many(req.keys, deadline)
                if missing:
                    await self._answer(conn, req.rid, _wire.TIMEOUT, missing)
                else:
                    await self._answer(conn, req.rid, *self._values_answer(values))
            else:
                missing = await self._table.wait(req.keys, deadline)
                status = _wire.TIMEOUT if missing else _wire.OK
                await self._answer(conn, req.rid, status, missing or None)
        except ConnectionError:
            conn.writer.close()  # the reading loop notices and ends the connection
        except Exception:
            log.exception("store request %s from %s failed; closing", req.op, conn.peer)
            conn.writer.close()

    def _values_answer(self, values: list[Value]) -> tuple[int, object]:
        """The status and payload answering a ``multi_get`` of ``values``: ERROR when the
        answer would exceed ``max_frame`` (the client's frames are bounded the same way)."""
        size = _wire.multi_get_size(values)
        if size > self._max_frame:
            return _wire.ERROR, (
                f"multi_get: the {len(values)} values make an answer of about {size} bytes, "
                f"over the limit of {self._max_frame}: ask for fewer keys at a time"
            )
        return _wire.OK, values

    async def _answer(self, conn: _Connection, rid: int, status: int, payload: object) -> None:
        """Send an answer; a large value goes uncopied, in chunks (``conn.frames``)."""
        try:
            frame = _wire.encode_frame([rid, status, payload])
        except (TypeError, ValueError, OverflowError) as exc:  # e.g. a counter beyond 64 bits
            frame = _wire.encode_frame([rid, _wire.ERROR, f"cannot encode the answer: {exc}"])
        await conn.frames.send(*frame)


__all__ = ["DEFAULT_PORT", "TCPStoreServer"]
