"""Real processes, real signals: a killed rank is named on every survivor within a second; a
frozen one is named at the deadline; afterwards the group is broken and a new one opens."""

from __future__ import annotations

import time

import pytest

from aiocollect.testing import spawn_ranks
from tests.failure import targets
from tests.helpers import check_killed, wait_ready

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize(
    ("n", "victim", "size", "alg"),
    [
        (2, 1, 1 << 16, None),
        (3, 2, 1 << 20, "ring"),
        (4, 1, 4096, "recursive_doubling"),
        (4, 3, 1 << 18, "halving_doubling"),
        (4, 0, 16, None),  # the star's root (the default at 3-4 ranks, small buffers)
        (3, 2, 4096, None),  # a star leaf
        (4, 2, 1 << 22, None),  # the pull allreduce (the default from 1 MiB where ranks pull)
    ],
)
async def test_sigkill_named_on_every_survivor_within_a_second(
    n: int, victim: int, size: int, alg: str | None
) -> None:
    job = spawn_ranks(n, targets.loop_until_failure, size, "ready", alg, timeout=60)
    await wait_ready(job.store, n, "ready")
    killed_at = time.time()
    job.kill(victim)
    check_killed(await job.outcomes(), victim, killed_at)


async def test_sigstop_gives_peer_timeout_naming_the_frozen_rank() -> None:
    n, victim = 3, 1
    job = spawn_ranks(
        n, targets.loop_until_failure, 1 << 14, "ready", timeout=60, group_timeout=2.0
    )
    await wait_ready(job.store, n, "ready")
    stopped_at = time.time()
    job.stop(victim)
    outcomes = await job.outcomes(wait_for=[r for r in range(n) if r != victim])
    for rank, out in enumerate(outcomes):
        if rank == victim:
            continue
        res = out[1]
        assert res["error"] == "PeerTimeout", res
        assert res["ranks"] == [victim], res
        assert f"[{victim}]" in res["message"]
        assert 1.0 < res["at"] - stopped_at < 5.0, res["at"] - stopped_at
