"""The collective sweeps of tests/collectives and tests/multiprocess, over shared memory:
the same bodies, in one process (every link a pair of rings in a memfd) and in real
processes (transport="shm" forced, and "auto" on one host)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks, spawn_ranks
from tests.collectives import test_sweep
from tests.collectives.algorithms import sweep_algorithms
from tests.helpers import CHUNK
from tests.multiprocess import targets as mp_targets
from tests.shm import targets

#: The one-process sweeps of tests/collectives/test_sweep.py, run as they are with
#: transport="shm" (here, on asyncio only, with this suite's leak checks) rather than
#: copied: (test, world sizes).
SWEEPS = [
    (test_sweep.test_allreduce, test_sweep.SIZES),
    (test_sweep.test_reduce, test_sweep.SIZES),
    (test_sweep.test_data_movement, test_sweep.SIZES),
    (test_sweep.test_send_recv, [2, 3, 4, 7]),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("sweep", "n"),
    [
        pytest.param(test, n, id=f"{test.__name__.removeprefix('test_')}-{n}")
        for test, sizes in SWEEPS
        for n in sizes
    ],
)
async def test_sweep_over_shm(sweep: Callable[[int, str], Awaitable[None]], n: int) -> None:
    await sweep(n, "shm")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [3, 5])
async def test_algorithms(n: int) -> None:
    dtypes = [np.dtype(np.int32), np.dtype(np.float32)]
    res = await run_ranks(n, sweep_algorithms, dtypes, transport="shm", chunk_bytes=CHUNK)
    assert res[0] > 20


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("n", "transport"), [(2, "shm"), (5, "auto")])
async def test_algorithms_in_processes(n: int, transport: str) -> None:
    dtypes = [np.dtype(np.bool_), np.dtype(np.int64), np.dtype(np.float64)]
    res = await spawn_ranks(
        n, sweep_algorithms, dtypes, timeout=250, chunk_bytes=CHUNK, transport=transport
    )
    assert len(set(res)) == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3, 4])
async def test_sweep_in_processes(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if n == 2:  # spinning readers (opt-in, and only while ranks <= cores)
        monkeypatch.setenv("AIOCOLLECT_SHM_SPIN_US", "300")
    counts = await spawn_ranks(n, mp_targets.sweep, timeout=200, chunk_bytes=CHUNK, transport="shm")
    assert len(counts) == n
    assert counts[0] > 50
    assert len(set(counts)) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("n", "spin_us"), [(3, "0"), (2, "500")])
@pytest.mark.parametrize("uvloop", [False, True])
async def test_concurrent_allreduces(
    uvloop: bool, n: int, spin_us: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several allreduces in flight, readers sleeping at once or (2 ranks, so no more
    than the cores of any CI machine) spinning first."""
    monkeypatch.setenv("AIOCOLLECT_SHM_SPIN_US", spin_us)  # the children inherit it
    res = await spawn_ranks(
        n, mp_targets.concurrent, 50_000, timeout=100, uvloop=uvloop, transport="shm"
    )
    want = [float(sum(r + i for r in range(n))) for i in range(6)]
    assert res == [want] * n


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("uvloop", "pull"), [(False, "0"), (True, "0"), (True, "")])
async def test_frames_larger_than_the_ring(
    uvloop: bool, pull: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 1 MiB through 64 KiB rings: with pulls off, every frame is written in
    pieces as the reader frees space, in both directions at once, several operations in
    flight; with pulls on, the same frames go by reference."""
    monkeypatch.setenv("AIOCOLLECT_SHM_RING_BYTES", str(64 << 10))  # the children inherit it
    monkeypatch.setenv("AIOCOLLECT_SHM_PULL", pull)
    res = await spawn_ranks(
        3,
        targets.big_frames,
        3 << 20,
        timeout=100,
        uvloop=uvloop,
        transport="shm",
        chunk_bytes=1 << 20,
    )
    assert res == [True] * 3


async def _ping_pong(g: ac.Group, rounds: int) -> bool:
    """``rounds`` round trips of one float32 each way between ranks 0 and 1, checked."""
    out, back = np.zeros(1, np.float32), np.zeros(1, np.float32)
    peer = 1 - g.rank
    for i in range(rounds):
        if g.rank == 0:
            out[0] = i
            await g.send(out, peer, tag=3)
            await g.recv(back, peer, tag=3)
            assert back[0] == i + 1, (i, back[0])
        else:
            await g.recv(back, peer, tag=3)
            out[0] = back[0] + 1
            await g.send(out, peer, tag=3)
    return True


@pytest.mark.timeout(60)
async def test_small_frames_whose_headers_wrap_around_the_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader takes a small frame's header straight from the ring unless it wraps
    around the ring's end: 54-byte frames (a 50-byte header, 4 bytes) through 64 KiB
    rings put the header of frame 1,214 across the end on the first lap (54 k mod 65536
    passes 65486), and 3,000 round trips lap each ring twice."""
    from aiocollect.transport.wire import HEADER_SIZE

    assert HEADER_SIZE == 50  # (the arithmetic above)
    monkeypatch.setenv("AIOCOLLECT_SHM_RING_BYTES", str(64 << 10))
    assert await run_ranks(2, _ping_pong, 3000, transport="shm") == [True, True]


@pytest.mark.timeout(60)
async def test_links_are_shared_memory() -> None:
    kinds = await run_ranks(3, targets.link_kinds, transport="shm")
    assert kinds == [["shm", "shm"]] * 3
    kinds = await spawn_ranks(3, targets.link_kinds, timeout=50)  # auto, one host
    assert kinds == [["shm", "shm"]] * 3


@pytest.mark.timeout(60)
async def test_tcp_stays_tcp() -> None:
    assert await spawn_ranks(2, targets.link_kinds, timeout=50, transport="tcp") == [
        ["tcp"],
        ["tcp"],
    ]


@pytest.mark.timeout(60)
async def test_objects_and_split() -> None:
    res = await run_ranks(4, targets.objects_and_split, transport="shm")
    # allgather_object of the ranks; allreduce of the ranks within each color (r % 2)
    assert res == [
        ([0, 1, 2, 3], 0 + 2),
        ([0, 1, 2, 3], 1 + 3),
        ([0, 1, 2, 3], 0 + 2),
        ([0, 1, 2, 3], 1 + 3),
    ]


@pytest.mark.timeout(10)
async def test_bad_transport_is_usage_error() -> None:
    with pytest.raises(ac.UsageError, match="shm"):
        await ac.open_group(0, 1, store="memory://bad", transport="bogus")


@pytest.mark.timeout(120)
async def test_staging_is_bounded_and_nothing_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/collectives/test_backpressure.py over shared memory: with too many early
    frames the link leaves the rest in the ring, and the writer waits for space."""
    from aiocollect.transport import base
    from tests.helpers import send_past_staging

    limit = 4 * 1024 * 1024
    monkeypatch.setattr(base, "STAGING_LIMIT", limit)
    res = await run_ranks(
        2, send_past_staging, limit, limit, transport="shm", chunk_bytes=256 * 1024
    )
    assert limit < res[0] <= limit + 256 * 1024


async def _overwrite_after_send(g: ac.Group, count: int) -> bool:
    if g.rank == 0:
        data = np.arange(count, dtype=np.int64)
        await g.send(data, 1, tag=3)  # returns once drained: the ring holds its own copy
        data[:] = -1
        await g.barrier()
        return True
    await g.barrier()  # receive only after the sender has overwritten its array
    out = np.empty(count, np.int64)
    await g.recv(out, 0, tag=3)
    return bool((out == np.arange(count, dtype=np.int64)).all())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pull", ["0", ""])
async def test_sender_memory_is_free_after_drained(
    pull: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message 64x the ring: queued pieces (or frames sent by reference) use the sender's
    array only until drained(); what the sender does to it afterwards never reaches the
    receiver."""
    monkeypatch.setenv("AIOCOLLECT_SHM_RING_BYTES", str(64 << 10))
    monkeypatch.setenv("AIOCOLLECT_SHM_PULL", pull)
    assert await run_ranks(
        2, _overwrite_after_send, 1 << 19, transport="shm", chunk_bytes=1 << 20
    ) == [True, True]


async def _idle(g: ac.Group, seconds: float) -> float:
    """CPU seconds this process spends while rank 1 waits for a message rank 0 sends only
    after ``seconds``, and while both then sit idle for as long."""
    await g.barrier()
    start = time.process_time()
    if g.rank == 0:
        await asyncio.sleep(seconds)  # the measured idle period, not a synchronisation
        await g.send(np.ones(4), 1)
    else:
        await g.recv(np.empty(4), 0)
    await asyncio.sleep(seconds)
    return time.process_time() - start


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spin_us", ["0", "2000"])
async def test_idle_links_do_not_poll(spin_us: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOCOLLECT_SHM_SPIN_US", spin_us)
    cpu = await run_ranks(2, _idle, 0.5, transport="shm")
    assert max(cpu) < 0.1, cpu  # one process: both ranks' CPU over 1 s of waiting
