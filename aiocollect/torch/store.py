"""An aiocollect :class:`~aiocollect.store.base.Store` over a ``torch.distributed.Store``.

torch hands every process-group creator a c10d store (torchrun's TCPStore behind a
PrefixStore per group). :class:`TorchStore` lets aiocollect's rendezvous use it, so no second
store or port is needed. c10d store calls block, so each one runs in the loop's default
thread executor. ``wait`` (and ``get``) poll with ``check`` instead of blocking in c10d's
own wait: a c10d client serves one blocking call at a time, so a pending wait would stall
every other call on the same store, and could not be ended by ``close``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch._C._distributed_c10d import Store as C10dStore

from aiocollect._deadline import Deadline
from aiocollect.errors import StoreError, UsageError
from aiocollect.store._util import (
    POLL_MAX,
    POLL_MIN,
    Lifecycle,
    check_amount,
    check_key,
    check_keys,
    check_value,
    timeout_error,
    unique,
)
from aiocollect.store.base import Store

T = TypeVar("T")


class TorchStore(Store):
    """Adapter from a c10d ``Store`` (TCPStore, FileStore, HashStore, PrefixStore...).

    Args:
        store: the c10d store; it is shared, never closed by this adapter.
        timeout: default seconds for ``get``/``wait`` when called with ``timeout=None``.

    ``close`` fails pending and later calls of this adapter with StoreError; the c10d
    store itself stays open for its owner.

    Raises:
        UsageError: ``store`` is not a ``torch.distributed.Store``.
    """

    def __init__(self, store: C10dStore, timeout: float = 300.0) -> None:
        if not isinstance(store, C10dStore):
            raise UsageError(
                f"TorchStore needs a torch.distributed.Store, not {type(store).__name__}"
            )
        self.torch_store = store
        self.timeout = timeout
        self._life = Lifecycle(repr(self))

    def __repr__(self) -> str:
        return f"TorchStore({type(self.torch_store).__name__})"

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        self._life.ensure_open()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, functools.partial(fn, *args))
        except (RuntimeError, ValueError) as exc:  # DistStoreError is a RuntimeError
            raise StoreError(f"{self!r}: {fn.__name__} failed: {exc}") from exc

    def _exists(self, key: str) -> bool:
        return bool(self.torch_store.check([key]))

    async def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key``.

        Args:
            key: the key.
            value: the bytes to store.

        Raises:
            UsageError: ``key`` is not a str or ``value`` not bytes-like.
            StoreError: the c10d store failed, or this adapter is closed.
        """
        data = check_value(value)
        await self._call(self._set, check_key(key), data)

    def _set(self, key: str, value: bytes) -> None:
        """c10d's TCPStore client does not wait for a set to be applied, so another client
        could still read the old value; a round trip on the same connection afterwards
        (the server handles one connection's requests in order) makes it visible."""
        self.torch_store.set(key, value)  # type: ignore[arg-type]  # pybind11 takes bytes
        self.torch_store.check([key])

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it.

        Args:
            key: the key.
            timeout: seconds to wait (None: the adapter's timeout).

        Returns:
            The value.

        Raises:
            StoreTimeout: the key did not appear in time.
            StoreError: the store failed or this adapter was closed (also while waiting).
            UsageError: ``key`` is not a str.
        """
        name = check_key(key)
        await self.wait([name], timeout=timeout)
        value = await self._call(self.torch_store.get, name)
        return bytes(value)

    async def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key``.

        Args:
            key: the counter's key (created at 0).
            amount: what to add.

        Returns:
            The new value.

        Raises:
            UsageError: ``key`` is not a str or ``amount`` not an int.
            StoreError: the value is not a counter, the store failed, or it is closed.
        """
        return int(await self._call(self.torch_store.add, check_key(key), check_amount(amount)))

    def _missing(self, keys: list[str]) -> list[str]:
        return [k for k in keys if not self._exists(k)]

    async def wait(self, keys: Sequence[str], *, timeout: float | None = None) -> None:
        """Wait until every key exists, checking with a backoff of POLL_MIN to POLL_MAX
        seconds between looks.

        Args:
            keys: the keys.
            timeout: seconds to wait (None: the adapter's timeout).

        Raises:
            StoreTimeout: some keys were not set in time (``.keys`` lists them).
            StoreError: the store failed, or this adapter was closed (also while waiting).
            UsageError: ``keys`` is a str or holds a non-str.
        """
        names = unique(check_keys(keys))
        self._life.ensure_open()
        seconds = self._timeout(timeout)
        deadline = Deadline.after(seconds)
        delay = POLL_MIN
        while names:
            names = await self._call(self._missing, names)
            if not names:
                return
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise timeout_error(repr(self), names, seconds)
            await self._life.sleep(delay if remaining is None else min(delay, remaining))
            delay = min(delay * 2, POLL_MAX)

    async def check(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists now.

        Args:
            keys: the keys.

        Returns:
            One bool per key.

        Raises:
            UsageError: ``keys`` is a str or holds a non-str.
            StoreError: as for ``set``.
        """
        names = check_keys(keys)
        return await self._call(lambda: [self._exists(k) for k in names])

    async def delete(self, key: str) -> bool:
        """Remove ``key``.

        Args:
            key: the key.

        Returns:
            Whether it existed.

        Raises:
            UsageError: ``key`` is not a str.
            StoreError: as for ``set``.
        """
        return bool(await self._call(self.torch_store.delete_key, check_key(key)))

    async def close(self) -> None:
        """Fail pending waits and every later call of this adapter with StoreError
        (idempotent); the c10d store is left open."""
        self._life.close()
