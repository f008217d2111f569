"""The Store contract, checked for every backend (see ``conftest.BACKENDS``).

Each test uses two or more store objects on one backing store, so a value written through
one must be visible through the others.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from store_helpers import Backend, settle

from aiocollect.errors import StoreError, StoreTimeout, UsageError

pytestmark = pytest.mark.timeout(30)


async def test_set_get_roundtrip(backend: Backend) -> None:
    a, b = await backend.make(), await backend.make()
    await a.set("k", b"v")
    assert await a.get("k") == b"v"
    assert await b.get("k") == b"v"


async def test_overwrite(backend: Backend) -> None:
    a, b = await backend.make(), await backend.make()
    await a.set("k", b"first")
    await b.set("k", b"second")
    assert await a.get("k") == b"second"


async def test_get_waits_for_later_set(backend: Backend) -> None:
    a, b = await backend.make(), await backend.make()
    waiter = asyncio.create_task(a.get("late", timeout=20))
    await settle(a)
    assert not waiter.done()
    await b.set("late", b"here")
    assert await asyncio.wait_for(waiter, 10) == b"here"


async def test_get_timeout_names_key(backend: Backend) -> None:
    a = await backend.make()
    start = time.monotonic()
    with pytest.raises(StoreTimeout) as info:
        await a.get("missing-key", timeout=0.2)
    elapsed = time.monotonic() - start
    assert 0.15 <= elapsed < 5
    assert info.value.keys == ["missing-key"]
    assert "missing-key" in str(info.value)
    assert isinstance(info.value, TimeoutError)


async def test_timeout_zero(backend: Backend) -> None:
    a = await backend.make()
    await a.set("there", b"1")
    assert await a.get("there", timeout=0) == b"1"
    await a.wait(["there"], timeout=0)
    with pytest.raises(StoreTimeout):
        await a.get("absent", timeout=0)


async def test_add_concurrent_sums_exactly(backend: Backend) -> None:
    stores = [await backend.make() for _ in range(3)]
    per_store = 20
    results = await asyncio.gather(
        *(s.add("counter", 1) for s in stores for _ in range(per_store))
    )
    total = len(stores) * per_store
    assert sorted(results) == list(range(1, total + 1))
    assert await stores[0].get("counter") == str(total).encode()
    assert await stores[1].add("counter", -total - 5) == -5
    assert await stores[2].add("fresh", 7) == 7
    assert await stores[2].add("fresh", 0) == 7


async def test_add_on_non_integer_raises(backend: Backend) -> None:
    a = await backend.make()
    await a.set("text", b"not a number")
    with pytest.raises(StoreError):
        await a.add("text", 1)
    assert await a.get("text") == b"not a number"


async def test_wait_multiple_keys(backend: Backend) -> None:
    a, b = await backend.make(), await backend.make()
    waiter = asyncio.create_task(a.wait(["x", "y", "z"], timeout=20))
    await settle(a)
    await b.set("x", b"1")
    await b.add("y", 1)
    await settle(a)
    assert not waiter.done()
    await b.set("z", b"3")
    await asyncio.wait_for(waiter, 10)
    await a.wait([])


async def test_wait_timeout_names_missing_keys(backend: Backend) -> None:
    a = await backend.make()
    await a.set("here", b"1")
    with pytest.raises(StoreTimeout) as info:
        await a.wait(["here", "gone-1", "gone-2", "gone-1"], timeout=0.2)
    assert info.value.keys == ["gone-1", "gone-2"]
    assert "gone-1" in str(info.value) and "gone-2" in str(info.value)
    assert "'here'" not in str(info.value)


async def test_check(backend: Backend) -> None:
    a, b = await backend.make(), await backend.make()
    await a.set("one", b"1")
    await a.add("two", 2)
    assert await b.check(["one", "nope", "two"]) == [True, False, True]
    assert await b.check([]) == []


async def test_delete(backend: Backend) -> None:
    a, b = await backend.make(), await backend.make()
    await a.set("gone", b"1")
    assert await b.delete("gone") is True
    assert await a.check(["gone"]) == [False]
    assert await b.delete("gone") is False
    with pytest.raises(StoreTimeout):
        await a.get("gone", timeout=0.05)
    await a.set("gone", b"again")
    assert await b.get("gone") == b"again"


@pytest.mark.parametrize(
    "value",
    [b"", b"\x00", bytes(range(256)), os.urandom(1 << 20)],
    ids=["empty", "nul", "all-bytes", "1MiB"],
)
async def test_binary_values(backend: Backend, value: bytes) -> None:
    a, b = await backend.make(), await backend.make()
    await a.set("bin", value)
    assert await b.get("bin") == value
    await a.set("view", memoryview(bytearray(value)))
    assert await b.get("view") == value


TRICKY_KEYS = [
    "a/b", "a%2Fb", "a_b", "a b", ".", "..", "", "/", "ünï/çødé", "tab\tnew\nline",
    "x" * 300, "x" * 300 + "y", "k_a", "h_" + "0" * 64,
]


async def test_key_names_are_distinct(backend: Backend) -> None:
    a, b = await backend.make(), await backend.make()
    for i, key in enumerate(TRICKY_KEYS):
        await a.set(key, str(i).encode())
    for i, key in enumerate(TRICKY_KEYS):
        assert await b.get(key, timeout=1) == str(i).encode(), key
    assert await b.check(TRICKY_KEYS) == [True] * len(TRICKY_KEYS)


async def test_bad_arguments(backend: Backend) -> None:
    a = await backend.make()
    with pytest.raises(UsageError):
        await a.set(b"bytes-key", b"v")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        await a.set("k", "str value")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        await a.wait("ab")
    with pytest.raises(UsageError):
        await a.add("k", 1.5)  # type: ignore[arg-type]


async def test_close_fails_pending_and_later_calls(backend: Backend) -> None:
    a, b = await backend.make(), await backend.make()
    getter = asyncio.create_task(a.get("never", timeout=25))
    waiter = asyncio.create_task(a.wait(["never"], timeout=25))
    await settle(a)
    start = time.monotonic()
    await a.close()
    for task in (getter, waiter):
        with pytest.raises(StoreError) as info:
            await asyncio.wait_for(task, 10)
        assert not isinstance(info.value, StoreTimeout)
    assert time.monotonic() - start < 5
    with pytest.raises(StoreError):
        await a.set("k", b"v")
    with pytest.raises(StoreError):
        await a.get("k", timeout=1)
    await a.close()  # idempotent
    await b.set("k", b"still works")  # other instances are unaffected
    assert await b.get("k") == b"still works"
