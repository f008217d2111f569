"""The collective sweeps of tests/collectives and tests/multiprocess, over shared memory:
the same bodies, in one process (every link a pair of rings in /dev/shm) and in real
processes (transport="shm" forced, and "auto" on one host)."""

from __future__ import annotations

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks, spawn_ranks
from tests.collectives.algorithms import sweep_algorithms
from tests.collectives.test_sweep import _allreduce_all, _movement, _p2p, _reduce_all
from tests.helpers import CHUNK, CORE_DTYPES
from tests.multiprocess import targets as mp_targets
from tests.shm import targets

SIZES = [1, 2, 3, 4, 7]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", SIZES)
async def test_allreduce(n: int) -> None:
    counts = await run_ranks(n, _allreduce_all, CORE_DTYPES, transport="shm",
                             chunk_bytes=CHUNK)
    assert counts[0] > 50


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", SIZES)
async def test_reduce(n: int) -> None:
    await run_ranks(n, _reduce_all, CORE_DTYPES[1::2], transport="shm", chunk_bytes=CHUNK)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", SIZES)
async def test_data_movement(n: int) -> None:
    await run_ranks(n, _movement, CORE_DTYPES, transport="shm", chunk_bytes=CHUNK)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 4, 7])
async def test_send_recv(n: int) -> None:
    res = await run_ranks(n, _p2p, transport="shm", chunk_bytes=CHUNK)
    assert res[0] == list(range(1, n))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [3, 5])
async def test_algorithms(n: int) -> None:
    dtypes = [np.dtype(np.int32), np.dtype(np.float32)]
    res = await run_ranks(n, sweep_algorithms, dtypes, transport="shm", chunk_bytes=CHUNK)
    assert res[0] > 20


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n, transport", [(2, "shm"), (5, "auto")])
async def test_algorithms_in_processes(n: int, transport: str) -> None:
    dtypes = [np.dtype(np.bool_), np.dtype(np.int64), np.dtype(np.float64)]
    res = await spawn_ranks(n, sweep_algorithms, dtypes, timeout=250, chunk_bytes=CHUNK,
                            transport=transport)
    assert len(set(res)) == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3, 4])
async def test_sweep_in_processes(n: int) -> None:
    counts = await spawn_ranks(n, mp_targets.sweep, timeout=200, chunk_bytes=CHUNK,
                               transport="shm")
    assert len(counts) == n and counts[0] > 50 and len(set(counts)) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("uvloop", [False, True])
async def test_concurrent_allreduces(uvloop: bool) -> None:
    n = 3
    res = await spawn_ranks(n, mp_targets.concurrent, 50_000, timeout=100, uvloop=uvloop,
                            transport="shm")
    want = [float(sum(r + i for r in range(n))) for i in range(6)]
    assert res == [want] * n


@pytest.mark.timeout(120)
@pytest.mark.parametrize("uvloop", [False, True])
async def test_frames_larger_than_the_ring(uvloop: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 1 MiB through 64 KiB rings: every frame is written in pieces as the reader
    frees space, in both directions at once, several operations in flight."""
    monkeypatch.setenv("AIOCOLLECT_SHM_RING_BYTES", str(64 << 10))  # the children inherit it
    res = await spawn_ranks(3, targets.big_frames, 3 << 20, timeout=100, uvloop=uvloop,
                            transport="shm", chunk_bytes=1 << 20)
    assert res == [True] * 3


@pytest.mark.timeout(60)
async def test_links_are_shared_memory() -> None:
    kinds = await run_ranks(3, targets.link_kinds, transport="shm")
    assert kinds == [["shm", "shm"]] * 3
    kinds = await spawn_ranks(3, targets.link_kinds, timeout=50)  # auto, one host
    assert kinds == [["shm", "shm"]] * 3


@pytest.mark.timeout(60)
async def test_tcp_stays_tcp() -> None:
    assert await spawn_ranks(2, targets.link_kinds, timeout=50, transport="tcp") == \
        [["tcp"], ["tcp"]]


@pytest.mark.timeout(60)
async def test_objects_and_split() -> None:
    res = await run_ranks(4, targets.objects_and_split, transport="shm")
    # allgather_object of the ranks; allreduce of the ranks within each color (r % 2)
    assert res == [([0, 1, 2, 3], 0 + 2), ([0, 1, 2, 3], 1 + 3),
                   ([0, 1, 2, 3], 0 + 2), ([0, 1, 2, 3], 1 + 3)]


def test_bad_transport_is_usage_error() -> None:
    with pytest.raises(ac.UsageError):
        ac.open_group(0, 1, store="memory://x", transport="bogus").__await__().send(None)
