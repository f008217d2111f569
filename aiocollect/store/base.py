"""The Store contract shared by every backend.

A store is a small key/value service used for rendezvous: ranks publish their addresses and
wait for each other's. Keys are ``str``, values ``bytes``. All methods are coroutines.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence

from aiocollect.store._util import check_keys

DEFAULT_TIMEOUT = 300.0
"""Seconds a store operation waits when neither the call nor the store names a timeout."""


class Store(abc.ABC):
    """Abstract key/value store.

    Contract (checked by ``tests/store/test_conformance.py`` for every backend):

    - ``set`` overwrites; a value is published atomically (a reader sees all or nothing).
    - ``get`` waits until the key exists (up to ``timeout``) and returns its value.
    - ``add`` atomically adds to an integer counter (missing key counts as 0) and returns
      the new value; the counter's value is readable with ``get`` as ASCII decimal.
    - ``wait`` returns once every key exists.
    - ``multi_get`` waits until every key exists and returns their values in order: one
      request for many keys on backends that have a batched read (memory, file, tcp,
      redis, prefix); the default here, for any other store, is ``wait`` then ``get``.
    - ``delete`` removes a key and says whether it existed.
    - Timeouts raise :class:`~aiocollect.errors.StoreTimeout` naming the missing keys;
      backend failures raise :class:`~aiocollect.errors.StoreError`.
    - ``timeout=None`` means the store's default timeout.
    """

    timeout: float = DEFAULT_TIMEOUT

    @property
    def shared_reads(self) -> Hashable | None:
        """What names this store's data within this process: two store objects with the
        same value (not None) read the same value for a key, so the ranks of one event
        loop may share one read of records that never change (the rendezvous records of a
        job). None (the default): this object's reads are its own, as for a view that
        rewrites what it reads."""
        return None

    @abc.abstractmethod
    async def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key``, replacing any value it had.

        Args:
            key: the key.
            value: the bytes to publish; readers see all of them or none.

        Raises:
            UsageError: ``key`` is not a ``str`` or ``value`` not bytes.
            StoreError: the backend failed or the store is closed.
        """

    @abc.abstractmethod
    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting for it to appear.

        Args:
            key: the key.
            timeout: seconds to wait for it (None: the store's ``timeout``).

        Returns:
            The value last published under ``key``.

        Raises:
            StoreTimeout: the key did not appear in time.
            StoreError: the backend failed.
        """

    @abc.abstractmethod
    async def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key``; return the new value.

        Args:
            key: the counter; a missing key counts as 0.
            amount: what to add (may be negative or 0, to read the counter).

        Returns:
            The counter's value after the addition (``get`` reads it as ASCII decimal).

        Raises:
            StoreError: the backend failed, or ``key`` holds a value that is not a counter.
        """

    @abc.abstractmethod
    async def wait(self, keys: Sequence[str], *, timeout: float | None = None) -> None:
        """Wait until every key in ``keys`` exists.

        Args:
            keys: the keys to wait for.
            timeout: seconds to wait (None: the store's ``timeout``).

        Raises:
            StoreTimeout: some keys did not appear in time (``.keys`` lists them).
        """

    async def multi_get(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes]:
        """The values of ``keys``, in order, once every one exists (waiting up to
        ``timeout``); a key named twice gets its value twice, no keys get ``[]``.

        This default (``wait``, then one ``get`` per key) keeps every store working; the
        backends of this package override it with one batched request.

        Args:
            keys: the keys to read (a sequence of ``str``, not one ``str``).
            timeout: seconds to wait for the keys to exist; None: the store's default.

        Returns:
            Each key's value, in the order of ``keys``.

        Raises:
            StoreTimeout: some keys did not appear in time (``.keys`` lists them).
            StoreError: the backend failed.
            UsageError: ``keys`` is a ``str`` or holds a non-``str`` item.
        """
        names = check_keys(keys)
        if not names:
            return []
        await self.wait(names, timeout=timeout)
        return [await self.get(key, timeout=timeout) for key in names]

    @abc.abstractmethod
    async def check(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists now, without waiting.

        Args:
            keys: the keys to look up.

        Returns:
            One bool per key, in the order of ``keys``.
        """

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed.

        Args:
            key: the key to remove.

        Returns:
            True if ``key`` existed.
        """

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or servers owned by this store object."""

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout
