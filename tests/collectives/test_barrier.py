"""Every barrier algorithm at world sizes 1-8, in one process (memory, tcp) and over the
default transport in real processes: no rank leaves a barrier before the last one entered
(the automatic choice against a forced one: tests/collectives/test_star.py)."""

from __future__ import annotations

import asyncio

import pytest

import aiocollect as ac
from aiocollect.collectives.registry import REGISTRIES
from aiocollect.testing import run_ranks, spawn_ranks
from tests.support.targets import star as star_targets

pytestmark = pytest.mark.timeout(120)

ALGORITHMS = [*REGISTRIES["barrier"].names, None]


@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
async def test_no_rank_leaves_before_the_last_enters(
    algorithm: str | None, n: int, transport: str
) -> None:
    """Each round, one rank (a different one each time, rank 0 included) enters only after
    every other rank is waiting in the barrier and the loop has turned many times: a
    barrier that let anyone out early shows as a rank leaving with an entry missing."""
    rounds = max(n, 2)
    entered = [[False] * n for _ in range(rounds)]
    waiting = [asyncio.Event() for _ in range(rounds)]
    count = [0] * rounds

    async def body(g: ac.Group) -> list[bool]:
        seen = []
        for k in range(rounds):
            late = k % n
            if g.rank == late:
                if n > 1:
                    await waiting[k].wait()
                for _ in range(50):  # let an early release happen if it would
                    await asyncio.sleep(0)
            entered[k][g.rank] = True
            handle = g.barrier(algorithm=algorithm)
            if g.rank != late:
                count[k] += 1
                if count[k] == n - 1:
                    waiting[k].set()
            await handle
            seen.append(all(entered[k]))
        return seen

    for seen in await run_ranks(n, body, transport=transport, timeout=60):
        assert seen == [True] * rounds


@pytest.mark.parametrize("uvloop", [False, True], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("n", [3, 4])
async def test_star_barrier_in_processes_over_auto(n: int, uvloop: bool) -> None:
    """Real processes over the default transport (shared memory here)."""
    job = spawn_ranks(n, star_targets.barriers, 50, timeout=60, transport="auto", uvloop=uvloop)
    assert await job == [50] * n
