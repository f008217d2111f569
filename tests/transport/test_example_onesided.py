"""Giving a transport one-sided reads is one link with the seam and a record that declares
it: the example of example_onesided.py, registered here, forms groups whose records
predict reads, so the automatic choice takes the pull algorithms, which read through the
seam only: exact results, every exposure ended afterwards, and the reads counted."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.collectives import select
from aiocollect.rendezvous.chunking import PULLED_CHUNK_BYTES
from aiocollect.store import MemoryStore
from aiocollect.transport import registry
from tests.transport.example_onesided import ONE_SIDED, OneSidedLink

pytestmark = pytest.mark.timeout(60)
_names = itertools.count()


@pytest.fixture(autouse=True)
def one_sided() -> Iterator[None]:
    with registry.registered(ONE_SIDED):
        yield


def _links(g: ac.Group) -> list[OneSidedLink]:
    links = list(g._fabric.links.values())
    assert all(isinstance(link, OneSidedLink) for link in links)
    return links  # type: ignore[return-value]


async def _run(n: int, count: int, algorithm: str | None) -> list[dict[str, object]]:
    """An allreduce (SUM and AVG), allgather, reduce_scatter and broadcast of ``count``
    float64 elements per rank (``algorithm``, or the automatic choice) over the example
    transport, each checked exactly; per rank: the algorithm the automatic choice takes
    for such an allreduce, bytes read through the seam, exposures left, chunk size."""
    name = f"onesided-{next(_names)}"
    pattern = np.arange(count, dtype=np.float64) % 1009

    async def one(rank: int) -> dict[str, object]:
        async with ac.open_group(
            rank, n, store=MemoryStore(name), transport=ONE_SIDED.name, name=name, timeout=10
        ) as g:
            x = pattern * (rank + 1)
            await g.allreduce(x, algorithm=algorithm)
            np.testing.assert_array_equal(x, pattern * (n * (n + 1) // 2))
            y = np.full(count, float(rank + 1))
            await g.allreduce(y, op=ac.ReduceOp.AVG, algorithm=algorithm)
            np.testing.assert_array_equal(y, np.full(count, (n + 1) / 2))
            got = await g.allgather(pattern + rank, algorithm=algorithm)
            np.testing.assert_array_equal(got, [pattern + q for q in range(n)])
            mine = await g.reduce_scatter(np.tile(pattern, n) + rank, algorithm=algorithm)
            np.testing.assert_array_equal(mine, pattern * n + n * (n - 1) // 2)
            z = pattern * 3 if rank == n - 1 else np.zeros(count)
            await g.broadcast(z, root=n - 1, algorithm=algorithm)
            np.testing.assert_array_equal(z, pattern * 3)
            links = _links(g)
            return {
                "chosen": g.chosen_algorithm("allreduce", count * 8),
                "read": sum(link.bytes_read for link in links) > 0,
                "exposed": sum(len(link.exposures) for link in links),
                "chunk": g.chunk_bytes,
            }

    return list(await asyncio.gather(*(one(r) for r in range(n))))


@pytest.mark.parametrize("n", [2, 3])
async def test_the_automatic_choice_reads_through_the_example(n: int) -> None:
    """Large operations: the records predict reads (the larger chunk, the pull
    algorithms), every rank reads through the seam, and no exposure outlives its
    operation."""
    count = select.SEGMENT_MAX // 8 + 3  # (the pull allreduce; blocks of unequal sizes)
    res = await _run(n, count, None)
    want = {"chosen": "pull", "read": True, "exposed": 0, "chunk": PULLED_CHUNK_BYTES}
    assert res == [want] * n


async def test_a_forced_pull_on_small_buffers_is_exact() -> None:
    """``algorithm="pull"`` on a few elements (fewer than ranks: empty blocks) reads
    exactly too."""
    res = await _run(3, 2, "pull")
    assert [r["exposed"] for r in res] == [0, 0, 0]
    assert all(r["read"] for r in res)
