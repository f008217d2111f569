"""Staging buffers kept for reuse (transport/staging.py): a frame that arrives before its
receive is posted waits in a buffer the pool hands out again once the frame was copied
out, never one a frame still uses, and the kept memory stays within the budget.

The reuse is checked on real TCP links in one process: frames staged, copied out, then
new frames of the same size staged in the same buffers, every byte of every message
compared with what its sender sent."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks
from aiocollect.transport import staging
from aiocollect.transport.staging import StagingPool
from aiocollect.transport.wire import P2P, Key

pytestmark = pytest.mark.timeout(60)


def test_a_buffer_given_back_is_taken_again_by_its_size() -> None:
    pool = StagingPool(budget=4 << 20, min_bytes=1024)
    first = pool.take(1 << 20)
    assert len(first) == 1 << 20
    assert pool.reused == 0
    pool.give(first)
    assert pool.kept_bytes == 1 << 20
    assert pool.take(2 << 20) is not first  # another size: a new one
    again = pool.take(1 << 20)
    assert again is first
    assert pool.reused == 1
    assert pool.kept_bytes == 0
    assert pool.take(1 << 20) is not first  # taken: not handed out twice


def test_small_buffers_and_those_past_the_budget_are_let_go() -> None:
    pool = StagingPool(budget=3 << 20, min_bytes=1024)
    pool.give(bytearray(512))  # below min_bytes
    assert pool.kept_bytes == 0
    for _ in range(4):
        pool.give(bytearray(1 << 20))
    assert pool.kept_bytes == 3 << 20  # the fourth would pass the budget
    pool.clear()
    assert pool.kept_bytes == 0
    assert len(pool.take(1 << 20)) == 1 << 20
    assert pool.reused == 0


async def _arrived(g: ac.Group, src: int, tag: int, counters: range) -> None:
    """Wait (without posting a receive) until rank ``src``'s messages ``counters`` with
    ``tag`` have arrived here: they are then staged."""
    link = g._fabric.links[g._ranks[src]]
    for _ in range(100_000):
        if all(link.has_frame(Key(P2P, g._gid, c, tag, 0)) for c in counters):
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the messages never arrived")


async def test_staged_frames_reuse_buffers_and_land_exactly() -> None:
    """Rank 1 sends rank 0 two 1 MiB messages before rank 0 posts a receive; rank 0
    waits until both are staged, then receives them; three times over with new
    contents. From the second round on the staging buffers are the kept ones, and every
    message lands exactly (a buffer handed out while a frame still used it, or not fully
    overwritten, would show as wrong bytes)."""
    size = 1 << 20
    staging.POOL.clear()
    staging.POOL.reused = 0

    async def body(g: ac.Group) -> None:
        tag = 7
        for rnd in range(3):
            msgs = [np.full(size, 16 * rnd + k + 1, np.uint8) for k in range(2)]
            if g.rank == 1:
                for m in msgs:
                    await g.send(m, 0, tag=tag)
            else:
                await _arrived(g, 1, tag, range(2 * rnd, 2 * rnd + 2))
                for m in msgs:
                    got = np.zeros(size, np.uint8)
                    await g.recv(got, 1, tag=tag)
                    assert np.array_equal(got, m), f"round {rnd}: wrong bytes"
            await g.barrier()  # (the next round's frames come after this round's copies)

    await run_ranks(2, body, transport="tcp", chunk_bytes=size)
    # round 1 stages in new buffers; rounds 2 and 3 in the two each round before gave back
    assert staging.POOL.reused == 4
    assert staging.POOL.kept_bytes == 2 * size
