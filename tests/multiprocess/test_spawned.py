"""The collective sweep in real processes (one process per rank), and how ranks are
started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aiocollect.testing import spawn_ranks
from tests.support.collectives import CHUNK
from tests.support.targets import processes as targets
from tests.support.transports import Axis


#: The process sweeps run over the default transport and shared memory forced; every mode
#: runs in processes in tests/stress (and every mode's collectives in one process in
#: tests/collectives/test_sweep.py).
@pytest.mark.timeout(240)
@pytest.mark.transports(
    argnames="n", values={"auto": [2, 3, 4], "shm": [2, 3, 4]}, default=[], where="processes"
)
async def test_sweep_in_processes(axis: Axis, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if axis.name == "shm" and n == 2:  # spinning readers (opt-in, and only while ranks <= cores)
        monkeypatch.setenv("AIOCOLLECT_SHM_SPIN_US", "300")
    counts = await axis.spawn(n, targets.sweep, timeout=200, chunk_bytes=CHUNK)
    assert len(counts) == n
    assert counts[0] > 50
    assert len(set(counts)) == 1


@pytest.mark.timeout(120)
@pytest.mark.transports(
    argnames="n, spin_us, uvloop",
    values={
        "auto": [(3, None, True)],
        "shm": [(3, "0", False), (3, "0", True), (2, "500", False), (2, "500", True)],
    },
    default=[],
    where="processes",
)
async def test_concurrent_allreduces(
    axis: Axis, n: int, spin_us: str | None, uvloop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several allreduces in flight; over shared memory, readers sleeping at once or (2
    ranks, so no more than the cores of any CI machine) spinning first."""
    if spin_us is not None:
        monkeypatch.setenv("AIOCOLLECT_SHM_SPIN_US", spin_us)  # the children inherit it
    res = await axis.spawn(n, targets.concurrent, 50_000, timeout=100, uvloop=uvloop)
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
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_ranks_start_with_the_callers_environment_and_directory(
    start_method: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What the caller sets just before the call reaches the ranks, also where they are
    forked by a server started earlier with another environment (the first call starts it)."""
    name = "AIOCOLLECT_TEST_MARK"
    monkeypatch.delenv(name, raising=False)
    first = await spawn_ranks(2, targets.environment_and_cwd, name, start_method=start_method)
    assert [value for value, _ in first] == [None, None]
    monkeypatch.setenv(name, "set-later")
    monkeypatch.chdir(tmp_path)
    res = await spawn_ranks(2, targets.environment_and_cwd, name, start_method=start_method)
    assert res == [("set-later", str(tmp_path))] * 2


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
    job = spawn_ranks(2, targets.echo_rank, timeout=50, start_method="spawn")
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
