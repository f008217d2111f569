"""Ring reduce-scatter with a bounded, reused receive window (aiocollect.engine.scratch).

The window is made a few chunks wide (``RS_WINDOW_BYTES`` patched, tiny ``chunk_bytes``) so
blocks are many windows long and every slot is reused many times; results are checked
against numpy for allreduce and reduce_scatter, alone and several at once on one group.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect._buffers import Array
from aiocollect.collectives import ring
from aiocollect.engine.scratch import ScratchPool, size_class
from aiocollect.testing import run_ranks
from tests.support.collectives import assert_close, data, reference

pytestmark = pytest.mark.timeout(120)

CHUNK = 64  # bytes: 16 float32 / 8 int64 per frame
DTYPES: list[np.dtype[Any]] = [np.dtype(np.float32), np.dtype(np.int64)]
OPS = [ac.ReduceOp.SUM, ac.ReduceOp.MAX]


class CheckingPool(ScratchPool):
    """A pool that fails the test if two live leases share memory, and counts reuse."""

    def __init__(self, cap_bytes: int, min_bytes: int = 0) -> None:
        super().__init__(cap_bytes=cap_bytes, min_bytes=min_bytes)
        self.live: list[Array] = []
        self.requests: list[int] = []
        self.peak_live = 0
        self.reused = 0
        self.discarded = 0
        self._seen: set[int] = set()

    def acquire(self, count: int, dtype: np.dtype[Any]) -> Array:
        arr = super().acquire(count, dtype)
        for other in self.live:
            assert not np.shares_memory(arr, other), "two live leases share memory"
        self.requests.append(arr.nbytes)
        addr = arr.__array_interface__["data"][0]
        self.reused += addr in self._seen
        self._seen.add(addr)
        self.live.append(arr)
        self.peak_live = max(self.peak_live, len(self.live))
        assert self.retained_bytes <= self.cap_bytes
        return arr

    def _forget(self, arr: Array) -> None:
        self.live = [a for a in self.live if a is not arr]

    def release(self, arr: Array) -> None:
        self._forget(arr)
        super().release(arr)
        assert self.retained_bytes <= self.cap_bytes

    def discard(self, arr: Array) -> None:
        self._forget(arr)
        self.discarded += 1
        super().discard(arr)


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> CheckingPool:
    """A three-chunk window (not a divisor of the block's chunk count) from a checked pool."""
    monkeypatch.setattr(ring, "RS_WINDOW_BYTES", 3 * CHUNK)
    p = CheckingPool(cap_bytes=8 * 3 * CHUNK)
    monkeypatch.setattr(ring, "SCRATCH", p)
    return p


def _count(n: int, per_rank: int, extra: int) -> int:
    return n * per_rank + extra


async def _allreduce_body(g: ac.Group, count: int, delay_rank: int | None) -> int:
    checked = 0
    for dtype in DTYPES:
        for op in OPS:
            if g.rank == delay_rank:
                await asyncio.sleep(0.05)  # peers' frames arrive before receives are posted
            mine = data(g.rank, count, dtype, seed=int(op))
            buf = mine.copy()
            await g.allreduce(buf, op=op, algorithm="ring")
            want = reference([data(r, count, dtype, seed=int(op)) for r in range(g.world_size)], op)
            assert_close(buf, want, f"allreduce {dtype} {op} count={count}")
            checked += 1
    return checked


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_ring_allreduce_many_windows_memory(n: int, pool: CheckingPool) -> None:
    # Uneven blocks: count is not a multiple of n, and blocks are not whole chunks.
    count = _count(n, 300, 5)
    res = await run_ranks(n, _allreduce_body, count, 1, chunk_bytes=CHUNK)
    assert res == [len(DTYPES) * len(OPS)] * n
    assert pool.live == []
    assert pool.leased == 0
    assert max(pool.requests) <= 3 * CHUNK  # never more than the window
    assert pool.reused > 0


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_ring_allreduce_many_windows_tcp(n: int, pool: CheckingPool) -> None:
    count = _count(n, 257, n - 1)
    res = await run_ranks(n, _allreduce_body, count, None, transport="tcp", chunk_bytes=CHUNK)
    assert res == [len(DTYPES) * len(OPS)] * n
    assert pool.leased == 0
    assert max(pool.requests) <= 3 * CHUNK


@pytest.mark.parametrize("count", [0, 1, 2, 3, 7, 17, 100])
async def test_ring_allreduce_small_and_degenerate_counts(count: int, pool: CheckingPool) -> None:
    """Empty blocks, single-element blocks and blocks smaller than one chunk."""
    res = await run_ranks(4, _allreduce_body, count, None, chunk_bytes=CHUNK)
    assert res == [len(DTYPES) * len(OPS)] * 4
    assert pool.leased == 0


@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize("n", [2, 3, 4])
async def test_ring_reduce_scatter_many_windows(n: int, transport: str, pool: CheckingPool) -> None:
    per = 203  # per-rank block of 203 elements: 12.7 float32 chunks / 25.4 int64 chunks

    async def body(g: ac.Group) -> int:
        checked = 0
        for dtype in DTYPES:
            for op in OPS:
                send = data(g.rank, n * per, dtype, seed=3 + int(op))
                got = await g.reduce_scatter(send, op=op, algorithm="ring")
                want = reference([data(r, n * per, dtype, seed=3 + int(op)) for r in range(n)], op)[
                    g.rank * per : (g.rank + 1) * per
                ]
                assert_close(got, want, f"reduce_scatter {dtype} {op}")
                checked += 1
        return checked

    res = await run_ranks(n, body, transport=transport, chunk_bytes=CHUNK)
    assert res == [len(DTYPES) * len(OPS)] * n
    assert pool.leased == 0
    assert max(pool.requests) <= 3 * CHUNK


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_concurrent_ring_allreduces_share_no_scratch(n: int, pool: CheckingPool) -> None:
    """Four ring allreduces in flight at once on one group, three times over: each gets
    its own window (CheckingPool asserts no overlap) and the results are all correct."""
    count = _count(n, 150, 1)

    async def body(g: ac.Group) -> None:
        for rnd in range(3):
            cases: list[tuple[np.dtype[Any], ac.ReduceOp]] = [
                (np.dtype(np.float32), ac.ReduceOp.SUM),
                (np.dtype(np.int64), ac.ReduceOp.MAX),
            ]
            for dtype, op in cases:
                seeds = [10 * rnd + k + int(op) for k in range(4)]
                bufs = [data(g.rank, count, dtype, seed=s) for s in seeds]
                await asyncio.gather(*[g.allreduce(b, op=op, algorithm="ring") for b in bufs])
                for b, s in zip(bufs, seeds, strict=True):
                    want = reference([data(r, count, dtype, seed=s) for r in range(n)], op)
                    assert_close(b, want, f"concurrent {dtype} {op} seed={s}")

    await run_ranks(n, body, chunk_bytes=CHUNK)
    assert pool.peak_live >= 2  # operations really overlapped
    assert pool.reused > 0  # and later ones reused earlier windows
    assert pool.leased == 0
    assert pool.discarded == 0
    assert pool.retained_bytes <= pool.cap_bytes


async def test_window_size_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the real 16 MiB window constant scaled down 64x (and 16 KiB chunks), a 2 MiB
    allreduce leases exactly the window (16 chunks), not a block."""
    monkeypatch.setattr(ring, "RS_WINDOW_BYTES", 256 * 1024)
    p = CheckingPool(cap_bytes=1 << 20, min_bytes=64 * 1024)
    monkeypatch.setattr(ring, "SCRATCH", p)

    async def body(g: ac.Group) -> None:
        for _ in range(3):
            buf = np.full(512 * 1024, g.rank + 1, np.float32)
            await g.allreduce(buf, algorithm="ring")
            np.testing.assert_array_equal(buf, np.full(buf.size, 3, np.float32))

    await run_ranks(2, body, transport="tcp", chunk_bytes=16 * 1024)
    assert set(p.requests) == {256 * 1024}
    assert p.reused >= 4  # 2 ranks x 3 calls, served from at most 2 buffers
    assert p.leased == 0
    assert p.retained_bytes <= 2 * 256 * 1024


async def test_abandoned_operation_does_not_return_its_window(pool: CheckingPool) -> None:
    """A ring allreduce that times out (its peer never calls it) discards its window: a
    transport could still fill the receives posted there."""

    async def body(g: ac.Group) -> str:
        if g.rank == 1:
            await asyncio.sleep(0.6)
            g.abort()
            return "idle"
        buf = np.ones(2000, np.float32)
        with pytest.raises(ac.AiocollectError) as info:
            await g.allreduce(buf, algorithm="ring", timeout=0.3)
        g.abort()
        return type(info.value).__name__

    res = await run_ranks(2, body, chunk_bytes=CHUNK)
    assert res[1] == "idle"
    assert pool.discarded == 1
    assert pool.leased == 0
    assert pool.retained_bytes == 0


# -- the pool itself ----------------------------------------------------------------------


def test_pool_leases_are_disjoint_and_reused() -> None:
    p = ScratchPool(cap_bytes=4 << 20, min_bytes=4096)
    a = p.acquire(100_000, np.dtype(np.float32))
    b = p.acquire(100_000, np.dtype(np.float32))
    assert a.shape == (100_000,)
    assert a.dtype == np.float32
    assert not np.shares_memory(a, b)
    addr = a.__array_interface__["data"][0]
    p.release(a)
    assert p.retained_bytes == size_class(400_000)
    c = p.acquire(50_000, np.dtype(np.int64))  # same size class, other dtype
    assert c.__array_interface__["data"][0] == addr
    assert c.dtype == np.int64
    assert not np.shares_memory(c, b)
    assert p.retained_bytes == 0
    assert p.leased == 2
    p.release(b)
    p.release(c)
    assert p.leased == 0


def test_pool_cap_and_misuse() -> None:
    p = ScratchPool(cap_bytes=1 << 20, min_bytes=4096)
    arrs = [p.acquire(256 * 1024, np.dtype(np.uint8)) for _ in range(6)]
    for a in arrs:
        p.release(a)
        assert p.retained_bytes <= 1 << 20
    assert p.retained_bytes == 1 << 20
    with pytest.raises(ValueError, match="not an array leased from this pool"):
        p.release(arrs[0])  # already returned
    with pytest.raises(ValueError, match="not an array leased from this pool"):
        p.release(np.empty(10))  # never leased
    big = p.acquire(2 << 20, np.dtype(np.uint8))  # above the cap: served, never retained
    p.release(big)
    assert p.retained_bytes <= 1 << 20
    d = p.acquire(256 * 1024, np.dtype(np.uint8))
    p.discard(d)  # not retained
    assert p.retained_bytes <= (1 << 20) - 256 * 1024
    assert p.leased == 0
    small = p.acquire(10, np.dtype(np.float64))  # below min_bytes: a plain allocation
    p.release(small)
    assert p.leased == 0
    p.clear()
    assert p.retained_bytes == 0


def test_window_slots() -> None:
    assert ring.window_slots(1 << 20, 4) == 16
    assert ring.window_slots(1 << 20, 8) == 16
    assert ring.window_slots(64 << 20, 4) == ring.RS_MIN_SLOTS
    assert ring.window_slots(1, 8) == ring.RS_WINDOW_BYTES // 8  # chunks of one element
