"""The group's default chunk size, chosen from the rendezvous records: 2 MiB where every
record declares one-sided reads that reach every rank (shared memory with pulls, on one
host), 1 MiB otherwise; an explicit ``chunk_bytes`` wins, and every rank of a group ends
with the same size."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.rendezvous.chunking import (
    DEFAULT_CHUNK_BYTES,
    PULLED_CHUNK_BYTES,
    group_chunk_bytes,
)
from aiocollect.store import MemoryStore
from aiocollect.transport import cma, host, onesided, shm_ring

pytestmark = pytest.mark.timeout(60)
_names = iter(range(1 << 30))


def _rec(**over: Any) -> dict[str, Any]:
    """A record of a rank on this host that reads its peers on this host one-sided (what
    shared memory with pulls publishes)."""
    rec: dict[str, Any] = {**host.identity(), **onesided.fields(onesided.HOST)}
    rec.update(over)
    return rec


def test_one_host_that_pulls_chooses_the_larger_chunk() -> None:
    if not host.boot_id():
        pytest.skip("this host has no boot id: its records cannot name it")
    assert group_chunk_bytes({0: _rec(), 1: _rec(), 2: _rec()}) == PULLED_CHUNK_BYTES
    anywhere = [_rec(pull=onesided.ANY, hostname=h) for h in ("g", "h")]  # reads reach hosts
    assert group_chunk_bytes(dict(enumerate(anywhere))) == PULLED_CHUNK_BYTES
    assert group_chunk_bytes({0: _rec(pull=onesided.ANY), 1: _rec()}) == PULLED_CHUNK_BYTES
    assert PULLED_CHUNK_BYTES > DEFAULT_CHUNK_BYTES


@pytest.mark.parametrize(
    "other",
    [
        _rec(pull=False),  # no one-sided reads there (AIOCOLLECT_SHM_PULL=0, shm off, ...)
        _rec(pull=True),  # not a scope
        _rec(pull="everywhere"),  # not a scope either
        _rec(boot_id="c"),  # another machine with the same hostname
        _rec(hostname="g"),
        _rec(pull=onesided.ANY, hostname="g"),  # reaches here, but this rank's reads do not
        _rec(boot_id=""),  # no boot id: the host cannot be told apart
        {**host.identity(), "transport": "tcp"},  # a TCP listener's record
    ],
)
def test_anything_else_keeps_the_default(other: dict[str, Any]) -> None:
    assert group_chunk_bytes({0: _rec(), 1: other}) == DEFAULT_CHUNK_BYTES
    assert group_chunk_bytes({0: other, 1: _rec()}) == DEFAULT_CHUNK_BYTES


def test_a_group_of_one_keeps_the_default() -> None:
    assert group_chunk_bytes({0: _rec()}) == DEFAULT_CHUNK_BYTES


async def _open_all(
    transports: list[str], chunks: list[int | None] | None = None, nbytes: int = 0
) -> list[Any]:
    """Open one group (real sockets, and shared memory where chosen) with a transport and
    a chunk_bytes per rank; each rank's chunk size after an allreduce of ``nbytes`` (whose
    result it checks), or its exception."""
    name = f"chunk-{next(_names)}"
    n = len(transports)
    chunks = chunks or [None] * n

    async def one(rank: int) -> Any:
        group = await ac.open_group(
            rank,
            n,
            store=MemoryStore(name),
            transport=transports[rank],
            timeout=20.0,
            name=name,
            chunk_bytes=chunks[rank],
        )
        try:
            count = max(1, nbytes // 4)
            buf = np.arange(count, dtype=np.float32) + rank
            await group.allreduce(buf)
            want = np.arange(count, dtype=np.float32) * n + n * (n - 1) / 2
            assert np.array_equal(buf, want), "wrong allreduce result"
            return group.chunk_bytes
        finally:
            await group.aclose()

    return list(await asyncio.gather(*(one(r) for r in range(n)), return_exceptions=True))


def _pulls_here() -> bool:
    return shm_ring.unavailable() is None and cma.enabled() and cma.self_check() is None


@pytest.mark.parametrize("transport", ["auto", "shm"])
async def test_shared_memory_groups_use_the_larger_chunk(transport: str) -> None:
    if not _pulls_here() or not host.boot_id():
        pytest.skip("shared memory with pulls is not available on this host")
    # 5 MiB and an odd tail: frames of 2 MiB and a short last one, through every rank
    res = await _open_all([transport] * 3, nbytes=5 * (1 << 20) + 12)
    assert res == [PULLED_CHUNK_BYTES] * 3, res


async def test_tcp_groups_keep_the_default() -> None:
    res = await _open_all(["tcp"] * 3, nbytes=3 * (1 << 20) + 12)
    assert res == [DEFAULT_CHUNK_BYTES] * 3, res


async def test_a_tcp_rank_keeps_the_whole_group_on_the_default() -> None:
    res = await _open_all(["auto", "tcp", "auto"], nbytes=3 * (1 << 20) + 12)
    assert res == [DEFAULT_CHUNK_BYTES] * 3, res


async def test_without_pulls_the_default_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cma.ENV, "0")
    res = await _open_all(["auto"] * 2, nbytes=3 * (1 << 20) + 12)
    assert res == [DEFAULT_CHUNK_BYTES] * 2, res


async def test_an_explicit_chunk_size_wins() -> None:
    res = await _open_all(["auto"] * 2, [1 << 19, 1 << 19], nbytes=3 * (1 << 20) + 12)
    assert res == [1 << 19] * 2, res


async def test_an_explicit_size_beside_the_default_is_refused() -> None:
    res = await _open_all(["auto"] * 2, [None, DEFAULT_CHUNK_BYTES])
    for r in res:
        assert isinstance(r, ac.RendezvousError), res
        assert "chunk_bytes=default" in str(r), str(r)
