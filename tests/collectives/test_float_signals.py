"""Reductions follow IEEE 754 whatever numpy's error state: a sum that overflows is inf on
every rank, never an error. numpy raises from a ufunc whose result overflowed when the
caller's ``np.errstate`` says "raise", or when a warnings filter turns its RuntimeWarning
into an error (this suite's own ``filterwarnings = error``); inside a collective that
broke the group on the ranks that happened to compute the overflowing sums, labelled an
internal error, while a rank that had its result already returned it. Every path that
reduces is covered: the one-frame programs (recursive doubling, the star), the Task
algorithms (ring, halving-doubling, recursive doubling, the star), the worker-thread
reduction of large buffers, the pull allreduce and reduce-scatter, the tree reduce and the
AVG division, over memory, tcp and the default transport."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

BIG = np.float32(3e38)  # two of them overflow float32
#: (transport, ranks, float32 elements, algorithm): the one-frame programs, the Task
#: algorithms, a buffer large enough for the worker thread (8 MiB in one reduction), and
#: the pull allreduce (1 MiB and more, shared memory).
ALLREDUCE_CASES = [
    ("memory", 2, 1, None),
    ("memory", 4, 1, None),
    ("tcp", 3, 5, None),
    ("auto", 2, 1, None),
    ("auto", 4, 1, None),
    ("memory", 3, 50_000, "ring"),
    ("tcp", 4, 50_000, "halving_doubling"),
    ("memory", 2, 50_000, "recursive_doubling"),
    ("memory", 4, 50_000, "star"),
    ("memory", 2, 1 << 21, "recursive_doubling"),
    ("auto", 2, 1 << 20, "pull"),
    ("auto", 3, 1 << 18, "pull"),
]


def _inputs(rank: int, count: int) -> np.ndarray[Any, Any]:
    """Ones, with BIG at the first and last element (and at the middle on rank 0)."""
    buf = np.ones(count, np.float32)
    buf[0] = buf[-1] = BIG
    if rank == 0:
        buf[count // 2] = BIG
    return buf


def _want(op: Any, n: int, count: int) -> np.ndarray[Any, Any]:
    """The IEEE result of reducing every rank's :func:`_inputs`: inf where every rank has
    BIG, the reduction of the ones elsewhere, and where only rank 0 has BIG, BIG (BIG / n
    for AVG: BIG plus a few ones is BIG in float32)."""
    ones = {ac.ReduceOp.SUM: float(n), ac.ReduceOp.AVG: 1.0, ac.ReduceOp.PROD: 1.0}[op]
    want = np.full(count, ones, np.float32)
    want[count // 2] = BIG if op is not ac.ReduceOp.AVG else BIG / n
    want[0] = want[-1] = np.inf
    return want


@contextlib.contextmanager
def _signals(mode: str) -> Any:
    """numpy's error state for the whole run: "raise" (FloatingPointError), or "warn"
    (numpy's default: a RuntimeWarning, which this suite's filter makes an error)."""
    with np.errstate(all=mode):  # type: ignore[arg-type]
        yield


@pytest.mark.parametrize("mode", ["raise", "warn"])
@pytest.mark.parametrize("op", [ac.ReduceOp.SUM, ac.ReduceOp.AVG, ac.ReduceOp.PROD])
@pytest.mark.parametrize(("transport", "n", "count", "algorithm"), ALLREDUCE_CASES)
async def test_an_overflowing_allreduce_is_inf_on_every_rank(
    transport: str, n: int, count: int, algorithm: str | None, op: Any, mode: str
) -> None:
    async def body(g: ac.Group) -> np.ndarray[Any, Any]:
        buf = _inputs(g.rank, count)
        await g.allreduce(buf, op=op, algorithm=algorithm)
        after = np.ones(4, np.float32)  # the group goes on
        await g.allreduce(after)
        assert (after == g.world_size).all()
        return buf

    with _signals(mode):
        results = await run_ranks(n, body, transport=transport)
    want = _want(op, n, count)
    for got in results:
        np.testing.assert_array_equal(got, want)
        assert got.tobytes() == results[0].tobytes()


@pytest.mark.parametrize("mode", ["raise", "warn"])
@pytest.mark.parametrize(
    ("transport", "n", "count"), [("memory", 3, 5), ("tcp", 4, 50_000), ("auto", 2, 1 << 20)]
)
async def test_overflowing_reduce_and_reduce_scatter_give_inf(
    transport: str, n: int, count: int, mode: str
) -> None:
    count -= count % n  # (reduce_scatter: equal blocks)

    async def body(g: ac.Group) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        buf = _inputs(g.rank, count)
        await g.reduce(buf, root=n - 1, op=ac.ReduceOp.AVG)
        send = _inputs(g.rank, count)
        dest = np.empty(count // n, np.float32)
        await g.reduce_scatter(send, dest)
        return buf, dest

    with _signals(mode):
        results = await run_ranks(n, body, transport=transport)
    reduced, _ = results[n - 1]
    np.testing.assert_array_equal(reduced, _want(ac.ReduceOp.AVG, n, count))
    total = _want(ac.ReduceOp.SUM, n, count)
    for rank, (_, block) in enumerate(results):
        np.testing.assert_array_equal(block, total[rank * (count // n) : (rank + 1) * (count // n)])
