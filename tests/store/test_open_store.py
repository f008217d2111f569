"""``open_store``: URL parsing and ownership."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from aiocollect.errors import StoreError, UsageError
from aiocollect.store import (
    FileStore,
    MemoryStore,
    RedisStore,
    TCPStore,
    open_store,
)
from tests.support.store import free_port

pytestmark = pytest.mark.timeout(30)


async def test_store_object_is_returned_unowned() -> None:
    store = MemoryStore("passthrough")
    assert await open_store(store, rank=3, secret=None, timeout=1) == (store, False)


async def test_memory_url_shares_by_name() -> None:
    a, owned = await open_store("memory://job-1", rank=0, secret=None, timeout=5)
    b, _ = await open_store("memory://job-1", rank=1, secret=None, timeout=5)
    c, _ = await open_store("memory://job-2", rank=1, secret=None, timeout=5)
    assert owned
    assert isinstance(a, MemoryStore)
    assert a.timeout == 5
    await a.set("k", b"v")
    assert await b.get("k") == b"v"
    assert await c.check(["k"]) == [False]
    for s in (a, b, c):
        await s.close()


async def test_file_url(tmp_path: Path) -> None:
    store, owned = await open_store(f"file://{tmp_path}/sub", rank=0, secret=None, timeout=5)
    assert owned
    assert isinstance(store, FileStore)
    assert store.path == tmp_path / "sub"
    await store.set("k", b"v")
    assert (tmp_path / "sub").is_dir()
    await store.close()


async def test_tcp_url_rank0_hosts() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    opened = await asyncio.gather(
        open_store(url, rank=1, secret=b"s", timeout=10),
        open_store(url, rank=2, secret=b"s", timeout=10),
        open_store(url, rank=0, secret=b"s", timeout=10),
    )
    stores = [s for s, owned in opened if owned]
    assert len(stores) == 3
    assert all(isinstance(s, TCPStore) for s in stores)
    host = stores[2]
    assert isinstance(host, TCPStore)
    assert host.server is not None
    assert sorted(await asyncio.gather(*(s.add("n", 1) for s in stores))) == [1, 2, 3]
    for s in stores:
        await s.close()


async def test_redis_url_makes_redis_store() -> None:
    store, owned = await open_store("redis://:pw@127.0.0.1:1/3", rank=0, secret=None, timeout=5)
    assert owned
    assert isinstance(store, RedisStore)
    assert "pw" not in repr(store)
    await store.close()


async def test_redis_missing_package_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)
    with pytest.raises(StoreError, match=r"pip install aiocollect\[redis\]"):
        RedisStore("redis://127.0.0.1:6379/0")


@pytest.mark.parametrize(
    "url",
    [
        "",
        "127.0.0.1:29500",
        "http://host:1",
        "tcp://host",
        "tcp://:29500",
        "tcp://host:99999",
        "tcp://host:port",
        "tcp://host:1/path",
        "tcp://user:pw@host:1",
        "tcp://host:1?x=1",
        "file://relative/path",
        "file:///",
        "memory://",
    ],
)
async def test_bad_urls_raise_usage_error(url: str) -> None:
    with pytest.raises(UsageError) as info:
        await open_store(url, rank=0, secret=None, timeout=1)
    assert repr(url) in str(info.value) or "://" in str(info.value)


async def test_bad_spec_and_rank() -> None:
    with pytest.raises(UsageError):
        await open_store(42, rank=0, secret=None, timeout=1)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        await open_store("memory://x", rank=-1, secret=None, timeout=1)
