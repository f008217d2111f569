"""Fixtures for the store tests: every backend behind one factory (the redis backend uses the
suite's private redis-server, ``redis_url`` in tests/conftest.py)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from aiocollect.store import (
    FileStore,
    MemoryStore,
    PrefixStore,
    RedisStore,
    Store,
    TCPStore,
    TCPStoreServer,
)
from tests.support.store import SECRET, Backend

BACKENDS = ["memory", "file", "tcp", "tcp-secret", "prefix", "redis", "torch"]


@pytest.fixture(params=BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    return request.param, url


@pytest.fixture
async def backend(backend_kind: tuple[str, str | None], tmp_path: Path) -> AsyncIterator[Backend]:
    kind, redis = backend_kind
    server: TCPStoreServer | None = None
    tag = uuid.uuid4().hex
    factory: Callable[[], Awaitable[Store]]

    if kind == "memory":

        async def factory() -> Store:
            return MemoryStore(f"conformance-{tag}")
    elif kind == "file":

        async def factory() -> Store:
            return FileStore(tmp_path / "store")
    elif kind in ("tcp", "tcp-secret"):
        secret = SECRET if kind == "tcp-secret" else None
        server = TCPStoreServer("127.0.0.1", 0, secret=secret)
        await server.start()
        port = server.port

        async def factory() -> Store:
            store = TCPStore("127.0.0.1", port, secret=secret, timeout=30)
            await store.connect()
            return store
    elif kind == "prefix":

        async def factory() -> Store:
            return PrefixStore("job/7", MemoryStore(f"conformance-{tag}"))
    elif kind == "torch":
        dist = pytest.importorskip("torch.distributed")
        from aiocollect.torch.store import TorchStore

        master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

        async def factory() -> Store:
            client = dist.TCPStore(
                "127.0.0.1", master.port, is_master=False, wait_for_workers=False
            )
            return TorchStore(client, timeout=30)
    else:
        assert redis is not None
        import redis as redis_sync

        client = redis_sync.Redis.from_url(redis)
        client.flushall()
        client.close()

        async def factory() -> Store:
            return RedisStore(redis)

    b = Backend(kind, factory)
    try:
        yield b
    finally:
        for store in b.made:
            await store.close()
        if server is not None:
            await server.close()


@pytest.fixture
async def tcp_server() -> AsyncIterator[TCPStoreServer]:
    server = TCPStoreServer("127.0.0.1", 0)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
def python() -> str:
    return sys.executable
