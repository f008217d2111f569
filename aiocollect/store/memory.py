"""In-process store: ranks that share a process (and usually one event loop) share a table.

:class:`KeyTable` is the key/value core with future-based waiting; the TCP store server
reuses it for its data, keeping large values as views of the frames they arrived in.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Hashable, Sequence
from typing import TypeAlias

from aiocollect._deadline import Deadline
from aiocollect.errors import UsageError
from aiocollect.store._util import (
    Lifecycle,
    check_amount,
    check_key,
    check_keys,
    check_value,
    parse_counter,
    timeout_error,
    unique,
    wake,
)
from aiocollect.store.base import DEFAULT_TIMEOUT, Store

#: A stored value: bytes, or a read-only view (of a received frame, kept uncopied).
Value: TypeAlias = bytes | memoryview


class KeyTable:
    """A dict of values whose waiters sleep on futures, woken by ``set``/``add``.

    A value is stored as given, never copied: ``bytes``, or a read-only ``memoryview``
    whose buffer nobody changes afterwards (the TCP server's received frames). Mutations
    are synchronous and atomic (a lock guards them, so tables may be shared by event loops
    in several threads); waiting is the only coroutine.
    """

    def __init__(self) -> None:
        self._values: dict[str, Value] = {}
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def set(self, key: str, value: Value) -> None:
        """Store ``value`` and wake everyone waiting for ``key``."""
        with self._lock:
            self._values[key] = value
            waiters = self._waiters.pop(key, ())
        for fut in waiters:
            wake(fut)

    def get_now(self, key: str) -> Value | None:
        """The value of ``key``, or None if it is not set."""
        return self._values.get(key)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (missing counts as 0); return the new value.

        Raises:
            StoreError: the existing value is not an integer counter.
        """
        with self._lock:
            total = parse_counter(key, self._values.get(key)) + amount
            self._values[key] = str(total).encode("ascii")
            waiters = self._waiters.pop(key, ())
        for fut in waiters:
            wake(fut)
        return total

    def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""
        with self._lock:
            return self._values.pop(key, None) is not None

    def check(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is set now."""
        return [k in self._values for k in keys]

    def values(self, keys: Sequence[str]) -> list[Value] | None:
        """The values of ``keys`` now, in order, or None if any is not set."""
        values = self._values
        found: list[Value] = []
        with self._lock:
            for key in keys:
                value = values.get(key)
                if value is None:
                    return None
                found.append(value)
        return found

    def missing(self, keys: Sequence[str]) -> list[str]:
        """The keys of ``keys`` not set now, without duplicates, in order."""
        return [k for k in unique(keys) if k not in self._values]

    async def wait(
        self, keys: Sequence[str], deadline: Deadline, lifecycle: Lifecycle | None = None
    ) -> list[str]:
        """Wait until every key is set or the deadline passes.

        Args:
            keys: the keys to wait for.
            deadline: when to give up.
            lifecycle: if given, closing it ends the wait with ``StoreError``.

        Returns:
            The keys still missing at the deadline (empty when all are set).

        Raises:
            StoreError: ``lifecycle`` was closed while waiting.

        Cancellation leaves the table unchanged.
        """
        loop = asyncio.get_running_loop()
        while True:
            fut: asyncio.Future[None] = loop.create_future()
            with self._lock:
                missing = self.missing(keys)
                if not missing:
                    return []
                for key in missing:
                    self._waiters.setdefault(key, set()).add(fut)
            try:
                if lifecycle is not None:
                    lifecycle.track(fut)
                remaining = deadline.remaining()
                if remaining is not None and remaining <= 0:
                    return missing
                try:
                    await asyncio.wait_for(fut, remaining)
                except TimeoutError:
                    return self.missing(keys)
            finally:
                if lifecycle is not None:
                    lifecycle.untrack(fut)
                self._forget(fut, missing)

    async def get(
        self, key: str, deadline: Deadline, lifecycle: Lifecycle | None = None
    ) -> Value | None:
        """The value of ``key``, waiting for it; None if the deadline passed first.

        Raises:
            StoreError: ``lifecycle`` was closed while waiting.
        """
        while True:
            value = self._values.get(key)
            if value is not None:
                return value
            if await self.wait([key], deadline, lifecycle):
                return None

    async def get_many(
        self, keys: Sequence[str], deadline: Deadline, lifecycle: Lifecycle | None = None
    ) -> tuple[list[Value], list[str]]:
        """The values of ``keys``, waiting until every one is set.

        Returns:
            ``(values, [])``, or ``([], missing)`` when the deadline passed first.

        Raises:
            StoreError: ``lifecycle`` was closed while waiting.
        """
        while True:
            found = self.values(keys)
            if found is not None:
                return found, []
            missing = await self.wait(keys, deadline, lifecycle)
            if missing:
                return [], missing

    def _forget(self, fut: asyncio.Future[None], keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                waiters = self._waiters.get(key)
                if waiters is not None:
                    waiters.discard(fut)
                    if not waiters:
                        del self._waiters[key]


_tables: weakref.WeakValueDictionary[str, KeyTable] = weakref.WeakValueDictionary()
_tables_lock = threading.Lock()


def _table(name: str) -> KeyTable:
    with _tables_lock:
        table = _tables.get(name)
        if table is None:
            table = _tables[name] = KeyTable()
        return table


class MemoryStore(Store):
    """A store living in this process; instances created with the same ``name`` share data.

    The data lives as long as at least one ``MemoryStore`` with that name exists, so ranks
    running on one event loop (or in threads of one process) can rendezvous through it.
    Waiting uses futures woken by the writer, never polling.

    Args:
        name: the shared table's name (``memory://NAME``).
        timeout: default timeout in seconds for ``get``/``wait``.

    Raises:
        UsageError: ``name`` is not a non-empty ``str``.
    """

    def __init__(self, name: str = "default", *, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not isinstance(name, str) or not name:
            raise UsageError(f"MemoryStore name must be a non-empty str, not {name!r}")
        self.name = name
        self.timeout = timeout
        self._table = _table(name)
        self._life = Lifecycle(f"MemoryStore({name!r})")

    def __repr__(self) -> str:
        return f"MemoryStore({self.name!r})"

    @property
    def shared_reads(self) -> Hashable:
        """The shared table (:attr:`Store.shared_reads`)."""
        return ("memory", id(self._table))

    async def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key`` (overwrites).

        Raises:
            UsageError: bad key or value type.
            StoreError: the store is closed.
        """
        self._life.ensure_open()
        self._table.set(check_key(key), check_value(value))

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` seconds for it.

        Raises:
            StoreTimeout: the key was not set in time.
            StoreError: the store is closed (also while waiting).
        """
        self._life.ensure_open()
        t = self._timeout(timeout)
        value = await self._table.get(check_key(key), Deadline.after(t), self._life)
        if value is None:
            raise timeout_error(repr(self), [key], t)
        return value if isinstance(value, bytes) else bytes(value)  # always bytes here

    async def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key``; return the new value.

        Raises:
            StoreError: the existing value is not an integer, or the store is closed.
        """
        self._life.ensure_open()
        return self._table.add(check_key(key), check_amount(amount))

    async def wait(self, keys: Sequence[str], *, timeout: float | None = None) -> None:
        """Wait until every key exists.

        Raises:
            StoreTimeout: some keys were not set in time (``.keys`` lists them).
            StoreError: the store is closed (also while waiting).
        """
        self._life.ensure_open()
        t = self._timeout(timeout)
        missing = await self._table.wait(check_keys(keys), Deadline.after(t), self._life)
        if missing:
            raise timeout_error(repr(self), missing, t)

    async def multi_get(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes]:
        """The values of ``keys`` in order, waiting up to ``timeout`` for every one.

        Raises:
            StoreTimeout: some keys were not set in time (``.keys`` lists them).
            StoreError: the store is closed (also while waiting).
            UsageError: ``keys`` is a ``str`` or holds a non-``str`` item.
        """
        self._life.ensure_open()
        t = self._timeout(timeout)
        found, missing = await self._table.get_many(check_keys(keys), Deadline.after(t), self._life)
        if missing:
            raise timeout_error(repr(self), missing, t)
        return [v if isinstance(v, bytes) else bytes(v) for v in found]

    async def check(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists now."""
        self._life.ensure_open()
        return self._table.check(check_keys(keys))

    async def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""
        self._life.ensure_open()
        return self._table.delete(check_key(key))

    async def close(self) -> None:
        """Detach this instance: pending waits fail with ``StoreError``; the shared data
        stays for other instances with the same name. Idempotent."""
        self._life.close()
