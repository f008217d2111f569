"""The pull collectives' bulk worker (engine/bulk.py): a thread per group at a lowered
priority that copies and reduces while the event loop serves small frames. Exact
results with it on (real processes over shared memory, both loops), its thread gone
after the group closes, a cancelled hop that returns only once the work ended, a bad
token read on the worker that still breaks the group, and a small request/reply that
completes within a bound while bulk allreduces run."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from aiocollect.engine import bulk
from aiocollect.testing import spawn_ranks
from tests.support.targets import bulk as bulk_targets
from tests.support.targets import pull as pull_targets

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def worker_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every group of the spawned ranks has a bulk worker, whatever the core count."""
    monkeypatch.setenv(bulk.ENV, "1")


def test_the_setting() -> None:
    assert not bulk.wanted(True, {})  # (off by default)
    assert bulk.wanted(False, {bulk.ENV: "1"})
    assert bulk.wanted(True, {bulk.ENV: "auto"})
    assert not bulk.wanted(False, {bulk.ENV: "auto"})
    assert not bulk.wanted(True, {bulk.ENV: "0"})
    assert not bulk.wanted(True, {bulk.ENV: "bogus"})


@pytest.mark.usefixtures("worker_on")
@pytest.mark.parametrize("uvloop", [False, True], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("n", [2, 4])
async def test_exact_with_the_worker(n: int, uvloop: bool) -> None:
    res = await spawn_ranks(n, bulk_targets.exact, timeout=100, uvloop=uvloop)
    for r in res:
        assert r["worker"], r
        assert r["threads"] == 1, r
        assert r["nice"] == bulk.NICE, r
        assert r["left"] == 0, r  # (the group's close ended its thread)


async def test_a_cancelled_run_returns_once_its_piece_ended() -> None:
    """The task awaiting the worker is cancelled while the worker runs its piece: the
    worker is told to stop, and the cancellation reaches the caller only after the piece
    wrote its last byte."""
    worker = bulk.Bulk()
    started, release = threading.Event(), threading.Event()
    out = np.zeros(4, np.int64)

    def hop(halt: threading.Event) -> None:
        started.set()
        release.wait(10)
        out[:] = 7  # the write a late return would miss
        out[0] += halt.is_set()  # (told to stop before its next piece)

    task = asyncio.ensure_future(worker.run(hop))
    await asyncio.to_thread(started.wait, 10)
    timer = threading.Timer(0.05, release.set)  # (the loop's thread is blocked meanwhile)
    timer.start()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert out.tolist() == [8, 7, 7, 7]
    timer.join()
    worker.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("aiocollect-bulk")]
    with pytest.raises(RuntimeError, match="closed"):
        await worker.run(hop)


async def test_errors_come_back_from_the_worker() -> None:
    worker = bulk.Bulk()

    def fails(halt: threading.Event) -> None:
        raise ValueError("from the worker")

    def total(halt: threading.Event, xs: list[int]) -> int:
        return sum(xs) + halt.is_set()

    with pytest.raises(ValueError, match="from the worker"):
        await worker.run(fails)
    assert await worker.run(total, [1, 2]) == 3
    worker.close()


@pytest.mark.usefixtures("worker_on")
@pytest.mark.parametrize(("fault", "why"), [("address", "does not back"), ("range", "outside")])
async def test_a_bad_read_on_the_worker_breaks_the_group(fault: str, why: str) -> None:
    """As tests/shm/test_pull_allreduce.py's lying token frame, with blocks the worker
    reads: the read fails on the worker's thread, the link fails on the loop's."""
    count = 3 * bulk.MIN_BYTES // 4  # (float32: three blocks of MIN_BYTES)
    res = await spawn_ranks(3, pull_targets.bad_record, fault, count, timeout=60)
    assert all(r != "no error" for r in res), res
    assert any("ProtocolError" in r and why in r and "rank 1" in r for r in res), res


@pytest.mark.usefixtures("worker_on")
async def test_a_small_request_overtakes_bulk_allreduces() -> None:
    """4 ranks, 64 MiB allreduces back to back: 1 KiB request/replies between ranks 0
    and 1 each complete within 0.5 s (a bound for a loaded machine; the benchmark's p99 is
    a few milliseconds: docs/design.md, *Bulk work at low priority*)."""
    res = await spawn_ranks(4, bulk_targets.small_during_bulk, 30, timeout=100)
    assert len(res[0]) == 30
    assert max(res[0]) < 0.5, sorted(res[0])[-5:]
