"""Conformance checks every :class:`~aiocollect.store.base.Store` must pass.

A backend is checked by one call: ``await check_store(make)``, where ``make`` (a
:data:`StoreFactory`) returns a new store object on the *same* backing store each time it
is called, so that a value written through one must be visible through the others. The
checks close every store they make (``close`` must be idempotent, so an owner closing them
again is fine). :data:`STORE_CHECKS` lists the checks one by one for a test that
parametrizes over them.

The contract checked is that of :class:`~aiocollect.store.base.Store`: set/get round trips
(binary values, tricky key names), a ``get`` that waits for a later ``set``, timeouts that
raise StoreTimeout naming the missing keys, atomic ``add``,
``wait``/``multi_get``/``check``/``delete``, UsageError for bad arguments, and ``close``
failing pending and later calls with StoreError while other store objects go on working.
Each check raises AssertionError on a violation; no check waits longer than a few seconds.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiocollect.errors import StoreError, StoreTimeout, UsageError
from aiocollect.store.base import Store

StoreFactory = Callable[[], Awaitable[Store]]
Maker = Callable[[], Awaitable[Store]]


@asynccontextmanager
async def _stores(make: StoreFactory) -> AsyncIterator[Maker]:
    """A maker that remembers its stores, all closed on exit."""
    made: list[Store] = []

    async def one() -> Store:
        store = await make()
        made.append(store)
        return store

    try:
        yield one
    finally:
        for store in made:
            await store.close()


async def _raises(exc_type: type[BaseException], aw: Awaitable[Any], what: str) -> BaseException:
    """The exception ``aw`` raises, which must be an ``exc_type``."""
    try:
        await aw
    except exc_type as exc:
        return exc
    except BaseException as exc:
        raise AssertionError(f"{what}: raised {exc!r}, not {exc_type.__name__}") from exc
    raise AssertionError(f"{what}: did not raise {exc_type.__name__}")


async def settle(store: Store) -> None:
    """Let tasks started just before run up to their first wait, then complete a round trip
    on ``store`` (for TCP, requests on one connection are handled in order)."""
    await asyncio.sleep(0)
    await store.check(["__settle__"])


async def check_set_get(make: StoreFactory) -> None:
    """A value set through one store object is read through another; set overwrites."""
    async with _stores(make) as one:
        a, b = await one(), await one()
        await a.set("k", b"v")
        assert await a.get("k") == b"v"
        assert await b.get("k") == b"v"
        await b.set("k", b"second")
        assert await a.get("k") == b"second", "set did not overwrite"


async def check_get_waits(make: StoreFactory) -> None:
    """``get`` of a missing key waits until another store object sets it."""
    async with _stores(make) as one:
        a, b = await one(), await one()
        waiter = asyncio.ensure_future(a.get("late", timeout=20))
        try:
            await settle(a)
            assert not waiter.done(), "get returned before the key was set"
            await b.set("late", b"here")
            assert await asyncio.wait_for(waiter, 10) == b"here"
        finally:
            waiter.cancel()


async def check_timeouts(make: StoreFactory) -> None:
    """A ``get`` that times out raises StoreTimeout (a TimeoutError) naming the key, after
    about its timeout; ``timeout=0`` checks once."""
    async with _stores(make) as one:
        a = await one()
        start = time.monotonic()
        exc = await _raises(StoreTimeout, a.get("missing-key", timeout=0.2), "get timeout")
        elapsed = time.monotonic() - start
        assert 0.15 <= elapsed < 5, f"a 0.2 s timeout took {elapsed:.2f} s"
        assert isinstance(exc, StoreTimeout), exc
        assert exc.keys == ["missing-key"], exc
        assert "missing-key" in str(exc)
        assert isinstance(exc, TimeoutError)
        await a.set("there", b"1")
        assert await a.get("there", timeout=0) == b"1"
        await a.wait(["there"], timeout=0)
        await _raises(StoreTimeout, a.get("absent", timeout=0), "get with timeout=0")


async def check_add(make: StoreFactory) -> None:
    """Concurrent ``add`` calls from several store objects sum exactly; ``add`` on a value
    that is not an integer raises StoreError and leaves it unchanged."""
    async with _stores(make) as one:
        stores = [await one() for _ in range(3)]
        per_store = 20
        results = await asyncio.gather(
            *(s.add("counter", 1) for s in stores for _ in range(per_store))
        )
        total = len(stores) * per_store
        assert sorted(results) == list(range(1, total + 1)), sorted(results)
        assert await stores[0].get("counter") == str(total).encode()
        assert await stores[1].add("counter", -total - 5) == -5
        assert await stores[2].add("fresh", 7) == 7
        assert await stores[2].add("fresh", 0) == 7
        await stores[0].set("text", b"not a number")
        await _raises(StoreError, stores[0].add("text", 1), "add on text")
        assert await stores[1].get("text") == b"not a number"


async def check_wait(make: StoreFactory) -> None:
    """``wait`` returns once every key exists (set or added); its StoreTimeout names the
    missing keys only, once each."""
    async with _stores(make) as one:
        a, b = await one(), await one()
        waiter = asyncio.ensure_future(a.wait(["x", "y", "z"], timeout=20))
        try:
            await settle(a)
            await b.set("x", b"1")
            await b.add("y", 1)
            await settle(a)
            assert not waiter.done(), "wait returned with a key missing"
            await b.set("z", b"3")
            await asyncio.wait_for(waiter, 10)
        finally:
            waiter.cancel()
        await a.wait([])
        await a.set("here", b"1")
        exc = await _raises(
            StoreTimeout,
            a.wait(["here", "gone-1", "gone-2", "gone-1"], timeout=0.2),
            "wait timeout",
        )
        assert isinstance(exc, StoreTimeout), exc
        assert exc.keys == ["gone-1", "gone-2"], exc
        assert "gone-1" in str(exc)
        assert "gone-2" in str(exc)
        assert "'here'" not in str(exc)


async def check_check_and_delete(make: StoreFactory) -> None:
    """``check`` tells which keys exist; ``delete`` removes a key (True once, then
    False), after which it can be set again."""
    async with _stores(make) as one:
        a, b = await one(), await one()
        await a.set("one", b"1")
        await a.add("two", 2)
        assert await b.check(["one", "nope", "two"]) == [True, False, True]
        assert await b.check([]) == []
        await a.set("gone", b"1")
        assert await b.delete("gone") is True
        assert await a.check(["gone"]) == [False]
        assert await b.delete("gone") is False
        await _raises(StoreTimeout, a.get("gone", timeout=0.05), "get after delete")
        await a.set("gone", b"again")
        assert await b.get("gone") == b"again"


async def check_multi_get(make: StoreFactory) -> None:
    """``multi_get`` returns the values in the order asked (a key asked twice, twice; no
    keys, ``[]``), waits for keys set later, and its StoreTimeout names the missing keys
    only, once each; a ``str`` as keys is a UsageError."""
    async with _stores(make) as one:
        a, b = await one(), await one()
        await a.set("m/one", b"1")
        await a.add("m/two", 2)
        await a.set("m/empty", b"")
        got = await b.multi_get(["m/two", "m/one", "m/empty", "m/one"])
        assert got == [b"2", b"1", b"", b"1"], got
        assert await b.multi_get([]) == []
        waiter = asyncio.ensure_future(b.multi_get(["m/late-1", "m/one", "m/late-2"], timeout=20))
        try:
            await settle(b)
            await a.set("m/late-1", b"x")
            await settle(b)
            assert not waiter.done(), "multi_get returned with a key missing"
            await a.set("m/late-2", b"y")
            assert await asyncio.wait_for(waiter, 10) == [b"x", b"1", b"y"]
        finally:
            waiter.cancel()
        exc = await _raises(
            StoreTimeout,
            b.multi_get(["m/one", "gone-1", "gone-2", "gone-1"], timeout=0.2),
            "multi_get timeout",
        )
        assert isinstance(exc, StoreTimeout), exc
        assert exc.keys == ["gone-1", "gone-2"], exc
        assert "gone-1" in str(exc), exc
        assert "gone-2" in str(exc), exc
        assert "m/one" not in str(exc), exc
        await _raises(StoreTimeout, b.multi_get(["gone-1"], timeout=0), "multi_get timeout=0")
        await _raises(UsageError, b.multi_get("ab"), "a str as keys of multi_get")


async def check_multi_get_large(make: StoreFactory) -> None:
    """``multi_get`` carries large values (several of 1 MiB, next to small ones) and many
    keys (a thousand) unchanged."""
    async with _stores(make) as one:
        a, b = await one(), await one()
        big = [os.urandom(1 << 20) for _ in range(3)]
        for i, value in enumerate(big):
            await a.set(f"big/{i}", value)
        await a.set("big/small", b"s")
        got = await b.multi_get(["big/0", "big/small", "big/1", "big/2"])
        assert got == [big[0], b"s", big[1], big[2]], "a large value changed"
        names = [f"many/{i}" for i in range(1000)]
        for i, key in enumerate(names):
            await a.set(key, str(i).encode())
        got = await b.multi_get(names)
        assert got == [str(i).encode() for i in range(1000)], "a value of many changed"


async def check_binary_values(make: StoreFactory) -> None:
    """Values are bytes, any bytes (empty, NUL, every byte value, 1 MiB), and a
    memoryview is accepted as a value."""
    async with _stores(make) as one:
        a, b = await one(), await one()
        for value in (b"", b"\x00", bytes(range(256)), os.urandom(1 << 20)):
            await a.set("bin", value)
            assert await b.get("bin") == value, f"a value of {len(value)} bytes changed"
            await a.set("view", memoryview(bytearray(value)))  # type: ignore[arg-type]
            assert await b.get("view") == value


#: Key names that a backend mapping keys to paths or escaping them could confuse.
TRICKY_KEYS = [
    "a/b",
    "a%2Fb",
    "a_b",
    "a b",
    ".",
    "..",
    "",
    "/",
    "ünï/çødé",
    "tab\tnew\nline",
    "x" * 300,
    "x" * 300 + "y",
    "k_a",
    "h_" + "0" * 64,
]


async def check_key_names(make: StoreFactory) -> None:
    """Every name in TRICKY_KEYS is a key of its own."""
    async with _stores(make) as one:
        a, b = await one(), await one()
        for i, key in enumerate(TRICKY_KEYS):
            await a.set(key, str(i).encode())
        for i, key in enumerate(TRICKY_KEYS):
            assert await b.get(key, timeout=1) == str(i).encode(), key
        assert await b.check(TRICKY_KEYS) == [True] * len(TRICKY_KEYS)


async def check_bad_arguments(make: StoreFactory) -> None:
    """Keys that are not str, values that are not bytes, a str where a list of keys is
    wanted and a non-integer amount raise UsageError."""
    async with _stores(make) as one:
        a = await one()
        bad: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("a bytes key", lambda: a.set(b"bytes-key", b"v")),  # type: ignore[arg-type]
            ("a str value", lambda: a.set("k", "str value")),  # type: ignore[arg-type]
            ("a str as keys", lambda: a.wait("ab")),
            ("a float amount", lambda: a.add("k", 1.5)),  # type: ignore[arg-type]
        ]
        for what, call in bad:
            await _raises(UsageError, call(), what)


async def check_close(make: StoreFactory) -> None:
    """``close`` fails pending ``get``/``wait`` calls promptly with StoreError (not a
    timeout) and every later call; it is idempotent; other store objects go on working."""
    async with _stores(make) as one:
        a, b = await one(), await one()
        getter = asyncio.ensure_future(a.get("never", timeout=25))
        waiter = asyncio.ensure_future(a.wait(["never"], timeout=25))
        await settle(a)
        start = time.monotonic()
        await a.close()
        for task in (getter, waiter):
            exc = await _raises(StoreError, asyncio.wait_for(task, 10), "a call pending at close")
            assert not isinstance(exc, StoreTimeout), f"closing failed it with {exc!r}"
        assert time.monotonic() - start < 5, "pending calls were not failed promptly"
        await _raises(StoreError, a.set("k", b"v"), "set after close")
        await _raises(StoreError, a.get("k", timeout=1), "get after close")
        await a.close()
        await b.set("k", b"still works")
        assert await b.get("k") == b"still works", "closing one store broke another"


STORE_CHECKS: tuple[Callable[[StoreFactory], Awaitable[None]], ...] = (
    check_set_get,
    check_get_waits,
    check_timeouts,
    check_add,
    check_wait,
    check_multi_get,
    check_multi_get_large,
    check_check_and_delete,
    check_binary_values,
    check_key_names,
    check_bad_arguments,
    check_close,
)


async def check_store(make: StoreFactory) -> None:
    """Run every check of :data:`STORE_CHECKS` against stores from ``make``.

    Raises:
        AssertionError: the first check the backend fails, naming what went wrong.
    """
    for check in STORE_CHECKS:
        await check(make)


__all__ = ["STORE_CHECKS", "TRICKY_KEYS", "StoreFactory", "check_store", "settle"]
