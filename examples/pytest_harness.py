"""Testing distributed code with aiocollect under pytest-asyncio.

The function under test, ``global_norm``, is ordinary distributed code: each rank holds a
shard of a vector and needs the norm of the whole. ``run_ranks`` runs it for every rank of
an in-process group on the test's own event loop — no processes, no ports, deterministic —
and ``spawn_ranks`` runs the same code in real processes over TCP.

Run: ``pytest examples/pytest_harness.py`` (pytest-asyncio in auto mode, or mark tests).
"""

from __future__ import annotations

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks, spawn_ranks


async def global_norm(group: ac.Group, shard: np.ndarray) -> float:
    """The 2-norm of the concatenation of every rank's shard."""
    total = np.array([float(np.dot(shard, shard))])
    await group.allreduce(total)
    return float(np.sqrt(total[0]))


async def norm_of_rank_shard(group: ac.Group) -> float:
    shard = np.arange(4, dtype=np.float64) + 4 * group.rank
    return await global_norm(group, shard)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
async def test_global_norm_in_process(world_size: int) -> None:
    results = await run_ranks(world_size, norm_of_rank_shard)
    want = float(np.linalg.norm(np.arange(4 * world_size, dtype=np.float64)))
    assert results == pytest.approx([want] * world_size)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_global_norm_in_processes() -> None:
    results = await spawn_ranks(3, norm_of_rank_shard, timeout=50)
    assert results == pytest.approx([float(np.linalg.norm(np.arange(12.0)))] * 3)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_the_ranks_fixture(ranks) -> None:  # type: ignore[no-untyped-def]
    """The plugin's ``ranks`` fixture is ``run_ranks``."""
    want = float(np.linalg.norm(np.arange(8.0)))
    assert await ranks(2, norm_of_rank_shard) == pytest.approx([want] * 2)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_failing_rank_is_named() -> None:
    async def body(group: ac.Group) -> None:
        if group.rank == 1:
            raise ValueError("bad shard")
        await group.barrier()

    with pytest.raises(ExceptionGroup) as info:
        await run_ranks(2, body, timeout=5)
    causes = {err.rank: err.__cause__ for err in info.value.exceptions}
    assert isinstance(causes[1], ValueError)  # rank 0 fails too: the group broke under it
    assert isinstance(causes[0], ac.GroupBrokenError)
