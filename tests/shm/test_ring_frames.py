"""Frames through shared-memory rings: frames larger than the ring, headers that wrap around
its end, the sender's memory once a send is drained, idle links that never poll, and which
links are shared memory. (The collective bodies over shared memory, as over every
transport: tests/collectives, tests/multiprocess.)"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks, spawn_ranks
from tests.support.targets import shm as targets


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
