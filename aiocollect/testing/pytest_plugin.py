"""pytest plugin (auto-registered through the ``pytest11`` entry point).

Fixtures:
    ranks: an async runner, ``await ranks(n, fn, *args, transport="memory")``, that runs
        ``fn(group, *args)`` for every rank of a fresh group on the test's event loop and
        returns the results in rank order (see :func:`aiocollect.testing.run_ranks`).
    spawned: like ``ranks`` but one process per rank over TCP (``spawn_ranks``); every
        process is killed and reaped when the test ends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from aiocollect.testing import run_ranks
from aiocollect.testing.spawn import SpawnedRanks, spawn_ranks

Runner = Callable[..., Awaitable[list[Any]]]


@pytest.fixture
def ranks() -> Runner:
    """Run a function on every rank of an in-process group."""
    return run_ranks


@pytest.fixture
def spawned() -> Iterator[Callable[..., SpawnedRanks]]:
    """Start ranks as processes; all are reaped at teardown."""
    jobs: list[SpawnedRanks] = []

    def start(
        world_size: int, target: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
    ) -> SpawnedRanks:
        job = spawn_ranks(world_size, target, *args, **kwargs)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.terminate()
