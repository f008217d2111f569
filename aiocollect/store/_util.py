"""Helpers shared by the store backends: argument checks, timeouts, close bookkeeping."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, TypeVar

from aiocollect.errors import StoreError, StoreTimeout, UsageError

T = TypeVar("T")

#: Backoff bounds (seconds) for backends that must poll (file, redis).
POLL_MIN = 0.005
POLL_MAX = 0.050


def check_key(key: object) -> str:
    """Return ``key`` if it is a ``str``.

    Raises:
        UsageError: ``key`` is not a ``str``.
    """
    if not isinstance(key, str):
        raise UsageError(f"store keys must be str, not {type(key).__name__}")
    return key


def check_keys(keys: Sequence[str]) -> list[str]:
    """Validate a sequence of keys (a bare ``str`` is refused: it is almost always a bug).

    Raises:
        UsageError: ``keys`` is a ``str`` or holds a non-``str`` item.
    """
    if isinstance(keys, str | bytes):
        raise UsageError("keys must be a sequence of str, not a single str")
    return [check_key(k) for k in keys]


def check_value(value: object) -> bytes:
    """Return ``value`` as ``bytes`` (bytes, bytearray and memoryview are accepted).

    Raises:
        UsageError: ``value`` is not bytes-like.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise UsageError(f"store values must be bytes, not {type(value).__name__}")


def check_amount(amount: object) -> int:
    """Return ``amount`` if it is an ``int`` (``bool`` is refused).

    Raises:
        UsageError: ``amount`` is not an ``int``.
    """
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise UsageError(f"add() amount must be int, not {type(amount).__name__}")
    return amount


def parse_counter(key: str, raw: bytes | memoryview | None) -> int:
    """Decode a counter's stored value (missing counts as 0).

    Raises:
        StoreError: the stored value is not an ASCII decimal integer.
    """
    if raw is None:
        return 0
    try:
        if len(raw) > 64:  # far longer than any 64-bit counter: not one
            raise ValueError
        return int(bytes(raw).decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise StoreError(f"add({key!r}): existing value is not an integer counter") from None


def unique(keys: Iterable[str]) -> list[str]:
    """``keys`` without duplicates, in first-seen order."""
    return list(dict.fromkeys(keys))


def timeout_error(where: str, missing: Sequence[str], timeout: float | None) -> StoreTimeout:
    """The :class:`StoreTimeout` every backend raises, naming the missing keys."""
    names = ", ".join(repr(k) for k in missing)
    plural = "key" if len(missing) == 1 else "keys"
    within = "" if timeout is None else f" within {timeout:g}s"
    return StoreTimeout(f"{plural} {names} not set in {where}{within}", missing)


class Lifecycle:
    """Open/closed state of one store object.

    Waits register a future here; :meth:`close` fails them with :class:`StoreError`, so a
    wait pending on a store that gets closed ends promptly instead of running to its
    deadline. Waits may come from several event loops (threads).
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.closed = False
        self._waiters: set[asyncio.Future[None]] = set()

    def ensure_open(self) -> None:
        """Raise :class:`StoreError` if the store was closed."""
        if self.closed:
            raise StoreError(f"{self.what} is closed")

    def track(self, fut: asyncio.Future[None]) -> None:
        """Fail ``fut`` with :class:`StoreError` if the store closes before it is done."""
        self.ensure_open()
        self._waiters.add(fut)

    def untrack(self, fut: asyncio.Future[None]) -> None:
        self._waiters.discard(fut)

    def close(self) -> bool:
        """Mark closed and fail pending waits; return False if it was already closed."""
        if self.closed:
            return False
        self.closed = True
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            wake(fut, StoreError(f"{self.what} was closed while waiting"))
        return True

    async def sleep(self, delay: float) -> None:
        """Sleep ``delay`` seconds, waking early with :class:`StoreError` on close.

        Raises:
            StoreError: the store was closed before or during the sleep.
        """
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.track(fut)
        try:
            await asyncio.wait_for(fut, delay)
        except TimeoutError:
            pass
        finally:
            self.untrack(fut)

    async def guard(self, aw: Awaitable[T]) -> T:
        """Run ``aw``, cancelling it and raising :class:`StoreError` if the store closes.

        Raises:
            StoreError: the store was closed before or while ``aw`` ran.
        """
        if self.closed and inspect.iscoroutine(aw):
            aw.close()  # never started: no "was never awaited" warning
        self.ensure_open()
        task = asyncio.ensure_future(aw)
        closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            self.track(closed)
            racers: list[asyncio.Future[Any]] = [task, closed]
            await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.untrack(closed)
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        exc = closed.exception() if closed.done() else None
        if exc is not None and task.cancelled():
            raise exc
        return task.result()


def wake(fut: asyncio.Future[None], exc: BaseException | None = None) -> None:
    """Complete ``fut`` (result None, or ``exc``) from any thread; no-op if already done."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    loop = fut.get_loop()
    if loop is running:
        _complete(fut, exc)
    else:
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
            loop.call_soon_threadsafe(_complete, fut, exc)


def _complete(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def backoff(delay: float) -> float:
    """The next polling delay: doubled, capped at :data:`POLL_MAX`."""
    return min(POLL_MAX, delay * 2)
