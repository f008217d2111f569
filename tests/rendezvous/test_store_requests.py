"""Store requests per rank during rendezvous do not grow with the world size.

Every rank's store is a counting view of one real store (like the fault-injection views of
aiocollect.testing.faultproxy): groups of 8 and 64 ranks form on one event loop and close,
and the requests of all ranks together, divided by the world size, must stay the same.

Run as a script to print the table of docs/multinode.md ("Forming large groups")::

    PYTHONPATH=. python tests/rendezvous/test_store_requests.py 8 64 256
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import sys
from collections.abc import Hashable, Sequence

import pytest

import aiocollect as ac
from aiocollect.store import MemoryStore, Store

_ids = itertools.count()


class CountingStore(Store):
    """A view of ``inner`` that counts the requests made through it, by operation, in
    ``counts`` (shared by every view of one test). Closing it does not close ``inner``."""

    def __init__(self, inner: Store, counts: collections.Counter[str]) -> None:
        self.inner = inner
        self.counts = counts
        self.timeout = inner.timeout

    @property
    def shared_reads(self) -> Hashable | None:
        return self.inner.shared_reads  # (it reads what the inner store holds)

    async def set(self, key: str, value: bytes) -> None:
        self.counts["set"] += 1
        await self.inner.set(key, value)

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        self.counts["get"] += 1
        return await self.inner.get(key, timeout=timeout)

    async def multi_get(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes]:
        self.counts["multi_get"] += 1
        return await self.inner.multi_get(keys, timeout=timeout)

    async def add(self, key: str, amount: int) -> int:
        self.counts["add"] += 1
        return await self.inner.add(key, amount)

    async def wait(self, keys: Sequence[str], *, timeout: float | None = None) -> None:
        self.counts["wait"] += 1
        await self.inner.wait(keys, timeout=timeout)

    async def check(self, keys: Sequence[str]) -> list[bool]:
        self.counts["check"] += 1
        return await self.inner.check(keys)

    async def delete(self, key: str) -> bool:
        self.counts["delete"] += 1
        return await self.inner.delete(key)


async def requests_per_rank(world_size: int) -> tuple[float, collections.Counter[str]]:
    """Form and close a group of ``world_size`` ranks on this loop (memory transport, one
    memory store); return the store requests per rank and their counts by operation."""
    inner = MemoryStore(f"count-{next(_ids)}")
    counts: collections.Counter[str] = collections.Counter()
    groups = await asyncio.gather(
        *(
            ac.open_group(
                r,
                world_size,
                store=CountingStore(inner, counts),
                transport="memory",
                timeout=120,
            )
            for r in range(world_size)
        )
    )
    await asyncio.gather(*(g.aclose() for g in groups))
    await inner.close()
    return sum(counts.values()) / world_size, counts


@pytest.mark.timeout(120)
async def test_store_requests_per_rank_do_not_grow_with_world_size() -> None:
    small, small_counts = await requests_per_rank(8)
    large, large_counts = await requests_per_rank(64)
    print(f"requests per rank: 8 ranks {small:.2f} {dict(small_counts)}")
    print(f"requests per rank: 64 ranks {large:.2f} {dict(large_counts)}")
    # A rank waits for the others in slices of a second or more, and each slice that ends
    # costs three requests: a slow machine may add a slice or two to the larger group.
    assert large <= small + 6, (small_counts, large_counts)


@pytest.mark.timeout(120)
async def test_the_ranks_of_one_event_loop_read_the_records_once() -> None:
    """64 ranks on one loop: one ``multi_get`` reads every record, for all of them (a
    process hosting R ranks of an N-rank group reads N records, not R x N)."""
    _, counts = await requests_per_rank(64)
    assert counts["multi_get"] == 1, counts


async def _main(sizes: list[int]) -> None:
    for n in sizes:
        per_rank, counts = await requests_per_rank(n)
        print(
            f"{n:5d} ranks: {per_rank:6.2f} store requests per rank {dict(sorted(counts.items()))}"
        )


if __name__ == "__main__":
    asyncio.run(_main([int(a) for a in sys.argv[1:]] or [8, 64, 256]))
