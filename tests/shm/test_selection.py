"""Which transport each link gets: auto picks shared memory for peers on this host and TCP
for the others (per link, in one group), shm forces it (and fails for a remote peer), tcp
stays TCP, and a segment that cannot be mapped falls back to TCP under auto."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.store import MemoryStore
from aiocollect.transport import host, shm_ring
from aiocollect.transport.shm import ShmLink
from tests.support.targets.shm import link_kinds_of

pytestmark = pytest.mark.timeout(30)
_current_rank: contextvars.ContextVar[int] = contextvars.ContextVar("rank", default=-1)
_names = iter(range(1 << 30))


async def _open_all(transports: list[str], timeout: float = 10.0) -> list[Any]:
    """Open one group with a different transport per rank; returns each rank's link kinds
    after an allreduce, or its exception."""
    name = f"sel-{next(_names)}"
    n = len(transports)

    async def one(rank: int) -> Any:
        _current_rank.set(rank)  # seen by the tasks rendezvous starts for this rank
        group = await ac.open_group(
            rank, n, store=MemoryStore(name), transport=transports[rank], timeout=timeout, name=name
        )
        try:
            buf = np.full(5, rank + 1.0)
            await group.allreduce(buf)
            assert buf[0] == n * (n + 1) / 2
            return link_kinds_of(group)
        finally:
            await group.aclose()

    return list(await asyncio.gather(*(one(r) for r in range(n)), return_exceptions=True))


async def test_auto_uses_shm_on_one_host() -> None:
    assert await _open_all(["auto"] * 3) == [["shm", "shm"]] * 3


async def test_tcp_is_pure_tcp() -> None:
    assert await _open_all(["tcp"] * 3) == [["tcp", "tcp"]] * 3


async def test_auto_with_a_tcp_rank_uses_tcp_to_it() -> None:
    res = await _open_all(["auto", "tcp", "auto"])
    assert res == [["tcp", "shm"], ["tcp", "tcp"], ["shm", "tcp"]]


async def test_auto_is_per_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 'on another host': links 0-1 use shared memory, links to rank 2 TCP."""
    real = host.same_host
    monkeypatch.setattr(
        host, "same_host", lambda rec: real(rec) and rec["rank"] != 2 and _current_rank.get() != 2
    )
    assert await _open_all(["auto"] * 3) == [["shm", "tcp"], ["shm", "tcp"], ["tcp", "tcp"]]


async def test_forced_shm_with_a_remote_peer_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = host.same_host
    monkeypatch.setattr(host, "same_host", lambda rec: real(rec) and rec["rank"] != 1)
    res = await _open_all(["shm", "shm"], timeout=3)
    assert isinstance(res[0], ac.RendezvousError), res
    assert "one host" in str(res[0])
    assert "rank 1" in str(res[0])


async def test_forced_shm_with_a_tcp_peer_fails() -> None:
    res = await _open_all(["shm", "tcp"], timeout=3)
    assert isinstance(res[0], ac.RendezvousError), res
    assert "does not use shared memory" in str(res[0]), res
    assert isinstance(res[1], ac.AiocollectError), res


@pytest.mark.parametrize("transport", ["auto", "shm"])
async def test_unmappable_segment(monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    """The peer's segment cannot be opened here (e.g. the peer runs in another pid
    namespace, so /proc/<pid>/fd is not its): auto stays on TCP, shm fails to form; no
    segment stays open or mapped either way."""

    def attach(pid: int, fd: int, capacity: int, token: bytes) -> shm_ring.Segment:
        raise FileNotFoundError(f"no /proc/{pid}/fd/{fd} here")

    monkeypatch.setattr(shm_ring.Segment, "attach", staticmethod(attach))
    res = await _open_all([transport] * 2, timeout=3)
    if transport == "auto":
        assert res == [["tcp"], ["tcp"]]
    else:
        assert any(
            isinstance(r, ac.RendezvousError) and "no shared-memory link" in str(r) for r in res
        ), res


async def test_segment_creation_failure_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def create(capacity: int) -> shm_ring.Segment:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm_ring.Segment, "create", staticmethod(create))
    assert await _open_all(["auto"] * 2) == [["tcp"], ["tcp"]]


def test_shm_unavailable_is_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiocollect.api as api

    monkeypatch.setattr(shm_ring, "unavailable", lambda: "not here")  # what shm asks
    with pytest.raises(ac.UsageError, match="not here"):
        asyncio.run(
            api._open(
                0,
                1,
                store="memory://u",
                transport="shm",
                timeout=1,
                secret=None,
                host=None,
                ssl=None,
                name="u",
                chunk_bytes=None,
            )
        )


async def test_ring_capacity_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOCOLLECT_SHM_RING_BYTES", str(256 << 10))
    name = "cap"

    async def one(rank: int) -> int:
        async with ac.open_group(rank, 2, store=MemoryStore(name), transport="shm", name=name) as g:
            link = g._fabric.links[1 - rank]
            assert isinstance(link, ShmLink)
            assert link._tx is not None
            await g.barrier()
            return link._tx.cap

    assert await asyncio.gather(one(0), one(1)) == [256 << 10] * 2


async def test_forced_shm_segment_creation_failure_names_the_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def create(capacity: int) -> shm_ring.Segment:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm_ring.Segment, "create", staticmethod(create))
    res = await _open_all(["shm"] * 2, timeout=3)
    assert isinstance(res[1], ac.RendezvousError), res
    assert "No space left" in str(res[1]), res
