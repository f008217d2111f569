"""Adding a transport is one module plus one registry line: the example transport of
example_transport.py (Unix domain sockets), registered here, forms real groups through
``open_group(transport="unix")`` and reduces over them, and is refused like any other
when ranks disagree or when it is not registered."""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Iterator

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.store import MemoryStore
from aiocollect.transport import registry
from aiocollect.transport.tcp_link import TcpLink
from tests.transport.example_transport import UNIX

pytestmark = pytest.mark.timeout(30)
_names = itertools.count()


@pytest.fixture
def unix() -> Iterator[None]:
    with registry.registered(UNIX):
        yield


async def _run(transports: list[str]) -> list[object]:
    """Open one group with these transports per rank, allreduce, return each rank's sum
    and link socket families (or its exception)."""
    name = f"unix-{next(_names)}"
    n = len(transports)

    async def one(rank: int) -> object:
        async with ac.open_group(
            rank, n, store=MemoryStore(name), transport=transports[rank], name=name, timeout=5
        ) as group:
            buf = np.arange(100_000, dtype=np.float64) * (rank + 1)
            await group.allreduce(buf)
            np.testing.assert_array_equal(buf, np.arange(100_000) * (n * (n + 1) / 2))
            families = []
            for link in group._fabric.links.values():
                assert isinstance(link, TcpLink)
                assert link.transport is not None
                families.append(link.transport.get_extra_info("socket").family)
            return families

    return list(await asyncio.gather(*(one(r) for r in range(n)), return_exceptions=True))


@pytest.mark.usefixtures("unix")
async def test_allreduce_over_the_example_transport() -> None:
    assert await _run(["unix"] * 3) == [[socket.AF_UNIX] * 2] * 3


@pytest.mark.usefixtures("unix")
async def test_ranks_on_another_transport_are_refused() -> None:
    res = await _run(["unix", "tcp"])
    assert any(
        isinstance(r, ac.RendezvousError) and "uses transport 'unix'" in str(r) for r in res
    ), res


async def test_an_unregistered_transport_is_a_usage_error() -> None:
    with pytest.raises(ac.UsageError, match=r"transport must be one of \(.*got 'unix'"):
        await ac.open_group(0, 1, store=MemoryStore("unreg"), transport="unix")
