"""An aiocollect :class:`~aiocollect.store.base.Store` over a ``torch.distributed.Store``.

torch hands every process-group creator a c10d store (torchrun's TCPStore behind a
PrefixStore per group). :class:`TorchStore` lets aiocollect's rendezvous use it, so no second
store or port is needed. c10d store calls block, so each one runs in the loop's default
thread executor.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from torch._C._distributed_c10d import Store as C10dStore

from aiocollect.errors import StoreError, StoreTimeout, UsageError
from aiocollect.store.base import Store

T = TypeVar("T")


class TorchStore(Store):
    """Adapter from a c10d ``Store`` (TCPStore, FileStore, HashStore, PrefixStore...).

    Args:
        store: the c10d store; it is shared, never closed by this adapter.
        timeout: default seconds for ``get``/``wait`` when called with ``timeout=None``.

    Raises:
        UsageError: ``store`` is not a ``torch.distributed.Store``.
    """

    def __init__(self, store: C10dStore, timeout: float = 300.0) -> None:
        if not isinstance(store, C10dStore):
            raise UsageError(f"TorchStore needs a torch.distributed.Store, not "
                             f"{type(store).__name__}")
        self.torch_store = store
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"TorchStore({type(self.torch_store).__name__})"

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, functools.partial(fn, *args))
        except (RuntimeError, ValueError) as exc:  # DistStoreError is a RuntimeError
            raise StoreError(f"{self!r}: {fn.__name__} failed: {exc}") from exc

    def _exists(self, key: str) -> bool:
        return bool(self.torch_store.check([key]))

    async def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key`` (StoreError when the c10d store fails)."""
        await self._call(self.torch_store.set, key, value)

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it.

        Raises:
            StoreTimeout: the key did not appear in time. StoreError: the store failed.
        """
        await self.wait([key], timeout=timeout)
        value = await self._call(self.torch_store.get, key)
        return bytes(value)

    async def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key``; return the new value."""
        return int(await self._call(self.torch_store.add, key, amount))

    def _wait_blocking(self, keys: list[str], seconds: float) -> list[str]:
        """Wait in an executor thread; return the keys still missing (empty on success)."""
        if seconds > 0:
            try:
                self.torch_store.wait(keys, timedelta(seconds=seconds))
                return []
            except RuntimeError:
                pass  # a timeout (DistStoreError); find out which keys are missing below
        return [k for k in keys if not self._exists(k)]

    async def wait(self, keys: Sequence[str], *, timeout: float | None = None) -> None:
        """Wait until every key exists.

        Raises:
            StoreTimeout: some keys were not set in time (``.keys`` lists them).
            StoreError: the store failed.
        """
        names = list(keys)
        if not names:
            return
        seconds = self._timeout(timeout)
        missing = await self._call(self._wait_blocking, names, seconds)
        if missing:
            raise StoreTimeout(f"{self!r}: keys {missing} not set within {seconds:g} s",
                               missing)

    async def check(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists now."""
        names = list(keys)
        return await self._call(lambda: [self._exists(k) for k in names])

    async def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed (StoreError if the store cannot)."""
        return bool(await self._call(self.torch_store.delete_key, key))
