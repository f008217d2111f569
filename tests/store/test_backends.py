"""Backend specifics beyond the conformance suite: file locking across processes, key
escaping, memory stores across threads, prefix isolation, and the wire format (no loop)."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from aiocollect.errors import ProtocolError, StoreError, StoreTimeout
from aiocollect.store import FileStore, MemoryStore, PrefixStore, RedisStore, _wire
from aiocollect.store.file import escape_key
from tests.support.store import child_env, free_port

pytestmark = pytest.mark.timeout(60)

ADDER = """
import asyncio, sys
from aiocollect.store import FileStore

async def main() -> None:
    store = FileStore(sys.argv[1])
    await store.wait(["go"], timeout=30)
    for _ in range(int(sys.argv[2])):
        await store.add("counter", 1)
    await store.set(f"done-{sys.argv[3]}", b"")

asyncio.run(main())
"""


async def test_file_add_is_atomic_across_processes(tmp_path: Path) -> None:
    procs, per_proc = 4, 50
    children = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", ADDER, str(tmp_path), str(per_proc), str(i), env=child_env()
        )
        for i in range(procs)
    ]
    try:
        store = FileStore(tmp_path)
        await store.set("go", b"")  # released together, so the adds contend
        await store.wait([f"done-{i}" for i in range(procs)], timeout=30)
        assert await store.get("counter") == str(procs * per_proc).encode()
    finally:
        codes = await asyncio.wait_for(asyncio.gather(*(c.wait() for c in children)), 30)
    assert codes == [0] * procs


def test_escape_key_is_injective_and_safe() -> None:
    keys = ["a/b", "a%2Fb", "a_b", ".", "..", "", "x" * 300, "ü", "%C3%BC"]
    names = [escape_key(k) for k in keys]
    assert len(set(names)) == len(keys)
    for name in names:
        assert "/" not in name
        assert name not in (".", "..")
        assert len(name) <= 202


async def test_memory_store_wakes_waiters_on_other_threads() -> None:
    store = MemoryStore("threads")
    result: list[bytes] = []
    ready = threading.Event()

    def other_loop() -> None:
        async def run() -> None:
            theirs = MemoryStore("threads")
            task = asyncio.create_task(theirs.get("cross", timeout=20))
            await asyncio.sleep(0)
            ready.set()
            result.append(await task)

        asyncio.run(run())

    thread = threading.Thread(target=other_loop)
    thread.start()
    await asyncio.to_thread(ready.wait, 20)
    await store.set("cross", b"from main loop")
    await asyncio.to_thread(thread.join, 20)
    assert result == [b"from main loop"]


async def test_prefix_isolates_and_strips_names() -> None:
    base = MemoryStore("prefix-iso")
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    await a.set("k", b"A")
    await b.set("k", b"B")
    assert (await a.get("k"), await b.get("k"), await base.get("a/k")) == (b"A", b"B", b"A")
    with pytest.raises(StoreTimeout) as info:
        await a.wait(["k", "missing"], timeout=0.05)
    assert info.value.keys == ["missing"]
    assert "a/missing" not in str(info.value)
    await a.close()
    assert await base.get("b/k") == b"B"  # closing a view leaves the store open
    await b.close()
    await base.close()


def test_wire_requests_roundtrip_and_reject_garbage() -> None:
    def roundtrip(msg: object) -> _wire.Request:
        return _wire.parse_request(_wire.decode(b"".join(_wire.encode(msg))[4:]))

    assert roundtrip([1, "set", "k", b"v"]) == _wire.Request(1, "set", key="k", value=b"v")
    assert roundtrip([2, "get", "k", 1.5]).timeout == 1.5
    assert roundtrip([3, "wait", ["a", "b"], None]).keys == ("a", "b")
    assert roundtrip([4, "add", "k", -3]).amount == -3
    assert roundtrip([5, "cancel", 2]).target == 2
    bad: list[object] = [
        [],
        [1],
        ["1", "set"],
        [-1, "get", "k", 1],
        [1, "nope"],
        [1, "set", "k"],
        [1, "set", "k", "str"],
        [1, "get", "k", -1],
        [1, "get", "k", True],
        [1, "add", "k", 1.0],
        [1, "wait", "ab", 1],
        [1, "check", [1]],
        {"rid": 1},
    ]
    for msg in bad:
        with pytest.raises(ProtocolError):
            roundtrip(msg)
    with pytest.raises(ProtocolError):
        _wire.decode(b"\xc1")
    with pytest.raises(ProtocolError):
        _wire.parse_hello(["other", 1, None])
    with pytest.raises(ProtocolError):
        _wire.parse_response([1, 9, None])


async def test_redis_unreachable_raises_store_error() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=5)
    with pytest.raises(StoreError, match="failed"):
        await store.set("k", b"v")
    with pytest.raises(StoreError):
        await store.get("k", timeout=5)
    await store.close()


async def test_redis_wrong_password_raises_store_error(redis_url: str) -> None:
    store = RedisStore(redis_url.replace("conformance-pw", "wrong"))
    with pytest.raises(StoreError) as info:
        await store.set("k", b"v")
    assert "wrong" not in str(info.value)
    await store.close()
