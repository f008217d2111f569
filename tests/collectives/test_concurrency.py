"""Many operations in flight on one loop, across the world group and two sub-groups."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks, spawn_ranks

pytestmark = pytest.mark.timeout(180)


def _plan(g: ac.Group, salt: int, count: int = 64) -> list[tuple[Any, Callable[[], None]]]:
    """``count`` mixed operations started at once; each with a checker of its result."""
    n, r = g.world_size, g.rank
    rng = np.random.default_rng(salt)
    sizes = rng.choice([0, 1, 7, 100, 1000, 20_000], count)
    kinds = rng.integers(0, 7, count)
    started: list[tuple[Any, Callable[[], None]]] = []
    for i, (kind, size) in enumerate(zip(kinds, sizes, strict=True)):
        size = int(size)
        root = i % n
        if kind == 0:
            buf = np.full(size, r + i, np.int64)
            want = np.full(size, sum(x + i for x in range(n)), np.int64)
            h = g.allreduce(buf)
            started.append((h, lambda b=buf, w=want: np.testing.assert_array_equal(b, w)))  # type: ignore[misc]
        elif kind == 1:
            buf = np.full(size, r * 1000 + i, np.int32)
            h = g.broadcast(buf, root=root)
            started.append(
                (
                    h,
                    lambda b=buf, v=root * 1000 + i: np.testing.assert_array_equal(  # type: ignore[misc]
                        b, np.full(b.size, v, np.int32)
                    ),
                )
            )
        elif kind == 2:
            send = np.full(size, r - i, np.float64)
            h = g.allgather(send)
            started.append(
                (
                    h,
                    lambda h=h, i=i, s=size: np.testing.assert_array_equal(  # type: ignore[misc]
                        h.result(), np.stack([np.full(s, x - i, np.float64) for x in range(n)])
                    ),
                )
            )
        elif kind == 3:
            send = np.arange(n * (size + 1), dtype=np.float32) + r  # type: ignore[assignment]
            h = g.reduce_scatter(send, op=ac.MAX)
            want = (np.arange(n * (size + 1), dtype=np.float32) + (n - 1))[  # type: ignore[assignment]
                r * (size + 1) : (r + 1) * (size + 1)
            ]
            started.append((h, lambda h=h, w=want: np.testing.assert_array_equal(h.result(), w)))  # type: ignore[misc]
        elif kind == 4:
            h = g.barrier()  # type: ignore[assignment]
            started.append((h, lambda: None))
        elif kind == 5:
            buf = np.full(size, r + 1, np.int64)
            h = g.reduce(buf, root=root, op=ac.PROD)
            prod = int(np.prod(np.arange(1, n + 1)))
            want = np.full(size, prod if r == root else r + 1, np.int64)
            started.append((h, lambda b=buf, w=want: np.testing.assert_array_equal(b, w)))  # type: ignore[misc]
        else:
            peer_to, peer_from = (r + 1) % n, (r - 1) % n
            if n == 1:
                h = g.barrier()  # type: ignore[assignment]
                started.append((h, lambda: None))
                continue
            got = np.empty(size, np.int64)
            h1 = g.recv(got, peer_from, tag=i)
            h2 = g.send(np.full(size, r * 7 + i, np.int64), peer_to, tag=i)
            started.append((h2, lambda: None))
            started.append(
                (
                    h1,
                    lambda b=got, v=peer_from * 7 + i: np.testing.assert_array_equal(  # type: ignore[misc]
                        b, np.full(b.size, v, np.int64)
                    ),
                )
            )
    return started


async def _run_plan(started: list[tuple[Any, Callable[[], None]]]) -> int:
    await asyncio.gather(*(h for h, _ in started))
    for _, check in started:
        check()
    return len(started)


async def mixed_with_subgroups(g: ac.Group) -> int:
    even = await g.split(g.rank % 2, key=-g.rank)
    opt_out = await g.split(None if g.rank == 0 else 0)
    assert even is not None
    assert even.world_size == (g.world_size + 1 - g.rank % 2) // 2
    assert (opt_out is None) == (g.rank == 0)
    # 64 on the world group plus 16 on each sub-group, all in flight at once
    plans = [_plan(g, 1, 64), _plan(even, 2 + g.rank % 2, 16)]
    if opt_out is not None:
        plans.append(_plan(opt_out, 5, 16))
    done = await asyncio.gather(*(_run_plan(p) for p in plans))
    return sum(done)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
async def test_64_concurrent_mixed_operations(n: int) -> None:
    res = await run_ranks(n, mixed_with_subgroups, chunk_bytes=4096)
    assert all(x >= 64 + 16 for x in res)


@pytest.mark.parametrize("n", [3, 4])
async def test_concurrent_over_tcp_processes(n: int) -> None:
    res = await spawn_ranks(n, mixed_with_subgroups, timeout=150, chunk_bytes=4096)
    assert all(x >= 64 + 16 for x in res)


async def _objects(g: ac.Group) -> Any:
    value = {"rank": g.rank, "arr": np.arange(3) * g.rank, "nested": [1, "two", None]}
    got = await g.broadcast_object(value if g.rank == 1 else None, root=1)
    assert got["rank"] == 1
    assert got["arr"].tolist() == [0, 1, 2]
    everyone = await g.allgather_object(value)
    assert [v["rank"] for v in everyone] == list(range(g.world_size))
    gathered = await g.gather_object(g.rank * 10, root=0)
    assert gathered == ([x * 10 for x in range(g.world_size)] if g.rank == 0 else None)
    with pytest.raises(ac.UsageError, match="allow_pickle"):
        g.allgather_object({1, 2})
    sets = await g.allgather_object({g.rank}, allow_pickle=True)
    return sets


async def test_object_collectives() -> None:
    res = await run_ranks(3, _objects)
    assert res[0] == [{0}, {1}, {2}]


async def _sub_mismatch(g: ac.Group) -> str:
    sub = await g.split(0)
    assert sub is not None
    try:
        if g.rank == 0:
            await sub.allreduce(np.zeros(4))
        else:
            await sub.broadcast(np.zeros(4))
    except ac.MismatchError as exc:
        return str(exc)
    return "no error"


async def test_mismatch_in_subgroup() -> None:
    res = await run_ranks(2, _sub_mismatch, timeout=10)
    assert all("sub-group" in m for m in res), res


async def _custom_ufunc(g: ac.Group) -> None:
    n = g.world_size
    for alg in ("ring", "recursive_doubling", "halving_doubling", "star"):
        buf = np.linspace(-3, 3, 37) + g.rank
        await g.allreduce(buf, op=np.logaddexp, algorithm=alg)
        want = np.logaddexp.reduce([np.linspace(-3, 3, 37) + x for x in range(n)])
        np.testing.assert_allclose(buf, want, rtol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_custom_ufunc_reduction(n: int) -> None:
    await run_ranks(n, _custom_ufunc, chunk_bytes=64)
