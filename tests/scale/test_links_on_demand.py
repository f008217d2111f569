"""Links on demand (``open_group(links=...)``), in one process over real TCP sockets: a
group links its algorithms' neighbours when it forms, opens the other links at first use
(both ranks of a pair may ask at once), and a rank's loss reaches ranks with no link to
it."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.collectives.neighbours import neighbours
from aiocollect.testing import run_ranks

pytestmark = pytest.mark.timeout(60)

N = 12


def _linked(g: ac.Group) -> set[int]:
    return set(g._fabric.links)


async def test_neighbours_only_until_first_use() -> None:
    async def body(g: ac.Group) -> tuple[set[int], set[int], set[int]]:
        at_open = _linked(g)
        small = np.full(1, g.rank + 1, dtype=np.int32)
        await g.allreduce(small)
        assert small[0] == N * (N + 1) // 2
        big = np.ones(1 << 18, dtype=np.float32)  # 1 MiB: the ring
        await g.allreduce(big)
        assert (big == N).all()
        b = np.arange(5.0) if g.rank == 7 else np.zeros(5)
        await g.broadcast(b, root=7)
        assert (b == np.arange(5.0)).all()
        await g.barrier()
        await g.reduce(small, root=5)
        after_neighbours = _linked(g)
        out = await g.alltoall(np.arange(N * 2, dtype=np.int64) + 100 * g.rank)
        assert (out.reshape(N, 2)[:, 0] == [100 * r + 2 * g.rank for r in range(N)]).all()
        return at_open, after_neighbours, _linked(g)

    results = await run_ranks(N, body, transport="tcp", timeout=30)
    for rank, (at_open, after, at_end) in enumerate(results):
        assert at_open == neighbours(N, rank) == after
        assert at_end == set(range(N)) - {rank}


def _far_pairs() -> dict[int, int]:
    """Ranks paired with a rank that is not their neighbour (a greedy matching)."""
    pair: dict[int, int] = {}
    for r in range(N):
        for p in range(r + 1, N):
            if r not in pair and p not in pair and p not in neighbours(N, r):
                pair[r], pair[p] = p, r
    return pair


async def test_point_to_point_opens_one_link() -> None:
    """send to a rank that is no neighbour opens that link only; recv(src=None) takes a
    message over a link the sender opened."""
    pairs = _far_pairs()
    assert len(pairs) >= N // 2

    async def body(g: ac.Group) -> set[int]:
        far = pairs.get(g.rank)
        if far is None:
            return _linked(g)
        got = np.zeros(1)
        h = g.recv(got, None, tag=3)
        await g.send(np.array([float(g.rank)]), far, tag=3)
        src = await h
        assert src == far
        assert got[0] == far
        big = np.zeros(1 << 17)
        h2 = g.recv(big, far, tag=4)  # both ranks of the pair ask for the link at once
        await g.send(np.full(1 << 17, float(g.rank)), far, tag=4)
        await h2
        assert (big == far).all()
        return _linked(g)

    results = await run_ranks(N, body, transport="tcp", timeout=30)
    for rank, linked in enumerate(results):
        extra = {pairs[rank]} if rank in pairs else set()
        assert linked == neighbours(N, rank) | extra


async def test_split_links_its_own_neighbours() -> None:
    async def body(g: ac.Group) -> None:
        sub = await g.split(g.rank % 3, key=-g.rank)
        assert sub is not None
        x = np.full(3, g.rank, dtype=np.int64)
        await sub.allreduce(x)
        assert x[0] == sum(r for r in range(N) if r % 3 == g.rank % 3)
        objs = await sub.allgather_object(g.rank)
        assert sorted(objs, reverse=True) == objs

    await run_ranks(N, body, transport="tcp", timeout=30)


async def test_eager_links_every_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(g: ac.Group) -> set[int]:
        return _linked(g)

    for linked in await run_ranks(N, body, transport="tcp", timeout=30, links="eager"):
        assert len(linked) == N - 1
    monkeypatch.setenv("AIOCOLLECT_LINKS", "eager")
    for linked in await run_ranks(N, body, transport="tcp", timeout=30):
        assert len(linked) == N - 1
    monkeypatch.setenv("AIOCOLLECT_LINKS", "sometimes")
    with pytest.raises(ac.UsageError, match="AIOCOLLECT_LINKS"):
        await ac.open_group(0, 2, store="memory://links-bad")
    with pytest.raises(ac.UsageError, match="links"):
        await ac.open_group(0, 2, store="memory://links-bad", links="full")


async def test_a_lost_rank_reaches_ranks_without_a_link_to_it() -> None:
    """Rank 0's connections drop without ABORT or GOODBYE (as when its process dies):
    every other rank, rank 6 included (no link to rank 0), fails within seconds, not at
    the 30 s deadline."""
    assert 6 not in neighbours(N, 0)
    lost: list[float] = []

    class Lost(Exception):
        pass

    async def body(g: ac.Group) -> float:
        await g.barrier()
        if g.rank == 0:
            await asyncio.sleep(0.2)  # the others are waiting in the allreduce
            lost.append(time.monotonic())
            for link in list(g._fabric.links.values()):
                link.abort()
            raise Lost
        with pytest.raises((ac.PeerError, ac.GroupBrokenError)):
            await g.allreduce(np.ones(4))
        return time.monotonic()

    start = time.monotonic()
    with pytest.raises(ExceptionGroup) as info:
        await run_ranks(N, body, transport="tcp", timeout=30)
    assert len(info.value.exceptions) == 1, info.value.exceptions  # rank 0's only
    assert isinstance(info.value.exceptions[0].__cause__, Lost)
    assert time.monotonic() - start < 15  # not the 30 s deadline


async def test_ranks_must_link_the_same_way() -> None:
    async def rank(r: int) -> None:
        await ac.open_group(
            r,
            3,
            store="memory://links-mixed",
            transport="tcp",
            timeout=20,
            links="eager" if r == 1 else "lazy",
        )

    start = time.monotonic()
    results = await asyncio.gather(*(rank(r) for r in range(3)), return_exceptions=True)
    assert time.monotonic() - start < 15
    for res in results:
        assert isinstance(res, ac.RendezvousError), results
    assert "links='eager'" in str(results[1]) or "links='lazy'" in str(results[1])


async def test_an_operation_that_linked_every_pair_runs_in_one_frame_after() -> None:
    """The star (not a neighbour algorithm) needs rank 0 linked to every rank: rank 0
    links them on the first call, and its plan is then made again over the links, so
    later calls take the one-frame path (the other ranks need only their link to rank 0,
    which they have)."""

    async def body(g: ac.Group) -> bool:
        for _ in range(3):
            x = np.full(1, g.rank + 1, dtype=np.int64)
            await g.allreduce(x, algorithm="star")
            assert x[0] == N * (N + 1) // 2
        if g.rank == 0:
            assert len(_linked(g)) == N - 1
        plans = [p for k, p in g._plans.items() if k[0] == "allreduce"]
        return len(plans) == 1 and plans[0].small is not None

    assert all(await run_ranks(N, body, transport="tcp", timeout=30))


async def test_two_level_operations_link_only_their_peers() -> None:
    """16 ranks as 4 hosts x 4 (cyclic placement, as a rendezvous across hosts learns
    it): every two-level collective is exact, and links only the group's neighbours and
    the two-level peers (the host's ranks, the leaders, the rings of its share)."""
    from aiocollect.collectives import hierarchical

    n, hosts = 16, [r % 4 for r in range(16)]

    async def body(g: ac.Group) -> set[int]:
        g._fabric.hosts = list(hosts)
        small = np.full(3, g.rank + 1, dtype=np.int64)
        await g.allreduce(small)
        assert (small == n * (n + 1) // 2).all()
        big = np.full(300_001, g.rank + 1, dtype=np.int64)  # several leaders
        await g.allreduce(big)
        assert (big == n * (n + 1) // 2).all()
        b = np.arange(6.0) if g.rank == 5 else np.zeros(6)
        await g.broadcast(b, root=5)
        assert (b == np.arange(6.0)).all()
        r = np.full(4, g.rank, dtype=np.int64)
        await g.reduce(r, root=6)
        if g.rank == 6:
            assert (r == sum(range(n))).all()
        rows = await g.allgather(np.full(2, g.rank, dtype=np.int32))
        assert [int(x[0]) for x in rows] == list(range(n))
        out = np.empty(2, dtype=np.int64)
        await g.reduce_scatter(np.ones(2 * n, dtype=np.int64), out)
        assert (out == n).all()
        await g.barrier()
        return set(g._fabric.links)

    results = await run_ranks(n, body, transport="tcp", timeout=45)
    for rank, linked in enumerate(results):
        topo = hierarchical._topology(tuple(hosts), rank)
        peers = topo.two_level_peers() | topo.two_level_peers(5) | topo.two_level_peers(6)
        assert linked <= neighbours(n, rank) | peers, rank
    assert any(len(linked) < n - 1 for linked in results)
