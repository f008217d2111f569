"""Bodies for tests/collectives/test_star.py and test_barrier.py that run in spawned rank
processes."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import numpy as np

import aiocollect as ac

#: float32 element counts: 4 B, 4 KiB, the star's largest (16 KiB), one past it.
COUNTS = (1, 1024, 4096, 4097)


def _inputs(rank: int, count: int, i: int) -> np.ndarray[Any, Any]:
    # integer-valued floats: every order of summation gives the same exact result
    return ((np.arange(count, dtype=np.float32) * (i + 1) + rank) % 1000).astype(np.float32)


async def star_mix(g: ac.Group, in_flight: int, counts: tuple[int, ...] = COUNTS) -> str:
    """For every count, ``in_flight`` SUM allreduces and as many AVG ones at once (the
    default algorithm), each checked against numpy; returns a digest of every result,
    which must be the same on every rank (the root's bits)."""
    n, digest = g.world_size, hashlib.sha256()
    for count in counts:
        sums = [_inputs(g.rank, count, i) for i in range(in_flight)]
        avgs = [np.random.default_rng((g.rank, count, i)).random(count) for i in range(in_flight)]
        handles = [g.allreduce(b) for b in sums]
        handles += [g.allreduce(b, op=ac.AVG) for b in avgs]
        await asyncio.gather(*handles)
        for i, got in enumerate(sums):
            want = np.sum([_inputs(r, count, i) for r in range(n)], axis=0)
            np.testing.assert_array_equal(got, want, f"SUM count={count} op {i}")
        for i, got in enumerate(avgs):
            want = np.mean(
                [np.random.default_rng((r, count, i)).random(count) for r in range(n)], axis=0
            )
            np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=f"AVG count={count}")
        for arr in sums + avgs:
            digest.update(arr.tobytes())
    return digest.hexdigest()


async def barriers(g: ac.Group, rounds: int) -> int:
    """``rounds`` default barriers; before each a rank counts itself in the store, after it
    the count must be the world size (nobody left early). Returns the rounds passed."""
    passed = 0
    for k in range(rounds):
        await g.store.add(f"star-barrier/{k}", 1)
        await g.barrier()
        count = await g.store.add(f"star-barrier/{k}", 0)
        assert count == g.world_size, (k, count)
        passed += 1
    return passed
