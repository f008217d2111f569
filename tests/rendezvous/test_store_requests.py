"""Store requests per rank during rendezvous do not grow with the world size.

Every rank's store is a counting view of one real store (like the fault-injection views of
aiocollect.testing.faultproxy): groups of 8 and 64 ranks form on one event loop and close,
and the requests of all ranks together, divided by the world size, must stay the same.
With views that read on their own (as one rank per process does), a group larger than
``digest.DIGEST_MIN`` forms through rank 0's digest: a rank reads the records of the peers
it links, not every rank's, and a peer's at first use, the peers of one alltoall in one
request. A mismatch that only the digest finds fails every rank with rank 0's message,
and a rank 0 that dies before publishing the digest fails every other rank at once.

Run as a script to print the table of docs/multinode.md ("Forming large groups"), or with
``--digest`` the formation times through the digest and with every rank reading every
record (docs/design.md, "The rendezvous digest")::

    PYTHONPATH=. python tests/rendezvous/test_store_requests.py 8 64 256
    PYTHONPATH=. python tests/rendezvous/test_store_requests.py --digest 8 17 32 64
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import os
import sys
import time
from collections.abc import Hashable, Sequence
from pathlib import Path

import msgpack
import numpy as np
import pytest

import aiocollect as ac
from aiocollect.collectives.neighbours import neighbours
from aiocollect.rendezvous import digest
from aiocollect.store import FileStore, MemoryStore, Store

REPO = Path(__file__).resolve().parents[2]

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
        self.counts["records"] += "/rank/" in key
        return await self.inner.get(key, timeout=timeout)

    async def multi_get(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes]:
        self.counts["multi_get"] += 1
        self.counts["records"] += sum("/rank/" in k for k in keys)
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


class OwnReads(CountingStore):
    """A counting view whose reads are its own (as a process hosting one rank reads)."""

    @property
    def shared_reads(self) -> Hashable | None:
        return None


class Rewrites(OwnReads):
    """A counting view that publishes its rank's record with ``chunk_bytes`` changed (a
    record that differs from what its rank checks: only a reader of it sees that)."""

    async def set(self, key: str, value: bytes) -> None:
        if "/rank/" in key:
            value = msgpack.packb({**msgpack.unpackb(value), "chunk_bytes": 12345})
        await super().set(key, value)


async def requests_per_rank(world_size: int) -> tuple[float, collections.Counter[str]]:
    """Form and close a group of ``world_size`` ranks on this loop (memory transport, one
    memory store); return the store requests per rank and their counts by operation (and
    ``records``: the records read, which are no requests)."""
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
    return sum(v for k, v in counts.items() if k != "records") / world_size, counts


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


@pytest.mark.timeout(120)
async def test_a_rank_of_a_large_group_reads_the_records_of_its_peers_only() -> None:
    """32 ranks, each reading on its own: rank 0 reads all 32 records, every other rank
    the digest, rank 0's record and the records of its neighbours (at most 3 log2(32) + 2 =
    17), not 32;
    an alltoall then reads the records of the peers it links in one request per rank."""
    n = 32
    inner = MemoryStore(f"count-{next(_ids)}")
    counts = [collections.Counter[str]() for _ in range(n)]
    stores = [OwnReads(inner, counts[r]) for r in range(n)]
    groups = await asyncio.gather(
        *(ac.open_group(r, n, store=stores[r], transport="tcp", timeout=60) for r in range(n))
    )
    try:
        formed = [dict(c) for c in counts]
        assert formed[0]["records"] == n, formed[0]
        for r in range(1, n):  # (+1: rank 0's record, read for the early settings check)
            assert formed[r]["records"] <= len(neighbours(n, r)) + 1, (r, formed[r])
            assert formed[r]["records"] <= 3 * math.log2(n) + 3, (r, formed[r])
        bufs = [np.full(4, r, dtype=np.int64) for r in range(n)]
        await asyncio.gather(*(g.allreduce(b) for g, b in zip(groups, bufs, strict=True)))
        assert all(int(b[0]) == n * (n - 1) // 2 for b in bufs)
        before = [c["multi_get"] + c["get"] for c in counts]
        outs = await asyncio.gather(
            *(g.alltoall(np.arange(n, dtype=np.int64) + n * g.rank) for g in groups)
        )
        for r, out in enumerate(outs):
            assert [int(x) for x in out] == [n * p + r for p in range(n)], r
        for r in range(1, n):  # (rank 0 has every record)
            assert counts[r]["multi_get"] + counts[r]["get"] - before[r] <= 2, (r, counts[r])
            assert counts[r]["records"] <= n, (r, counts[r])  # (rank 0's twice)
    finally:
        await asyncio.gather(*(g.aclose() for g in groups))
        await inner.close()
    print("records read per rank:", [c["records"] for c in counts])


@pytest.mark.timeout(60)
async def test_a_mismatch_that_only_the_digest_finds_fails_every_rank() -> None:
    """Rank 5's record says another chunk size than rank 5 itself checks: rank 0 finds it
    while making the digest, and every rank of the 20 raises rank 0's message."""
    n, inner = 20, MemoryStore(f"count-{next(_ids)}")
    assert digest.used(n)
    counts: collections.Counter[str] = collections.Counter()
    stores = [(Rewrites if r == 5 else CountingStore)(inner, counts) for r in range(n)]
    got = await asyncio.gather(
        *(ac.open_group(r, n, store=stores[r], transport="memory", timeout=30) for r in range(n)),
        return_exceptions=True,
    )
    await inner.close()
    for r, exc in enumerate(got):
        assert isinstance(exc, ac.RendezvousError), (r, exc)
        assert "rank 5 joined group 'default' with chunk_bytes=12345 but rank 0 has" in str(exc)


@pytest.mark.timeout(90)
async def test_a_rank_0_that_dies_before_its_digest_fails_every_rank(tmp_path: Path) -> None:
    """Rank 0 (another process) exits where it would publish the digest: the other 19
    ranks fail with RendezvousError naming it within seconds, not at their deadline."""
    n, spec, name = 20, f"file://{tmp_path}/store", f"dies-{next(_ids)}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.targets.digest_child",
        spec,
        name,
        str(n),
        cwd=REPO,
        env=dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        ),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 40)).decode()
        assert line.startswith("ready"), line
        store = FileStore(tmp_path / "store", timeout=30)
        start = time.monotonic()
        got = await asyncio.gather(
            *(
                ac.open_group(r, n, store=store, name=name, transport="tcp", timeout=60)
                for r in range(1, n)
            ),
            return_exceptions=True,
        )
        took = time.monotonic() - start
        assert await proc.wait() == 9
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    for r, exc in enumerate(got, 1):
        assert isinstance(exc, ac.RendezvousError), (r, exc)
        assert f"rank {r}: rank 0 of group {name!r}" in str(exc), exc
        assert "exited before publishing the group's digest" in str(exc), exc
    assert took < 30, took


async def _formation_s(n: int) -> float:
    """Seconds ``n`` ranks on this loop take to form (TCP links, each rank's store a view
    that reads on its own, as one rank per process reads)."""
    inner = MemoryStore(f"count-{next(_ids)}")
    stores = [OwnReads(inner, collections.Counter()) for _ in range(n)]
    start = time.perf_counter()
    groups = await asyncio.gather(
        *(ac.open_group(r, n, store=stores[r], transport="tcp", timeout=60) for r in range(n))
    )
    took = time.perf_counter() - start
    await asyncio.gather(*(g.aclose() for g in groups))
    await inner.close()
    return took


async def _digest_or_not(sizes: list[int], rounds: int = 7) -> None:
    """Formation through the digest against every rank reading every record, paired."""
    chosen = digest.DIGEST_MIN
    try:
        for n in sizes:
            times: dict[str, list[float]] = {"digest": [], "every record": []}
            for _ in range(rounds):
                for how, threshold in (("digest", 1), ("every record", 1 << 30)):
                    digest.DIGEST_MIN = threshold
                    times[how].append(await _formation_s(n))
            shown = ", ".join(
                f"{k} {sorted(v)[rounds // 2] * 1e3:.0f} ms" for k, v in times.items()
            )
            print(f"{n:5d} ranks form: {shown} (medians of {rounds})")
    finally:
        digest.DIGEST_MIN = chosen


async def _main(sizes: list[int]) -> None:
    for n in sizes:
        per_rank, counts = await requests_per_rank(n)
        print(
            f"{n:5d} ranks: {per_rank:6.2f} store requests per rank {dict(sorted(counts.items()))}"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--digest"]:
        asyncio.run(_digest_or_not([int(a) for a in sys.argv[2:]] or [8, 17, 32, 64]))
    else:
        asyncio.run(_main([int(a) for a in sys.argv[1:]] or [8, 64, 256]))
