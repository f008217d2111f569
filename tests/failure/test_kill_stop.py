"""Real processes, real signals, over every transport and mode that links processes
(tests/support/transports.py): a killed rank is named on every survivor within a second and
leaves nothing in shared memory; a frozen one is named at the deadline."""

from __future__ import annotations

import time

import pytest

from tests.support.procs import check_killed, wait_ready
from tests.support.shm_leaks import leaked, segments
from tests.support.targets import failure as targets
from tests.support.transports import Axis

pytestmark = pytest.mark.timeout(90)


#: (world, victim, bytes, algorithm) of each kill.
KILLS = [
    (2, 1, 1 << 16, None),
    (3, 2, 1 << 20, "ring"),
    (4, 1, 4096, "recursive_doubling"),
    (4, 3, 1 << 18, "halving_doubling"),
    (4, 0, 16, None),  # the star's root (the default at 3-4 ranks, small buffers)
    (3, 2, 4096, None),  # a star leaf
    (4, 2, 1 << 22, None),  # the pull allreduce (the default from 1 MiB where ranks pull)
]
#: Frames larger than the shared-memory ring in flight.
LARGER_THAN_THE_RING = (2, 0, 8 << 20, None)


@pytest.mark.transports(
    argnames="n, victim, size, alg",
    values={"auto": [*KILLS, LARGER_THAN_THE_RING], "shm": [*KILLS, LARGER_THAN_THE_RING]},
    default=[(3, 2, 4096, None)],
    where="processes",
)
async def test_sigkill_named_on_every_survivor_within_a_second(
    axis: Axis, n: int, victim: int, size: int, alg: str | None
) -> None:
    before = segments()
    job = axis.spawn(n, targets.loop_until_failure, size, "ready", alg, timeout=60)
    await wait_ready(job.store, n, "ready")
    killed_at = time.time()
    job.kill(victim)
    check_killed(await job.outcomes(), victim, killed_at)
    assert not leaked(before, {job.pid(r) for r in range(n)})


@pytest.mark.transports(
    argnames="size",
    # 1 << 18 float32s (1 MiB): the segment allreduce; past 4 MiB the pull allreduce
    values={
        "auto": [1 << 14, 1 << 18, (1 << 20) + 1],
        "shm": [1 << 14, 1 << 18, (1 << 20) + 1],
    },
    default=[1 << 14],
    where="processes",
)
async def test_sigstop_gives_peer_timeout_naming_the_frozen_rank(axis: Axis, size: int) -> None:
    """A frozen rank is named at the deadline, also when its peers' frames wait for it to
    pull them (a frozen process's memory can still be pulled, so it is the one that stops
    pulling that is to blame)."""
    n, victim = 3, 1
    job = axis.spawn(n, targets.loop_until_failure, size, "ready", timeout=60, group_timeout=2.0)
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
