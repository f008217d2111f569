"""The collective sweep in real processes over TCP (one process per rank)."""

from __future__ import annotations

import os

import pytest

from aiocollect.testing import spawn_ranks
from tests.helpers import CHUNK
from tests.multiprocess import targets


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3, 4])
async def test_sweep_in_processes(n: int) -> None:
    counts = await spawn_ranks(n, targets.sweep, timeout=200, chunk_bytes=CHUNK)
    assert len(counts) == n
    assert counts[0] > 50
    assert len(set(counts)) == 1


@pytest.mark.timeout(120)
async def test_concurrent_allreduces_uvloop() -> None:
    n = 3
    res = await spawn_ranks(n, targets.concurrent, 50_000, timeout=100, uvloop=True)
    want = [float(sum(r + i for r in range(n))) for i in range(6)]
    assert res == [want] * n


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_start_methods(start_method: str) -> None:
    """Spawned ranks are this process's children; forkserver ranks are forked by the
    server that imported aiocollect first (as aiocollect run forks its ranks); both run
    a real group."""
    res = await spawn_ranks(3, targets.parent_and_sum, timeout=100, start_method=start_method)
    parents = {parent for parent, _ in res}
    assert [total for _, total in res] == [[6, 6, 6]] * 3
    assert len(parents) == 1
    assert (parents == {os.getpid()}) == (start_method == "spawn")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("n", "uvloop"), [(2, False), (4, True)])
async def test_overflow_is_inf_on_every_rank_whatever_numpy_raises(n: int, uvloop: bool) -> None:
    """Ranks whose numpy raises on overflow (np.seterr, warnings as errors) get IEEE sums,
    inf where they overflow, on the default transport: never an error on some ranks and a
    result on others (tests/collectives/test_float_signals.py has every path)."""
    res = await spawn_ranks(n, targets.overflow_under_strict_numpy, timeout=100, uvloop=uvloop)
    inf = float("inf")
    assert res == [[[inf, inf], [inf, inf], [inf, float(n)], [inf, 1.0]]] * n


def test_unknown_start_method_is_refused() -> None:
    with pytest.raises(ValueError, match="start_method"):
        spawn_ranks(2, targets.echo_rank, start_method="fork")


@pytest.mark.timeout(60)
async def test_child_traceback_comes_back() -> None:
    job = spawn_ranks(2, targets.echo_rank, timeout=50)
    assert await job == [(0, 2), (1, 2)]


@pytest.mark.timeout(240)
def test_sweep_in_processes_on_uvloop() -> None:
    """The same sweep with every rank on uvloop (its transports take other code paths:
    zero-copy reads into the posted buffer, write buffering by reference)."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> list[int]:
        return await spawn_ranks(3, targets.sweep, timeout=200, chunk_bytes=CHUNK, uvloop=True)

    counts = uvloop.run(main())
    assert len(set(counts)) == 1
    assert counts[0] > 50


@pytest.mark.timeout(240)
def test_in_process_tcp_sweep_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")
    from aiocollect.testing import run_ranks

    async def main() -> list[int]:
        return await run_ranks(4, targets.sweep, transport="tcp", chunk_bytes=CHUNK)

    counts = uvloop.run(main())
    assert len(set(counts)) == 1
    assert counts[0] > 50
