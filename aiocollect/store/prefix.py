"""A namespaced view of another store."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from aiocollect.errors import StoreTimeout, UsageError
from aiocollect.store._util import Lifecycle, check_key, check_keys
from aiocollect.store.base import Store


class PrefixStore(Store):
    """Every key of this view is stored as ``prefix + "/" + key`` in ``store``.

    Sub-groups and separate groups on one store use it to keep their keys apart. Closing the
    view does not close ``store`` (several views usually share it); it fails the view's own
    pending waits with ``StoreError`` and refuses later calls.

    Args:
        prefix: the namespace; must be a ``str``.
        store: the underlying store. ``timeout=None`` calls use its default timeout.

    Raises:
        UsageError: ``prefix`` is not a ``str`` or ``store`` is not a :class:`Store`.
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise UsageError(f"PrefixStore prefix must be str, not {type(prefix).__name__}")
        if not isinstance(store, Store):
            raise UsageError(f"PrefixStore needs a Store, not {type(store).__name__}")
        self.prefix = prefix
        self.store = store
        self.timeout = store.timeout  # informative: timeout=None defers to ``store`` anyway
        self._head = prefix + "/"
        self._life = Lifecycle(repr(self))

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.store!r})"

    @property
    def shared_reads(self) -> Hashable | None:
        """The inner store's, with the prefix (:attr:`Store.shared_reads`)."""
        inner = self.store.shared_reads
        return None if inner is None else ("prefix", inner, self.prefix)

    def _key(self, key: str) -> str:
        return self._head + check_key(key)

    def _strip(self, exc: StoreTimeout) -> StoreTimeout:
        """The same timeout with the view's key names."""
        n = len(self._head)
        keys = [k[n:] if k.startswith(self._head) else k for k in exc.keys]
        new = StoreTimeout(str(exc).replace(self._head, ""), keys)
        new.__cause__ = exc
        return new

    async def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under the prefixed ``key`` (errors as the underlying store)."""
        self._life.ensure_open()
        await self.store.set(self._key(key), value)

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        """The value of the prefixed ``key``, waiting for it.

        Raises:
            StoreTimeout: not set in time; ``.keys`` names the key without the prefix.
            StoreError: the view or the underlying store is closed or failed.
        """
        self._life.ensure_open()
        try:
            return await self._life.guard(self.store.get(self._key(key), timeout=timeout))
        except StoreTimeout as exc:
            raise self._strip(exc) from exc.__cause__

    async def add(self, key: str, amount: int) -> int:
        """Atomically add to the prefixed counter ``key``; return the new value."""
        self._life.ensure_open()
        return await self.store.add(self._key(key), amount)

    async def wait(self, keys: Sequence[str], *, timeout: float | None = None) -> None:
        """Wait until every prefixed key exists.

        Raises:
            StoreTimeout: some keys were not set in time (``.keys`` without the prefix).
            StoreError: the view or the underlying store is closed or failed.
        """
        self._life.ensure_open()
        names = [self._key(k) for k in check_keys(keys)]
        try:
            await self._life.guard(self.store.wait(names, timeout=timeout))
        except StoreTimeout as exc:
            raise self._strip(exc) from exc.__cause__

    async def multi_get(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes]:
        """The values of the prefixed ``keys`` in order (one ``multi_get`` of the
        underlying store).

        Raises:
            StoreTimeout: some keys were not set in time (``.keys`` without the prefix).
            StoreError: the view or the underlying store is closed or failed.
        """
        self._life.ensure_open()
        names = [self._key(k) for k in check_keys(keys)]
        try:
            return await self._life.guard(self.store.multi_get(names, timeout=timeout))
        except StoreTimeout as exc:
            raise self._strip(exc) from exc.__cause__

    async def check(self, keys: Sequence[str]) -> list[bool]:
        """Whether each prefixed key exists now."""
        self._life.ensure_open()
        return await self.store.check([self._key(k) for k in check_keys(keys)])

    async def delete(self, key: str) -> bool:
        """Remove the prefixed ``key``; return whether it existed."""
        self._life.ensure_open()
        return await self.store.delete(self._key(key))

    async def close(self) -> None:
        """Close this view only (see the class docstring). Idempotent."""
        self._life.close()
