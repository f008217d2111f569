"""Helpers shared by the store tests."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiocollect.store import Store
from aiocollect.testing import free_port as free_port  # re-exported for the store tests

REPO = Path(__file__).resolve().parents[2]
SECRET = b"conformance-secret"


def child_env() -> dict[str, str]:
    """Environment for subprocesses that import aiocollect from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


async def settle(store: Store) -> None:
    """Let tasks started just before run up to their first wait, then complete a round trip
    on ``store`` (for TCP, requests on one connection are handled in order)."""
    await asyncio.sleep(0)
    await store.check(["__settle__"])


class Ticker:
    """The longest CPU time the loop's thread spent between two 1 ms ticks (CPU, not wall
    time: other processes on a busy machine do not count)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._stop = False
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        last = time.thread_time()
        while not self._stop:
            await asyncio.sleep(0.001)
            now = time.thread_time()
            self.worst = max(self.worst, now - last)
            last = now

    async def stop(self) -> float:
        self._stop = True
        await self._task
        return self.worst


@dataclass
class Backend:
    """Makes any number of store objects that share one backing store."""

    name: str
    factory: Callable[[], Awaitable[Store]]
    made: list[Store] = field(default_factory=list)

    async def make(self) -> Store:
        store = await self.factory()
        self.made.append(store)
        return store
