"""The star allreduce (collectives/star.py): the default for small buffers at three and
four ranks. Rank 0 folds the inputs in rank order whatever order they arrive in, every
rank ends with rank 0's bits, the one-frame path covers it at any world size, and it runs
over the default transport (auto: shared memory) in real processes on both loops."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.collectives import registry, select
from aiocollect.testing import run_ranks, spawn_ranks
from tests.support.collectives import reference
from tests.support.targets import star as star_targets

pytestmark = pytest.mark.timeout(120)


def test_the_automatic_choice() -> None:
    choose = registry.ALLREDUCE.choose
    for n in (3, 4):
        assert choose(None, 4, n).name == "star"
        assert choose(None, select.ALLREDUCE_DOUBLING_MAX, n).name == "star"
        assert choose(None, select.ALLREDUCE_DOUBLING_MAX + 1, n).name == "halving_doubling"
    assert choose(None, 4, 2).name == "recursive_doubling"
    assert choose(None, 4, 5).name == "recursive_doubling"
    assert choose(None, 4, 8).name == "recursive_doubling"
    # every rank on one thread (in-process): the star from three ranks on, at any size
    for n in (3, 5, 8, 16):
        assert choose(None, 4, n, one_thread=True).name == "star"
        assert registry.BARRIER.choose(None, 0, n, one_thread=True).name == "star"
    assert choose(None, 4, 2, one_thread=True).name == "recursive_doubling"
    assert choose(None, select.ALLREDUCE_DOUBLING_MAX + 1, 8, True).name == "halving_doubling"
    assert registry.BARRIER.choose(None, 0, 5).name == "dissemination"


@pytest.mark.parametrize("transport", ["memory", "tcp"])
async def test_rank_zero_folds_in_rank_order_whatever_the_arrival_order(transport: str) -> None:
    """Ranks call in the order 3, 2, 1, 0, so rank 0 gets rank 3's frame first; the sum
    is still ((x0 + x1) + x2) + x3, which rounds differently from any other order."""
    n = 4
    values = [1e16, 1.0, 1.0, -1e16]  # in rank order each 1.0 is lost to rounding: 0.0
    called = [asyncio.Event() for _ in range(n)]

    async def body(g: ac.Group) -> tuple[bool, float]:
        if g.rank < n - 1:
            await called[g.rank + 1].wait()
        buf = np.array([values[g.rank]])
        handle = g.allreduce(buf)
        called[g.rank].set()
        await handle
        return not isinstance(handle, asyncio.Task), float(buf[0])

    results = await run_ranks(n, body, transport=transport)
    want = ((values[0] + values[1]) + values[2]) + values[3]
    arrival = ((values[0] + values[3]) + values[2]) + values[1]
    assert (want, arrival) == (0.0, 2.0)  # the order shows in the result
    assert results == [(True, want)] * n


@pytest.mark.parametrize("n", [3, 5, 6])
@pytest.mark.parametrize("op", [ac.ReduceOp.SUM, ac.ReduceOp.AVG, ac.ReduceOp.MAX, np.logaddexp])
async def test_one_frame_star_at_any_world_size(n: int, op: Any) -> None:
    """Forced at five and six ranks too (the automatic choice stops at four): the one-frame
    path, results as numpy's, bit-identical on every rank. (Links made as the group forms:
    at six ranks the star's root is not every rank's neighbour, and a group linking on
    demand makes that link in the first call, as a Task.)"""

    async def body(g: ac.Group) -> tuple[bool, np.ndarray[Any, Any]]:
        buf = np.random.default_rng(g.rank).uniform(0.5, 1.5, 37)
        handle = g.allreduce(buf, op=op, algorithm="star")
        await handle
        return not isinstance(handle, asyncio.Task), buf

    results = await run_ranks(n, body, transport="tcp", links="eager")
    want = reference([np.random.default_rng(r).uniform(0.5, 1.5, 37) for r in range(n)], op)
    for task_free, got in results:
        assert task_free
        np.testing.assert_allclose(got, want, rtol=1e-12)
        assert got.tobytes() == results[0][1].tobytes()


@pytest.mark.parametrize("transport", ["memory", "tcp"])
async def test_many_frames_forced_star(transport: str) -> None:
    """Forced on a buffer of many frames (the coroutine path, 64-byte chunks), several in
    flight."""

    async def body(g: ac.Group) -> list[np.ndarray[Any, Any]]:
        bufs = [np.full(1000, g.rank * 10 + i, np.int64) for i in range(8)]
        handles = [g.allreduce(b, algorithm="star") for b in bufs]
        assert all(isinstance(h, asyncio.Task) for h in handles)
        await asyncio.gather(*handles)
        return bufs

    for bufs in await run_ranks(4, body, transport=transport, chunk_bytes=64):
        for i, b in enumerate(bufs):
            assert (b == sum(r * 10 + i for r in range(4))).all()


@pytest.mark.parametrize(
    ("n", "transport", "collective", "default", "other"),
    [
        (4, "memory", "allreduce", "star", "recursive_doubling"),
        (3, "tcp", "barrier", "star", "dissemination"),
        (8, "memory", "allreduce", "star", "recursive_doubling"),  # one thread: any size
        (8, "memory", "barrier", "star", "dissemination"),
        (5, "tcp", "allreduce", "recursive_doubling", "star"),  # processes' links: not
        (5, "tcp", "barrier", "dissemination", "star"),
    ],
)
async def test_the_default_against_a_forced_algorithm_is_a_mismatch(
    n: int, transport: str, collective: str, default: str, other: str
) -> None:
    """What the automatic choice took, shown by forcing another algorithm on one rank:
    MismatchError on every rank, naming both."""

    async def body(g: ac.Group) -> str:
        alg = other if g.rank == 2 else None
        try:
            if collective == "barrier":
                await g.barrier(algorithm=alg)
            else:
                await g.allreduce(np.ones(4), algorithm=alg)
        except ac.MismatchError as exc:
            return str(exc)
        except ac.GroupBrokenError as exc:  # called after the group broke (in the call)
            cause = exc.__cause__
            return str(cause) if isinstance(cause, ac.MismatchError) else repr(exc)
        return "no error"

    for message in await run_ranks(n, body, transport=transport, timeout=10):
        assert f"{collective}[{default}]" in message
        assert f"{collective}[{other}]" in message


@pytest.mark.parametrize("uvloop", [False, True], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("n", [3, 4])
async def test_in_processes_over_the_default_transport(
    n: int, transport: str, uvloop: bool
) -> None:
    """Real processes; auto is shared memory on this host. Counts from 4 B to one past the
    star's largest, 16 in flight of each op, checked on every rank, identical everywhere."""
    job = spawn_ranks(n, star_targets.star_mix, 16, timeout=100, transport=transport, uvloop=uvloop)
    digests = await job
    assert len(set(digests)) == 1
