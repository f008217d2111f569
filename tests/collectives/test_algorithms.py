"""Every collective x every algorithm x world sizes 1-8 x counts x dtype classes x ops x
roots, against numpy — in one process (memory, TCP and shared memory) and in separate
processes (the default transport, and shared memory forced)."""

from __future__ import annotations

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks
from tests.support.algorithms import sweep_algorithms
from tests.support.collectives import CHUNK
from tests.support.transports import Axis

pytestmark = pytest.mark.timeout(300)


#: The dtype classes at 8 ranks: one of each item size (1, 2, 4 and 8 bytes: the counts of
#: counts_for and the chunk boundaries they cross), and between them every op. The others
#: (uint8: bool's size and counts, int32's ops; float32: int32's size and counts, float16's
#: ops) run at every other world size; what 8 ranks add is the third doubling round, which
#: depends on the world size and the count, not on the element type.
EIGHT_DTYPES = [np.dtype(d) for d in ("bool", "float16", "int32", "complex64")]


#: World sizes: one, the smallest pair, odd ones (3, 5: the folds of recursive doubling and
#: halving-doubling), and 8 (three doubling rounds); 4, 6 and 7 add no code path.
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
async def test_algorithms_memory(n: int) -> None:
    res = await run_ranks(n, sweep_algorithms, EIGHT_DTYPES if n == 8 else None, chunk_bytes=CHUNK)
    assert res[0] > 100


#: The algorithms' code is the same over every link: the sweep of every mode is in
#: test_sweep.py, this one over TCP, the default path and shared memory by name (memory:
#: test_algorithms_memory).
@pytest.mark.transports(
    argnames="n", values={"tcp": [3, 5], "auto": [3], "shm": [3, 5]}, default=[]
)
async def test_algorithms(axis: Axis, n: int) -> None:
    dtypes = [np.dtype(np.int32), np.dtype(np.float32)]
    res = await axis.run(n, sweep_algorithms, dtypes, chunk_bytes=CHUNK)
    assert res[0] > 20


@pytest.mark.transports(
    argnames="n", values={"auto": [2, 5], "shm": [2, 8]}, default=[], where="processes"
)
async def test_algorithms_in_processes(axis: Axis, n: int) -> None:
    """The sweep between processes (pulls read another process's memory there): bool (item
    size 1, every integer op) and float64 (item size 8, AVG); int64 would repeat float64's
    item size and counts and bool's ops, whose kernels test_algorithms_memory checks."""
    dtypes = [np.dtype(np.bool_), np.dtype(np.float64)]
    res = await axis.spawn(n, sweep_algorithms, dtypes, timeout=250, chunk_bytes=CHUNK)
    assert len(set(res)) == 1


async def test_unknown_algorithm_is_usage_error() -> None:
    async def body(g: ac.Group) -> None:
        with pytest.raises(ac.UsageError, match="ring"):
            g.allreduce(np.zeros(3), algorithm="bogus")
        with pytest.raises(ac.UsageError):
            g.broadcast(np.zeros(3), algorithm="ring")

    await run_ranks(2, body)


async def test_forced_algorithm_disagreement_is_a_mismatch() -> None:
    async def body(g: ac.Group) -> str:
        alg = "ring" if g.rank == 0 else "recursive_doubling"
        try:
            await g.allreduce(np.ones(8), algorithm=alg)
        except ac.MismatchError as exc:
            return str(exc)
        return "no error"

    res = await run_ranks(2, body, timeout=10)
    assert all("allreduce[ring]" in m and "allreduce[recursive_doubling]" in m for m in res)
