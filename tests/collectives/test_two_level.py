"""The two-level allreduce (collectives/hierarchical.py) in one process: the group's
host indices set as a rendezvous across hosts would set them, over the memory transport,
in every placement, every size class (one leader, every leader; several chunks with a tiny
chunk size) and with AVG; the same bits on every rank. tests/hosts runs it across real
namespace hosts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.collectives import hierarchical
from aiocollect.testing import run_ranks

pytestmark = pytest.mark.timeout(60)

PLACEMENTS = {
    "blocked": [0, 0, 1, 1, 2, 2, 3, 3],
    "cyclic": [0, 1, 2, 3, 0, 1, 2, 3],
    "uneven": [0, 1, 0, 2, 1, 0, 1],
    "one-host": [0, 0, 0],
}
COUNTS = [0, 1, 7, 300, hierarchical.LEADERS_MAX // 8 + 1, 70_001]


async def _run(group: ac.Group, hosts: list[int], op: Any) -> list[np.ndarray[Any, Any]]:
    group._fabric.hosts = list(hosts)  # what a rendezvous across these hosts learns
    out = []
    for count in COUNTS:
        for dtype in (np.int64, np.float64):
            a = ((np.arange(count) % 101) * (group.rank + 1)).astype(dtype)
            if op is ac.AVG and dtype is np.int64:
                continue
            await group.allreduce(a, op=op, algorithm="two_level")
            out.append(a)
    return out


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("op", [ac.SUM, ac.AVG])
async def test_two_level_allreduce(placement: str, op: Any) -> None:
    hosts = PLACEMENTS[placement]
    n = len(hosts)
    results = await run_ranks(n, _run, hosts, op, chunk_bytes=4096)
    i = 0
    for count in COUNTS:
        total = sum((np.arange(count) % 101) * (r + 1) for r in range(n))
        for dtype in (np.int64, np.float64):
            if op is ac.AVG and dtype is np.int64:
                continue
            want = total / n if op is ac.AVG else total
            for r in range(n):
                assert results[r][i].tobytes() == results[0][i].tobytes(), (count, r)
            np.testing.assert_allclose(results[0][i], want, rtol=1e-12)
            i += 1


async def test_automatic_choice_follows_the_topology() -> None:
    async def chosen(group: ac.Group, hosts: list[int]) -> list[str]:
        group._fabric.hosts = list(hosts)
        sub = await group.split(0 if group.rank < 2 else 1)
        assert sub is not None
        return [group.chosen_algorithm("allreduce", 4), sub.chosen_algorithm("allreduce", 4)]

    # the world spans two hosts of two ranks; each half of the split lies on one host
    assert await run_ranks(4, chosen, [0, 0, 1, 1]) == [["two_level", "recursive_doubling"]] * 4
    # a split across the hosts (ranks 0, 2 and 1, 3: one rank per host) stays flat too
    assert await run_ranks(4, chosen, [0, 1, 0, 1]) == [["two_level", "recursive_doubling"]] * 4


async def _broadcast_barrier(group: ac.Group, hosts: list[int]) -> list[np.ndarray[Any, Any]]:
    group._fabric.hosts = list(hosts)
    out = []
    for count in (0, 1, 300, 70_001):
        for root in range(group.world_size):
            a = np.full(count, group.rank * 10 + 1, np.int32)
            await group.broadcast(a, root=root, algorithm="two_level")
            await group.barrier(algorithm="two_level")
            out.append(a)
    return out


@pytest.mark.parametrize("placement", ["blocked", "cyclic", "uneven"])
async def test_two_level_broadcast_and_barrier(placement: str) -> None:
    hosts = PLACEMENTS[placement]
    results = await run_ranks(len(hosts), _broadcast_barrier, hosts, chunk_bytes=4096)
    for r, got in enumerate(results):
        i = 0
        for count in (0, 1, 300, 70_001):
            for root in range(len(hosts)):
                np.testing.assert_array_equal(got[i], np.full(count, root * 10 + 1), str(r))
                i += 1


async def _reduce(group: ac.Group, hosts: list[int], op: Any) -> list[np.ndarray[Any, Any]]:
    group._fabric.hosts = list(hosts)
    out = []
    for count in (1, 300, 70_001):
        for root in range(group.world_size):
            a = ((np.arange(count) % 101) * (group.rank + 1)).astype(np.float64)
            await group.reduce(a, root=root, op=op, algorithm="two_level")
            out.append(a)
    return out


@pytest.mark.parametrize("placement", ["blocked", "cyclic", "uneven"])
@pytest.mark.parametrize("op", [ac.SUM, ac.AVG])
async def test_two_level_reduce(placement: str, op: Any) -> None:
    hosts = PLACEMENTS[placement]
    n = len(hosts)
    results = await run_ranks(n, _reduce, hosts, op, chunk_bytes=4096)
    for r, got in enumerate(results):
        i = 0
        for count in (1, 300, 70_001):
            mine = (np.arange(count) % 101) * (r + 1)
            total = sum((np.arange(count) % 101) * (k + 1) for k in range(n))
            for root in range(n):
                want = (total / n if op is ac.AVG else total) if r == root else mine
                np.testing.assert_allclose(got[i], want, rtol=1e-12, err_msg=f"{r} {root}")
                i += 1


async def _allgather(group: ac.Group, hosts: list[int]) -> list[np.ndarray[Any, Any]]:
    group._fabric.hosts = list(hosts)
    out = []
    for count in (0, 1, 300, 9_001):
        send = np.arange(count, dtype=np.int32) + 1000 * group.rank
        out.append(await group.allgather(send, algorithm="two_level"))
    return out


@pytest.mark.parametrize("placement", ["blocked", "cyclic", "uneven"])
async def test_two_level_allgather(placement: str) -> None:
    hosts = PLACEMENTS[placement]
    n = len(hosts)
    results = await run_ranks(n, _allgather, hosts, chunk_bytes=4096)
    for r, got in enumerate(results):
        for i, count in enumerate((0, 1, 300, 9_001)):
            want = np.stack([np.arange(count, dtype=np.int32) + 1000 * k for k in range(n)])
            np.testing.assert_array_equal(got[i], want, str(r))


async def _reduce_scatter(group: ac.Group, hosts: list[int], op: Any) -> list[Any]:
    group._fabric.hosts = list(hosts)
    out = []
    n = group.world_size
    for per in (0, 1, 300, 9_001):
        send = ((np.arange(per * n) % 101) * (group.rank + 1)).astype(np.float64)
        out.append(await group.reduce_scatter(send, op=op, algorithm="two_level"))
    return out


@pytest.mark.parametrize("placement", ["blocked", "cyclic", "uneven"])
@pytest.mark.parametrize("op", [ac.SUM, ac.AVG])
async def test_two_level_reduce_scatter(placement: str, op: Any) -> None:
    hosts = PLACEMENTS[placement]
    n = len(hosts)
    results = await run_ranks(n, _reduce_scatter, hosts, op, chunk_bytes=4096)
    for r, got in enumerate(results):
        for i, per in enumerate((0, 1, 300, 9_001)):
            total = (np.arange(per * n) % 101) * (n * (n + 1) // 2)
            block = total[r * per : (r + 1) * per]
            want = block / n if op is ac.AVG else block
            np.testing.assert_allclose(got[i], want, rtol=1e-12, err_msg=str(r))


async def _allgatherv(group: ac.Group, hosts: list[int]) -> list[list[np.ndarray[Any, Any]]]:
    group._fabric.hosts = list(hosts)
    out = []
    for scale in (0, 1, 500):
        rows = scale * ((group.rank * 3) % 4)  # some ranks send no rows
        send = np.arange(rows * 2, dtype=np.int32).reshape(rows, 2) + 1000 * group.rank
        out.append(await group.allgatherv(send, algorithm="two_level"))
    return out


@pytest.mark.parametrize("placement", ["blocked", "cyclic", "uneven"])
async def test_two_level_allgatherv(placement: str) -> None:
    hosts = PLACEMENTS[placement]
    n = len(hosts)
    results = await run_ranks(n, _allgatherv, hosts, chunk_bytes=4096)
    for r, got in enumerate(results):
        for i, scale in enumerate((0, 1, 500)):
            assert len(got[i]) == n
            for k in range(n):
                rows = scale * ((k * 3) % 4)
                want = np.arange(rows * 2, dtype=np.int32).reshape(rows, 2) + 1000 * k
                np.testing.assert_array_equal(got[i][k], want, f"{r} from {k}")


async def test_ranks_disagreeing_on_two_levels_get_a_mismatch() -> None:
    async def body(group: ac.Group) -> str:
        group._fabric.hosts = [0, 0, 1, 1]
        alg = "two_level" if group.rank == 0 else "ring"
        try:
            await group.allreduce(np.ones(8), algorithm=alg)
        except ac.MismatchError as exc:
            return str(exc)
        return "no error"

    for message in await run_ranks(4, body, timeout=10):
        assert "allreduce[two_level]" in message or "allreduce[ring]" in message, message
