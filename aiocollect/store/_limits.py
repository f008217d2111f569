"""Limits of the TCP store server: the budget of large frames in flight and the quota of
what is stored (see :class:`aiocollect.store.tcp_server.TCPStoreServer`)."""

from __future__ import annotations

import asyncio
import contextlib

from aiocollect.errors import StoreError
from aiocollect.store.memory import KeyTable, Value


class Budget:
    """Bytes of large frames being received at once, shared by every connection.

    A frame reserves its announced size before its body is read and releases it once
    read; a frame that does not fit waits (the stream's buffer then fills and TCP pushes
    back on that client). One frame alone always fits, so nothing waits for ever; a sender
    that stalls mid-frame is cut off by the idle timeout, which releases its share.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._waiters: list[asyncio.Future[None]] = []

    async def acquire(self, n: int) -> None:
        while self.used and self.used + n > self.total:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
        self.used += n

    def release(self, n: int) -> None:
        self.used -= n
        waiters, self._waiters = self._waiters, []
        for fut in waiters:  # each checks again whether it fits now
            if not fut.done():
                fut.set_result(None)


class Quota:
    """What the table holds: bytes (keys and values) and keys, against their limits."""

    def __init__(self, table: KeyTable, max_bytes: int, max_keys: int) -> None:
        self.table = table
        self.max_bytes = max_bytes
        self.max_keys = max_keys
        self.bytes = 0

    def _exceeded(self, key: str, nbytes: int, nkeys: int) -> StoreError:
        return StoreError(
            f"store quota exceeded: storing {key[:80]!r} would make {nbytes} bytes in "
            f"{nkeys} keys, over the limit of {self.max_bytes} bytes / {self.max_keys} "
            "keys (delete keys you no longer need, or raise the limits: "
            "`aiocollect store --max-bytes/--max-keys`, TCPStoreServer(max_bytes=, "
            "max_keys=))"
        )

    def set(self, key: str, value: Value) -> None:
        """Store ``value``, or raise StoreError if that would exceed a limit."""
        old = self.table.get_now(key)
        was = 0 if old is None else len(key) + len(old)
        nbytes = self.bytes - was + len(key) + len(value)
        nkeys = len(self.table) + (old is None)
        if nbytes > self.max_bytes or nkeys > self.max_keys:
            raise self._exceeded(key, nbytes, nkeys)
        self.table.set(key, value)
        self.bytes = nbytes

    def add(self, key: str, amount: int) -> int:
        """Add to the counter, or raise StoreError if a new key would exceed a limit."""
        old = self.table.get_now(key)
        was = 0 if old is None else len(key) + len(old)
        nkeys = len(self.table) + (old is None)
        if self.bytes - was + len(key) + 24 > self.max_bytes or nkeys > self.max_keys:
            raise self._exceeded(key, self.bytes - was + len(key) + 24, nkeys)
        total = self.table.add(key, amount)
        new = self.table.get_now(key)
        self.bytes += len(key) + (len(new) if new is not None else 0) - was
        return total

    def delete(self, key: str) -> bool:
        old = self.table.get_now(key)
        existed = self.table.delete(key)
        if existed and old is not None:
            self.bytes -= len(key) + len(old)
        return existed
