"""Bruck's log-step allgather (collectives/bruck.py): allgatherv's ``bruck`` and the object
gathers from ``select.BRUCK_MIN_RANKS`` ranks on.

Exact results for every world size up to 9 and for 16 and 17 (ragged rows, empty ones,
values of every kind), over the memory transport, real TCP and the default transport;
the automatic choice; that it runs over the links a group opens when it forms; mismatched
calls, calls in flight together and a rank's malformed sizes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from unittest import mock

import numpy as np
import pytest

import aiocollect as ac
from aiocollect import errors
from aiocollect.collectives import bruck, select
from aiocollect.collectives.neighbours import neighbours
from aiocollect.testing import run_ranks

pytestmark = pytest.mark.timeout(60)

SIZES = [*range(1, 10), 16, 17]


def _rows(rank: int) -> np.ndarray[Any, Any]:
    """Rank ``rank``'s rows: 0, 1, 2 or 5 rows of 3 int32 (some ranks send none)."""
    count = (0, 1, 2, 5)[rank % 4]
    return np.arange(count * 3, dtype=np.int32).reshape(count, 3) + 1000 * rank


def _value(rank: int) -> Any:
    """Values of several kinds and sizes, one per rank."""
    return [rank, "x" * (rank % 5), {"r": (rank, None)}, b"\x00" * (rank % 3)]


async def _every_gather(g: ac.Group, algorithm: str | None) -> None:
    got = await g.allgatherv(_rows(g.rank), algorithm=algorithm)
    assert len(got) == g.world_size
    for r, rows in enumerate(got):
        want = _rows(r)
        assert rows.shape == want.shape, (g.rank, r, rows)
        assert (rows == want).all(), (g.rank, r, rows)
    objs = await g.allgather_object(_value(g.rank))
    assert objs == [_value(r) for r in range(g.world_size)]
    root = g.world_size - 1
    gathered = await g.gather_object(_value(g.rank), root=root)
    assert gathered == ([_value(r) for r in range(g.world_size)] if g.rank == root else None)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("algorithm", ["bruck", None])
async def test_exact_over_memory(n: int, algorithm: str | None) -> None:
    await run_ranks(n, _every_gather, algorithm, timeout=20)


@pytest.mark.parametrize("n", [5, 17])
async def test_exact_over_tcp(n: int) -> None:
    await run_ranks(n, _every_gather, "bruck", transport="tcp", timeout=20)


async def test_exact_over_the_default_transport() -> None:
    await run_ranks(6, _every_gather, None, transport="auto", timeout=20)


async def test_no_rows_anywhere() -> None:
    async def body(g: ac.Group) -> None:
        got = await g.allgatherv(np.zeros((0, 2), np.float32), algorithm="bruck")
        assert [b.shape for b in got] == [(0, 2)] * g.world_size

    await run_ranks(5, body, transport="tcp", timeout=20)


@pytest.mark.parametrize("n", [4, 9])
async def test_rows_above_the_limit_go_by_ring_and_stay_exact(n: int) -> None:
    """A whole result over ``BRUCK_MAX_BYTES``: sizes by Bruck, rows by ring."""
    row = select.BRUCK_MAX_BYTES // 8 // n + 1  # float64: n such rows pass the limit

    async def body(g: ac.Group) -> None:
        got = await g.allgatherv(np.full((1, row), g.rank, np.float64), algorithm="bruck")
        assert [int(b[0, 0]) for b in got] == list(range(n))
        assert all((b == r).all() for r, b in enumerate(got))

    await run_ranks(n, body, chunk_bytes=4096, timeout=20)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 64])
async def test_the_automatic_choice(n: int) -> None:
    async def body(g: ac.Group) -> str:
        return g.chosen_algorithm("allgatherv", 0)

    chosen = await run_ranks(n, body, timeout=20)
    assert set(chosen) == {"bruck" if n >= select.BRUCK_MIN_RANKS else "ring"}


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 17])
@pytest.mark.parametrize("shape", [(3,), (2, 5)])
async def test_fixed_allgather_exact(n: int, shape: tuple[int, ...]) -> None:
    """The fixed-size allgather by Bruck's rounds: every rank's block, in rank order."""

    async def body(g: ac.Group) -> None:
        mine = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + 100 * g.rank
        out = np.empty((g.world_size, *shape), np.float64)
        await g.allgather(mine, out=out, algorithm="bruck")
        for r in range(g.world_size):
            assert (out[r] == np.arange(out[r].size).reshape(shape) + 100 * r).all()

    await run_ranks(n, body, timeout=20)


@pytest.mark.parametrize(
    ("n", "total", "want"),
    [
        (select.DIRECT_MAX_RANKS, 4 * select.DIRECT_MAX_RANKS, "direct"),
        (select.DIRECT_MAX_RANKS + 1, 4 * (select.DIRECT_MAX_RANKS + 1), "bruck"),
        (1024, 4 * 1024, "bruck"),
        (1024, (select.DIRECT_BLOCK_MAX + 1) * 1024, "ring"),
    ],
)
def test_fixed_allgather_choice(n: int, total: int, want: str) -> None:
    """Past ``DIRECT_MAX_RANKS`` ranks small blocks go by Bruck's rounds, not direct's
    link to every rank; large blocks by ring."""
    assert select.allgather(total, n) == want


async def test_no_links_beyond_the_neighbours() -> None:
    """Over TCP with links on demand, the gathers and a split use only the links the
    group opened when it formed (a split into even and odd ranks of a power of two:
    the sub-groups' neighbours are the parent's)."""
    n = 32

    async def body(g: ac.Group) -> tuple[set[int], set[int]]:
        at_open = set(g._fabric.links)
        await _every_gather(g, None)
        out = np.empty((n, 2), np.int32)
        await g.allgather(np.full(2, g.rank, np.int32), out=out)  # (bruck, not direct)
        assert (out == np.arange(n, dtype=np.int32)[:, None]).all()
        sub = await g.split(g.rank % 2, key=-g.rank)
        assert sub is not None
        x = np.full(1, g.rank, np.int64)
        await sub.allreduce(x)
        assert x[0] == sum(range(g.rank % 2, n, 2))
        return at_open, set(g._fabric.links)

    for rank, (at_open, at_end) in enumerate(await run_ranks(n, body, transport="tcp", timeout=30)):
        assert at_open == neighbours(n, rank) == at_end


async def test_several_in_flight() -> None:
    async def body(g: ac.Group) -> None:
        handles = [g.allgatherv(_rows(g.rank + i), algorithm="bruck") for i in range(3)]
        objs = g.allgather_object(_value(g.rank))
        for i, h in enumerate(handles):
            got = await h
            assert all((b == _rows(r + i)).all() for r, b in enumerate(got))
        assert await objs == [_value(r) for r in range(g.world_size)]

    await run_ranks(7, body, transport="tcp", timeout=20)


async def _outcome(call: Any) -> Any:
    """What ``call()`` gives, or the error it (or its handle) raises."""
    try:
        return await call()
    except ac.AiocollectError as exc:
        return exc


async def test_mismatched_algorithms() -> None:
    async def body(g: ac.Group) -> Any:
        algorithm = "ring" if g.rank == 3 else "bruck"
        return await _outcome(lambda: g.allgatherv(_rows(g.rank), algorithm=algorithm))

    res = await run_ranks(5, body, timeout=10)
    assert any(isinstance(e, errors.MismatchError) for e in res), res
    assert all(isinstance(e, errors.MismatchError | ac.GroupBrokenError) for e in res), res


async def test_mismatched_rows() -> None:
    async def body(g: ac.Group) -> Any:
        width = 4 if g.rank == 2 else 3
        return await _outcome(
            lambda: g.allgatherv(np.zeros((1, width), np.int32), algorithm="bruck")
        )

    res = await run_ranks(6, body, timeout=10)
    for e in res:
        assert isinstance(e, errors.MismatchError), e
        assert "rows of 4" in str(e), e


async def test_malformed_sizes_are_a_protocol_error() -> None:
    """Rank 2 declares -5 rows: every rank that reads it raises ProtocolError naming
    it (and the rank it came through), before anything is allocated; the group breaks."""
    real = bruck.allgather_flat

    async def lying(o: Any, whole: Any, bounds: Any, slot0: int) -> None:
        if o.rank == 2 and slot0 == bruck.SIZES_SLOT:
            whole[bounds[2]] = -5  # (rank 2's rows)
        await real(o, whole, bounds, slot0)

    async def body(g: ac.Group) -> list[Any]:
        first = await _outcome(lambda: g.allgatherv(_rows(g.rank), algorithm="bruck"))
        started = time.monotonic()
        later = await _outcome(g.barrier)
        return [first, later, time.monotonic() - started]

    with mock.patch.object(bruck, "allgather_flat", lying):
        res = await run_ranks(9, body, transport="tcp", timeout=10)
    for rank, (first, later, took) in enumerate(res):
        if rank == 2:
            continue
        assert isinstance(first, errors.ProtocolError | ac.GroupBrokenError), first
        if isinstance(first, errors.ProtocolError):
            assert "rank 2 declared -5 rows" in str(first), first
            via = bruck.source(9, rank, 2)
            assert (f"received from rank {via}" in str(first)) == (via != 2), first
        assert isinstance(later, ac.GroupBrokenError), later
        assert took < 5, took
    assert any(isinstance(first, errors.ProtocolError) for first, _, _ in res)


def test_source_is_the_round_that_carries_the_block() -> None:
    """:func:`bruck.source` against a simulation of the rounds."""
    for n in SIZES:
        for me in range(n):
            came: dict[int, int] = {me: me}
            dist = 1
            while dist < n:
                for i in range(min(dist, n - dist)):
                    came[(me + dist + i) % n] = (me + dist) % n
                dist <<= 1
            assert came == {s: bruck.source(n, me, s) for s in range(n)}
            assert set(came.values()) - {me} <= neighbours(n, me)


async def test_in_flight_on_one_loop_with_asyncio_gather() -> None:
    """Two groups' worth of object gathers at once on one loop (as split runs them)."""

    async def body(g: ac.Group) -> None:
        a, b = await asyncio.gather(g.allgather_object(g.rank), g.allgather_object(-g.rank))
        assert a == list(range(g.world_size))
        assert b == [-r for r in range(g.world_size)]

    await run_ranks(17, body, timeout=20)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 17])
async def test_split_exact(n: int) -> None:
    """Colors (some ranks opting out), keys with ties and extremes: each sub-group holds
    its color's ranks ordered by key then rank, and runs a collective."""

    def color(r: int) -> int | None:
        return None if r % 5 == 4 else (0, 1 << 62, (1 << 63) - 1)[r % 3]

    def key(r: int) -> int:
        return (-(1 << 63), 7, (1 << 63) - 1, 7)[r % 4]

    async def body(g: ac.Group) -> list[int] | None:
        sub = await g.split(color(g.rank), key=key(g.rank))
        if sub is None:
            return None
        x = np.full(1, g.rank, np.int64)
        await sub.allreduce(x)
        members = await sub.allgather_object(g.rank)
        assert x[0] == sum(members)
        assert members[sub.rank] == g.rank
        return list(members)

    for rank, members in enumerate(await run_ranks(n, body, timeout=20)):
        c = color(rank)
        if c is None:
            assert members is None
        else:
            want = sorted((key(r), r) for r in range(n) if color(r) == c)
            assert members == [r for _, r in want]


@pytest.mark.parametrize(
    ("color", "key"), [(-1, 0), (1 << 63, 0), (0, 1 << 63), (0, -(1 << 63) - 1), (0, 1.0)]
)
async def test_split_usage(color: Any, key: Any) -> None:
    async def body(g: ac.Group) -> None:
        with pytest.raises(ac.UsageError):
            g.split(color, key=key)

    await run_ranks(2, body, timeout=10)


async def test_split_against_allgather_object_is_a_mismatch() -> None:
    async def body(g: ac.Group) -> Any:
        if g.rank == 1:
            return await _outcome(lambda: g.allgather_object([0, 0]))
        return await _outcome(lambda: g.split(0))

    res = await run_ranks(4, body, timeout=10)
    assert any(isinstance(e, errors.MismatchError) for e in res), res
    assert all(isinstance(e, errors.MismatchError | ac.GroupBrokenError) for e in res), res
