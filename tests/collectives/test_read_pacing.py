"""TCP links let the event loop run between large reads (transport/tcp.py READ_BUDGET):
over real sockets, a large payload is read in budget-sized runs separated by a loop pass,
reading resumes afterwards, and the data arrives intact."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks
from aiocollect.transport import tcp, tcp_link

pytestmark = pytest.mark.timeout(120)


async def test_large_reads_yield_to_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    yields: list[int] = []
    original = tcp_link.TcpLink._yield_reading

    def spy(self: tcp_link.TcpLink) -> None:
        yields.append(self._read_run)
        original(self)

    monkeypatch.setattr(tcp_link.TcpLink, "_yield_reading", spy)
    count = 8 * 1024 * 1024  # 32 MiB of float32

    async def body(g: ac.Group) -> Any:
        buf = np.arange(count, dtype=np.float32) if g.rank == 0 else np.zeros(count, np.float32)
        await g.broadcast(buf, root=0, algorithm="binomial")
        links = g._fabric.links.values()
        await asyncio.sleep(0)  # one pass: every pending resume has run
        return (
            bool(np.array_equal(buf, np.arange(count, dtype=np.float32))),
            [link._yielding or link._reading_paused for link in links],  # type: ignore[attr-defined]
        )

    results = await run_ranks(2, body, transport="tcp")
    assert all(ok for ok, _ in results)
    assert not any(any(paused) for _, paused in results), results  # reading resumed
    # Rank 1 reads most of the 32 MiB straight into place (the first bytes of each chunk
    # come through the read-ahead buffer): a yield after each READ_BUDGET or a little more.
    assert len(yields) >= count * 4 // (2 * tcp.READ_BUDGET), yields
    assert all(n >= tcp.READ_BUDGET for n in yields), yields
