"""Fixtures of the failure tests: a fake peer factory, a unique group name, a memory store and
a loop-error collector (helpers: tests/support/fakepeer.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from aiocollect.store import MemoryStore, Store
from tests.support.fakepeer import FakePeer


@pytest_asyncio.fixture
async def fake_peer() -> AsyncIterator[Callable[..., FakePeer]]:
    """``fake_peer(store, name, chunk_bytes=..., ...)`` -> FakePeer, closed at teardown."""
    made: list[FakePeer] = []

    def make(store: Store, name: str, **kwargs: Any) -> FakePeer:
        peer = FakePeer(store, name, **kwargs)
        made.append(peer)
        return peer

    yield make
    for peer in made:
        await peer.aclose()


@pytest.fixture
def unique_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def memory_store(unique_name: str) -> MemoryStore:
    return MemoryStore(unique_name)


@pytest_asyncio.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """Collects what reaches the event loop's exception handler (an exception escaping a
    protocol callback, a task exception never retrieved, ...); the test fails if any did."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    try:
        yield seen
    finally:
        loop.set_exception_handler(previous)
    assert not seen, f"unhandled errors reached the event loop: {seen}"
