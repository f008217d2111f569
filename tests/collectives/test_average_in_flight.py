"""AVG allreduces divide the result in place at the end: nothing this rank sent out of the
same buffer may still be waiting to leave it then, or the peer receives the divided values
and divides them again (a silent wrong result: a third of the values at three ranks).

The doubling algorithms at a world size that is not a power of two end by sending the
result to the folded rank (``_unfold``), and the halving one's last gather step sends half
the buffer; with several operations in flight those payloads often wait in the link's
queue (TCP's transport buffer, the shared-memory ring's queue or a reference not yet
pulled) while the operation goes on to divide. Found by tests/collectives/test_star.py
once small shared-memory frames went on the socket (frames behind them wait in the
queue); 35-48 of 48 results were wrong on the folded rank before the fix. Real links:
in-process ranks over loopback TCP and over shared memory, every result compared."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks

ALGORITHMS = ["recursive_doubling", "halving_doubling", "ring", "star", "pull"]


async def _averages(g: ac.Group, algorithm: str, count: int, in_flight: int) -> int:
    """``in_flight`` AVG allreduces of ``count`` float64 at once, twice; returns how many
    results differ from numpy's mean."""
    n, wrong = g.world_size, 0
    for rnd in range(2):
        bufs = [np.random.default_rng((g.rank, rnd, i)).random(count) for i in range(in_flight)]
        await asyncio.gather(*(g.allreduce(b, op=ac.AVG, algorithm=algorithm) for b in bufs))
        for i, got in enumerate(bufs):
            parts = [np.random.default_rng((r, rnd, i)).random(count) for r in range(n)]
            if not np.allclose(got, np.mean(parts, axis=0), rtol=1e-12, atol=0):
                wrong += 1
    return wrong


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
async def test_average_with_sends_in_flight(algorithm: str, transport: str) -> None:
    for count in (4097, 300_000):
        wrong = await run_ranks(3, _averages, algorithm, count, 12, transport=transport)
        assert wrong == [0, 0, 0], (algorithm, transport, count, wrong)
