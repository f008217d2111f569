"""The TCP store client.

:class:`TCPStore` keeps one connection; concurrent requests are multiplexed by request id
and answered by a reader task the client owns. Waits happen on the server (with the
caller's deadline); the client adds a small grace period so the server's answer, which
names the missing keys, normally arrives first. Large values are sent and received in
chunks (:mod:`aiocollect.store._stream`), so the loop runs between them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable, Sequence
from typing import Any

from aiocollect import _auth
from aiocollect.errors import (
    AuthenticationError,
    ProtocolError,
    StoreError,
    StoreTimeout,
    UsageError,
)
from aiocollect.store import _stream, _wire
from aiocollect.store._util import (
    Lifecycle,
    check_amount,
    check_key,
    check_keys,
    check_value,
    timeout_error,
)
from aiocollect.store.base import DEFAULT_TIMEOUT, Store
from aiocollect.store.tcp_server import TCPStoreServer

#: Extra seconds the client waits beyond a ``get``/``wait`` timeout for the server's answer.
WAIT_GRACE = 2.0


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class TCPStore(Store):
    """Client of a :class:`TCPStoreServer` (the embedded one or ``aiocollect store``).

    The connection is opened by :meth:`connect` or, lazily, by the first operation. It is
    not re-established once lost: every pending and later request then fails with
    :class:`StoreError`.

    Args:
        host: server address.
        port: server port.
        secret: shared secret, proven with HMAC challenge-response before any request.
        timeout: default timeout in seconds for ``get``/``wait``, for answers to the other
            requests, and for :meth:`connect`.
        max_frame: largest message sent or accepted, in bytes.

    Attributes:
        server: the embedded server this client owns (closed by :meth:`close`), or None.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        secret: bytes | str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_frame: int = _wire.MAX_FRAME,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.server: TCPStoreServer | None = None
        self._secret = _auth.as_secret(secret)
        self._max_frame = max_frame
        self._life = Lifecycle(repr(self))
        self._connect_lock = asyncio.Lock()
        self._writer: asyncio.StreamWriter | None = None
        self._frames: _stream.FrameWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[tuple[int, Any]]] = {}
        self._next_rid = 1
        self._failure: StoreError | None = None
        #: The server's protocol version (known once connected).
        self._version = _wire.VERSION

    @property
    def address(self) -> str:
        """``host:port`` of the server."""
        return format_address(self.host, self.port)

    def __repr__(self) -> str:
        return f"TCPStore({self.address!r})"

    @property
    def shared_reads(self) -> Hashable:
        """The server's address (:attr:`Store.shared_reads`)."""
        return ("tcp", self.host, self.port)

    # -- connection -----------------------------------------------------------------------

    async def connect(self, *, timeout: float | None = None) -> None:
        """Open the connection and authenticate (one attempt). No-op when connected.

        Args:
            timeout: seconds for the attempt (None: the store's ``timeout``).

        Raises:
            StoreError: refused (by a store in protected mode: the message says how to set
                a secret), unreachable, or not an aiocollect store.
            StoreTimeout: no answer within ``timeout`` (default: the store's timeout).
            AuthenticationError: the secret was not proven by one side.
        """
        t = self._timeout(timeout)
        try:
            await self._open(t)
        except TimeoutError:
            msg = f"the TCP store at {self.address} did not answer within {t:g}s"
            raise StoreTimeout(msg) from None
        except (OSError, asyncio.IncompleteReadError) as exc:
            msg = f"cannot connect to the TCP store at {self.address}: {describe_error(exc)}"
            raise StoreError(msg) from exc

    async def _open(self, timeout: float) -> None:
        """Connect and shake hands; raw ``OSError``/``TimeoutError``/``IncompleteReadError``
        mean "try again later", the aiocollect errors do not."""
        async with self._connect_lock:
            self._life.ensure_open()
            if self._failure is not None:
                raise StoreError(str(self._failure)) from self._failure.__cause__
            if self._writer is not None:
                return
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(self.host, self.port)
                try:
                    await self._handshake(reader, writer)
                except BaseException:
                    writer.transport.abort()
                    raise
            self._writer = writer
            self._frames = _stream.FrameWriter(writer)
            self._reader_task = asyncio.create_task(
                self._read_loop(reader), name=f"aiocollect store reader {self.address}"
            )

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await _wire.read_frame(reader, _wire.MAX_HANDSHAKE_FRAME)
            self._version, nonce_s = _wire.parse_hello(hello)
        except _wire.Refused as exc:
            raise StoreError(
                f"the TCP store at {self.address} refused this connection: {exc}"
            ) from None
        except ProtocolError as exc:
            raise StoreError(f"{self.address} is not an aiocollect TCP store: {exc}") from exc
        if nonce_s is None:
            if self._secret is not None:
                raise AuthenticationError(
                    f"the TCP store at {self.address} does not require a secret but we have one;"
                    " start it with the same secret"
                )
            writer.writelines(_wire.encode(_wire.NO_PROOF))
            await writer.drain()
            return
        if self._secret is None:
            raise AuthenticationError(
                f"the TCP store at {self.address} requires a secret; pass secret= or set"
                " AIOCOLLECT_SECRET"
            )
        nonce_c = _auth.new_nonce()
        writer.writelines(_wire.encode(_wire.client_proof(self._secret, nonce_c, nonce_s)))
        await writer.drain()
        try:
            verdict = await _wire.read_frame(reader, _wire.MAX_HANDSHAKE_FRAME)
        except ProtocolError as exc:
            raise AuthenticationError(f"TCP store at {self.address}: {exc}") from exc
        reason = _wire.check_server_verdict(self._secret, nonce_c, nonce_s, verdict)
        if reason is not None:
            raise AuthenticationError(f"TCP store at {self.address}: {reason}")

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                # Answers carry a few bytes more than the request that was within the limit.
                msg = await _stream.read_frame(reader, self._max_frame + 1024)
                rid, status, payload = _wire.parse_response(msg)
                fut = self._pending.get(rid)
                if fut is not None and not fut.done():
                    fut.set_result((status, payload))
        except (OSError, asyncio.IncompleteReadError, ProtocolError) as exc:
            self._fail(describe_error(exc), exc)

    def _fail(self, reason: str, cause: BaseException | None) -> None:
        """Mark the connection dead and fail every pending request with StoreError."""
        if self._failure is None:
            msg = f"connection to the TCP store at {self.address} lost: {reason}"
            self._failure = StoreError(msg)
            self._failure.__cause__ = cause
        for fut in self._pending.values():
            if not fut.done():
                err = StoreError(str(self._failure))
                err.__cause__ = cause
                fut.set_exception(err)
        if self._writer is not None:
            self._writer.transport.abort()

    async def close(self) -> None:
        """Close the connection (pending requests fail with ``StoreError``) and stop the
        embedded server if this client owns one. Idempotent."""
        if not self._life.close():
            return
        self._fail("the client was closed", None)
        if self._frames is not None:
            await self._frames.aclose()
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        if self.server is not None:
            await self.server.close()

    # -- requests -------------------------------------------------------------------------

    async def _request(
        self, op: str, *args: object, keys: Sequence[str], wait: float | None = None
    ) -> Any:
        """Send one request and return the OK payload.

        ``wait`` is the server-side timeout of a get/wait (None: not a waiting request).
        """
        self._life.ensure_open()
        for key in keys:  # only a key of over a quarter of the limit can have too many bytes
            if len(key) > _wire.MAX_KEY_BYTES // 4 and len(key.encode()) > _wire.MAX_KEY_BYTES:
                raise UsageError(
                    f"{op}: a TCP store key has at most {_wire.MAX_KEY_BYTES} "
                    f"bytes, {key[:40]!r}... has more"
                )
        if len(keys) > _wire.MAX_KEYS:
            raise UsageError(
                f"{op}: a TCP store request names at most {_wire.MAX_KEYS} keys, not {len(keys)}"
            )
        if self._writer is None:
            await self.connect()
        if self._failure is not None:
            raise StoreError(str(self._failure)) from self._failure.__cause__
        frames = self._frames
        assert frames is not None
        rid = self._next_rid
        self._next_rid += 1
        try:
            head, blob = _wire.encode_frame([rid, op, *args])
        except (TypeError, ValueError, OverflowError) as exc:
            raise UsageError(f"{op}: cannot encode the request: {exc}") from None
        size = len(head) - _wire.HEADER.size + len(blob)
        if size > self._max_frame:
            raise StoreError(
                f"{op}: request of {size} bytes exceeds the limit of {self._max_frame}"
            )
        limit = self.timeout if wait is None else wait + WAIT_GRACE
        fut: asyncio.Future[tuple[int, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        cm = asyncio.timeout(limit)
        try:
            async with cm:
                await frames.send(head, blob)
                status, payload = await fut
        except TimeoutError:
            if not cm.expired():
                raise
            self._abandon(rid, wait)
            raise StoreTimeout(
                f"the TCP store at {self.address} did not answer {op} within {limit:g}s", keys
            ) from None
        except ConnectionError as exc:
            self._fail(describe_error(exc), exc)
            raise StoreError(str(self._failure)) from exc
        except asyncio.CancelledError:
            self._abandon(rid, wait)
            raise
        finally:
            self._pending.pop(rid, None)
        if status == _wire.OK:
            return payload
        if status == _wire.TIMEOUT:
            listed = payload if isinstance(payload, list) else []
            missing = [k for k in listed if isinstance(k, str)]
            raise timeout_error(repr(self), missing or list(keys), wait)
        raise StoreError(f"TCP store at {self.address}: {payload}")

    def _abandon(self, rid: int, wait: float | None) -> None:
        """Tell the server to drop a waiting request we no longer care about."""
        if wait is None or self._failure is not None or self._frames is None:
            return
        cancel_rid = self._next_rid
        self._next_rid += 1
        with contextlib.suppress(Exception):
            self._frames.send_nowait(*_wire.encode_frame([cancel_rid, "cancel", rid]))

    def _expect(self, payload: Any, kind: type | tuple[type, ...], op: str) -> Any:
        if not isinstance(payload, kind):
            err = ProtocolError(f"unexpected answer to {op}: {type(payload).__name__}")
            self._fail(str(err), err)
            raise StoreError(str(self._failure)) from err
        return payload

    async def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key``.

        Raises:
            UsageError: bad key or value type.
            StoreError: connection failed or closed, the value exceeds the size limit, or
                the store's quota is exceeded (the connection stays usable then).
            StoreTimeout: no answer within the store's timeout.
        """
        await self._request("set", check_key(key), check_value(value), keys=[key])

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        """Return the value of ``key``; the server waits for it (no polling).

        Raises:
            StoreTimeout: the key was not set in time.
            StoreError: connection failed or closed (also while waiting).
        """
        t = self._timeout(timeout)
        payload = await self._request("get", check_key(key), t, keys=[key], wait=t)
        value: bytes | memoryview = self._expect(payload, (bytes, memoryview), "get")
        return value if isinstance(value, bytes) else bytes(value)  # a large one: one copy

    async def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key``; return the new value.

        Raises:
            StoreError: the existing value is not an integer, the store's quota is
                exceeded, or the connection failed.
        """
        payload = await self._request("add", check_key(key), check_amount(amount), keys=[key])
        total: int = self._expect(payload, int, "add")
        return total

    async def wait(self, keys: Sequence[str], *, timeout: float | None = None) -> None:
        """Wait until every key exists; the server waits (no polling).

        Raises:
            StoreTimeout: some keys were not set in time (``.keys`` lists them).
            StoreError: connection failed or closed (also while waiting).
        """
        names = check_keys(keys)
        t = self._timeout(timeout)
        await self._request("wait", names, t, keys=names, wait=t)

    async def multi_get(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes]:
        """The values of ``keys`` in order, in one request; the server waits until every
        one exists (no polling). A server of protocol version 2 (without ``multi_get``) is
        asked with ``wait`` and one ``get`` per key instead.

        Raises:
            StoreTimeout: some keys were not set in time (``.keys`` lists them).
            StoreError: the connection failed or closed (also while waiting), or the
                values are too large for one answer (over the server's ``max_frame``:
                ask for fewer keys at a time).
            UsageError: ``keys`` is a ``str``, holds a non-``str`` item, or names more than
                16384 keys.
        """
        names = check_keys(keys)
        if not names:
            self._life.ensure_open()
            return []
        if self._writer is None:
            await self.connect()
        if self._version < _wire.MULTI_GET_VERSION:
            return await super().multi_get(names, timeout=timeout)
        t = self._timeout(timeout)
        payload = await self._request("multi_get", names, t, keys=names, wait=t)
        values: list[Any] = self._expect(payload, list, "multi_get")
        if len(values) != len(names) or not all(isinstance(v, bytes | memoryview) for v in values):
            self._expect(None, list, "multi_get")
        return [v if isinstance(v, bytes) else bytes(v) for v in values]

    async def check(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists now."""
        names = check_keys(keys)
        payload = self._expect(await self._request("check", names, keys=names), list, "check")
        if len(payload) != len(names) or not all(isinstance(b, bool) for b in payload):
            self._expect(None, list, "check")
        return list(payload)

    async def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""
        existed: bool = self._expect(
            await self._request("delete", check_key(key), keys=[key]), bool, "delete"
        )
        return existed


def describe_error(exc: BaseException) -> str:
    """A short reason for a connection failure, for messages."""
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the server closed the connection"
    return str(exc) or type(exc).__name__


__all__ = ["WAIT_GRACE", "TCPStore", "describe_error", "format_address"]
