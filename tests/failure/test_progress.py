"""Progress you can see: an operation that makes no progress logs a WARNING naming the
operation, its sequence number and the ranks not heard from, repeated with back-off, well
before its deadline; AIOCOLLECT_TIMEOUT sets the deadline when open_group gets none."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.store import MemoryStore
from aiocollect.testing import run_ranks
from aiocollect.testing.proxynet import ProxyNetwork
from tests.support.stall_warnings import StallWarnings

pytestmark = pytest.mark.timeout(60)

_names = itertools.count()
STALL = re.compile(
    r"(\w+) \(op #(\d+) of group '[^']+'\) on rank (\d+): no progress for "
    r"[\d.]+ s; waiting for ranks \[([\d, ]*)\]"
)


async def test_stalled_operation_warns_with_backoff(stall_warnings: StallWarnings) -> None:
    """Rank 2 calls its allreduce late: ranks 0 and 1 warn (op, seq, rank 2 not heard from,
    rank 2 has not called it) at about 0.4, 1.2, 2.8 s — then the op completes."""
    go = asyncio.Event()

    async def body(g: ac.Group) -> float:
        await g.barrier()
        if g.rank == 2:
            await go.wait()
        buf = np.ones(4, np.float32)
        await g.allreduce(buf)
        return float(buf[0])

    async def release() -> None:
        await stall_warnings.wait(3, rank=0)
        go.set()

    results, _ = await asyncio.gather(run_ranks(3, body, transport="tcp", timeout=30), release())
    assert results == [3.0] * 3
    mine = stall_warnings.of(0)
    m = STALL.search(mine[0][1])
    assert m is not None, mine[0][1]
    assert m.group(1) == "allreduce", m.groups()
    assert m.group(2) == "1", m.groups()
    assert m.group(4), m.groups()
    # the ring waits for a neighbour; the ping says who has not called it at all
    assert "ranks [2] have not called it" in mine[-1][1], mine[-1][1]
    assert "times out in" in mine[0][1]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(mine[:3])]
    assert gaps[1] > 1.5 * gaps[0], gaps  # back-off
    assert not stall_warnings.of(2)  # rank 2 was never waiting


@pytest.fixture
async def network() -> AsyncIterator[ProxyNetwork]:
    store = MemoryStore(f"progress-{next(_names)}", timeout=30)
    net = ProxyNetwork(store, seed=7)
    try:
        yield net
    finally:
        await net.close()
        await store.close()


@pytest.mark.one_loop  # waits out a timeout; nothing loop-specific
async def test_dead_network_path_warns_before_the_timeout(
    network: ProxyNetwork, stall_warnings: StallWarnings
) -> None:
    """Link 0-1 stops carrying bytes (a dead network path): the ends warn, naming each
    other, long before their deadline; at the deadline they raise PeerTimeout."""
    deadline = 4.0
    armed = asyncio.Event()
    arrived = [0]
    t0 = [0.0]

    async def body(g: ac.Group) -> str:
        await g.allreduce(np.ones(1024, np.float32))
        arrived[0] += 1
        if arrived[0] == g.world_size:
            network.link(0, 1).stall("both")
            armed.set()
        await armed.wait()
        t0[0] = t0[0] or time.monotonic()
        try:
            await g.allreduce(np.ones(1 << 16, np.float32), algorithm="ring", timeout=deadline)
            await g.barrier(timeout=deadline)
        except ac.AiocollectError as exc:
            cause = exc.__cause__ if isinstance(exc, ac.GroupBrokenError) else exc
            return type(cause).__name__
        return "no error"

    try:
        results = await network.run_ranks(3, body, name="dead-path", timeout=30)
    finally:
        network.link(0, 1).resume()
    assert all(r == "PeerTimeout" for r in results), results
    for rank, other in ((0, 1), (1, 0)):
        mine = stall_warnings.of(rank)
        assert mine, f"rank {rank} never warned"
        assert STALL.search(mine[0][1]) is not None, mine[0][1]
        # its data to the other end sits in the dead path; the ping names the other end
        assert any(f"ranks [{other}] did not answer a ping" in m for _, m in mine), mine
        assert mine[0][0] - t0[0] < deadline / 2, "warned late"


async def test_aiocollect_timeout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    async def timeout_of(g: ac.Group) -> float | None:
        return g.timeout

    monkeypatch.setenv("AIOCOLLECT_TIMEOUT", "12.5")
    # run_ranks passes timeout= explicitly: use open_group's default here
    name = f"env-timeout-{next(_names)}"
    opened = await asyncio.gather(
        *(ac.open_group(r, 2, store=f"memory://{name}", name=name) for r in range(2))
    )
    assert [await timeout_of(g) for g in opened] == [12.5, 12.5]
    await asyncio.gather(*(g.aclose() for g in opened))
    monkeypatch.setenv("AIOCOLLECT_TIMEOUT", "none")
    name = f"env-timeout-{next(_names)}"
    opened = await asyncio.gather(
        *(ac.open_group(r, 2, store=f"memory://{name}", name=name) for r in range(2))
    )
    assert [g.timeout for g in opened] == [None, None]
    await asyncio.gather(*(g.aclose() for g in opened))
    # an explicit argument wins, also 300.0 itself
    g = await ac.open_group(0, 1, store=f"memory://{name}-solo", name="solo", timeout=300.0)
    assert g.timeout == 300.0
    await g.aclose()
    monkeypatch.setenv("AIOCOLLECT_TIMEOUT", "soon")
    with pytest.raises(ac.UsageError, match="AIOCOLLECT_TIMEOUT"):
        await ac.open_group(0, 1, store=f"memory://{name}-bad", name="bad")
