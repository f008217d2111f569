"""A store on a Redis server, through ``redis.asyncio`` (``pip install aiocollect[redis]``).

Values are plain Redis strings under the given keys (wrap the store in a
:class:`~aiocollect.store.prefix.PrefixStore` to share a database); ``add`` is ``INCRBY``.
``get``/``wait`` poll with a backoff from 5 ms to 50 ms: keyspace notifications are off by
default on most servers and pub/sub would need a dedicated connection per waiter, while
rendezvous needs only a handful of short waits.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from aiocollect._deadline import Deadline
from aiocollect.errors import StoreError, UsageError
from aiocollect.store._util import (
    POLL_MIN,
    Lifecycle,
    backoff,
    check_amount,
    check_key,
    check_keys,
    check_value,
    timeout_error,
    unique,
)
from aiocollect.store.base import DEFAULT_TIMEOUT, Store

INSTALL_HINT = "install the Redis client with `pip install aiocollect[redis]`"


def _redacted(url: str) -> str:
    """``url`` without its password, for messages."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at:
        return url
    user = creds.partition(":")[0]
    return f"{scheme}{sep}{user}:***@{host}"


class RedisStore(Store):
    """A store on Redis.

    Args:
        url: ``redis://[[user]:password@]host:port/db`` (``rediss://`` for TLS,
            ``unix://`` for a socket), as understood by ``redis.asyncio.from_url``.
        timeout: default timeout in seconds for ``get``/``wait``.
        connect_timeout: seconds to wait for the Redis connection itself.

    Raises:
        StoreError: the ``redis`` package is missing (the message says how to install it).
        UsageError: ``url`` is not a Redis URL.

    The connection opens lazily; failures of the server raise ``StoreError``.
    """

    def __init__(
        self, url: str, *, timeout: float = DEFAULT_TIMEOUT, connect_timeout: float = 10.0
    ) -> None:
        try:
            import redis.asyncio as aioredis
        except ImportError as exc:
            raise StoreError(f"RedisStore needs the redis package: {INSTALL_HINT}") from exc
        self.url = url
        self.timeout = timeout
        self._life = Lifecycle(repr(self))
        try:
            self._client: Any = aioredis.from_url(
                url, decode_responses=False, socket_connect_timeout=connect_timeout
            )
        except ValueError as exc:
            raise UsageError(f"bad Redis URL {_redacted(url)!r}: {exc}") from exc

    def __repr__(self) -> str:
        return f"RedisStore({_redacted(self.url)!r})"

    @property
    def shared_reads(self) -> Hashable:
        """The server's URL (:attr:`Store.shared_reads`)."""
        return ("redis", self.url)

    async def _call(self, what: str, command: str, *args: object) -> Any:
        """Run one Redis command, mapping client errors to StoreError."""
        from redis.exceptions import RedisError

        self._life.ensure_open()
        try:
            return await self._life.guard(self._client.execute_command(command, *args))
        except (RedisError, OSError) as exc:
            raise StoreError(f"{self!r}: {what} failed: {exc}") from exc

    async def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key`` (``SET``).

        Raises:
            UsageError: bad key or value type.
            StoreError: Redis failed or the store is closed.
        """
        await self._call(f"set({key!r})", "SET", check_key(key), check_value(value))

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, polling until it appears.

        Raises:
            StoreTimeout: the key did not appear in time.
            StoreError: Redis failed or the store is closed (also while waiting).
        """
        check_key(key)
        t = self._timeout(timeout)
        deadline = Deadline.after(t)
        delay = POLL_MIN
        while True:
            value = await self._call(f"get({key!r})", "GET", key)
            if value is not None:
                return bytes(value)
            if not await self._pause(deadline, delay):
                raise timeout_error(repr(self), [key], t)
            delay = backoff(delay)

    async def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (``INCRBY``).

        Raises:
            StoreError: the value is not an integer, Redis failed, or the store is closed.
        """
        total = await self._call(f"add({key!r})", "INCRBY", check_key(key), check_amount(amount))
        return int(total)

    async def wait(self, keys: Sequence[str], *, timeout: float | None = None) -> None:
        """Wait until every key exists, polling.

        Raises:
            StoreTimeout: some keys did not appear in time (``.keys`` lists them).
            StoreError: Redis failed or the store is closed (also while waiting).
        """
        missing = unique(check_keys(keys))
        t = self._timeout(timeout)
        deadline = Deadline.after(t)
        delay = POLL_MIN
        while missing:
            present = await self._exists(missing)
            missing = [k for k, there in zip(missing, present, strict=True) if not there]
            if not missing:
                return
            if not await self._pause(deadline, delay):
                raise timeout_error(repr(self), missing, t)
            delay = backoff(delay)

    async def multi_get(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes]:
        """The values of ``keys`` in order (``MGET``), polling for the ones still missing.

        Raises:
            StoreTimeout: some keys did not appear in time (``.keys`` lists them).
            StoreError: Redis failed or the store is closed (also while waiting).
            UsageError: ``keys`` is a ``str`` or holds a non-``str`` item.
        """
        names = check_keys(keys)
        self._life.ensure_open()
        t = self._timeout(timeout)
        deadline = Deadline.after(t)
        found: dict[str, bytes] = {}
        missing = unique(names)
        delay = POLL_MIN
        while missing:
            values = await self._call(f"multi_get({len(missing)} keys)", "MGET", *missing)
            for key, value in zip(missing, values, strict=True):
                if value is not None:
                    found[key] = bytes(value)
            missing = [k for k in missing if k not in found]
            if not missing:
                break
            if not await self._pause(deadline, delay):
                raise timeout_error(repr(self), missing, t)
            delay = backoff(delay)
        return [found[k] for k in names]

    async def check(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists now."""
        return await self._exists(check_keys(keys))

    async def _exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            self._life.ensure_open()
            return []
        from redis.exceptions import RedisError

        self._life.ensure_open()
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(key)
                counts = await self._life.guard(pipe.execute())
        except (RedisError, OSError) as exc:
            raise StoreError(f"{self!r}: check failed: {exc}") from exc
        return [bool(c) for c in counts]

    async def delete(self, key: str) -> bool:
        """Remove ``key`` (``DEL``); return whether it existed."""
        return bool(await self._call(f"delete({key!r})", "DEL", check_key(key)))

    async def close(self) -> None:
        """Close the Redis connections; pending waits fail with ``StoreError``. Idempotent."""
        if self._life.close():
            close = getattr(self._client, "aclose", None) or self._client.close
            await close()

    async def _pause(self, deadline: Deadline, delay: float) -> bool:
        """Sleep before the next poll; False if the deadline has passed."""
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            return False
        await self._life.sleep(delay if remaining is None else min(delay, remaining))
        return True
