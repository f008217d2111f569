"""Rank bodies for the shared-memory tests (module level, so spawned processes import them)."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.transport.shm import ShmLink


def link_kinds_of(g: ac.Group) -> list[str]:
    links = g._fabric.links
    return [
        "shm" if isinstance(link := links[p], ShmLink) and link.shm else "tcp"
        for p in sorted(links)
    ]


async def link_kinds(g: ac.Group) -> list[str]:
    """``shm`` or ``tcp`` for each peer link, in peer order."""
    kinds = link_kinds_of(g)
    await g.barrier()
    return kinds


async def big_frames(g: ac.Group, count: int) -> bool:
    """Large allreduces and broadcasts, several in flight, checked exactly."""
    n = g.world_size
    arrays = [np.arange(count, dtype=np.float64) * (g.rank + 1 + i) for i in range(3)]
    await asyncio.gather(*(g.allreduce(a) for a in arrays))
    total = n * (n + 1) // 2
    for i, a in enumerate(arrays):
        np.testing.assert_array_equal(a, np.arange(count, dtype=np.float64) * (total + i * n))
    for root in range(n):
        b = np.full(count // 3, g.rank, np.int32)
        await g.broadcast(b, root=root)
        assert (b == root).all()
    return True


async def allreduce_forever(g: ac.Group, size: int) -> dict[str, Any]:
    """Allreduce until the group fails; report the error."""
    buf = np.ones(size, np.float32)
    try:
        while True:
            await g.allreduce(buf)
    except ac.AiocollectError as exc:
        cause = exc.__cause__
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "cause": type(cause).__name__ if cause else None,
        }


async def allreduce_until_told(
    g: ac.Group, count: int, ready_key: str, go_key: str, after: int
) -> dict[str, Any]:
    """Allreduce (checked exactly) while the test does something to the ranks: publish
    this rank's pid under ``ready_key`` once links are warm, keep going until ``go_key``
    appears in the store (rank 0 looks, every rank learns it in the same allreduce), then
    ``after`` more rounds. Returns the rounds done and the error, if any."""
    n = g.world_size
    want = n * (n + 1) / 2
    buf = np.empty(count, np.float64)
    flag = np.zeros(1, np.int64)
    rounds = 0
    try:
        await g.store.set(f"{ready_key}/{g.rank}", str(os.getpid()).encode())
        while True:
            buf[:] = g.rank + 1
            await g.allreduce(buf)
            assert (buf == want).all(), f"round {rounds}: {buf[:4]}"
            rounds += 1
            flag[0] = 1 if g.rank == 0 and (await g.store.check([go_key]))[0] else 0
            await g.allreduce(flag, op=ac.ReduceOp.MAX)
            if flag[0]:
                break
        for _ in range(after):
            buf[:] = g.rank + 1
            await g.allreduce(buf)
            assert (buf == want).all(), f"round {rounds}: {buf[:4]}"
            rounds += 1
    except ac.AiocollectError as exc:
        return {"rounds": rounds, "error": f"{type(exc).__name__}: {exc}"}
    return {"rounds": rounds, "error": None}


async def corrupt_pull_count(g: ac.Group, count: int) -> dict[str, Any]:
    """Rank 1 claims pulls rank 0 never sent (it publishes the count after its next real
    pull); both ranks allreduce frames sent by reference until the group breaks. Returns
    what each rank raised, its cause and, for a relayed failure, the ABORT it came in."""
    if g.rank == 1:
        link = g._fabric.links[0]
        assert isinstance(link, ShmLink)
        assert link.shm
        link._pulls.pulled = 1 << 40
    await g.barrier()
    buf = np.ones(count, np.float32)
    try:
        for _ in range(20):
            await g.allreduce(buf, timeout=20, algorithm="ring")  # (frames by reference)
    except ac.AiocollectError as exc:
        cause = exc.__cause__
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "cause": f"{type(cause).__name__}: {cause}" if cause else None,
            "abort": getattr(exc, "abort_info", None) or getattr(cause, "abort_info", None),
        }
    return {"error": None}


async def socket_and_ring(g: ac.Group, rounds: int) -> tuple[bool, int, int]:
    """Small and large allreduces, broadcasts and tagged send/recv in flight together for
    ``rounds`` rounds, every result checked exactly; returns True and, over this rank's
    links, the frames sent on the socket and the frames sent by reference or through the
    ring."""
    n, r = g.world_size, g.rank
    total = n * (n + 1) // 2
    for i in range(rounds):
        small = [np.full(1 + k, r + 1 + i, np.float32) for k in range(3)]
        large = np.arange(300_000, dtype=np.float64) * (r + 1)
        root = i % n
        bcast = np.full(50_000 if i % 2 else 3, r, np.int64)
        size = 7 + i if i % 2 else 300_000  # (1.2 MB: by reference or through the ring)
        out = np.full(size, r * 100 + i, np.int32)
        got = np.empty(size, np.int32)
        await asyncio.gather(
            *(g.allreduce(a) for a in small),
            g.allreduce(large),
            g.broadcast(bcast, root=root),
            g.send(out, (r + 1) % n, tag=i),
            g.recv(got, (r - 1) % n, tag=i),
        )
        for a in small:
            assert (a == total + n * i).all(), (i, a)
        np.testing.assert_array_equal(large, np.arange(300_000, dtype=np.float64) * total)
        assert (bcast == root).all()
        assert (got == ((r - 1) % n) * 100 + i).all()
    links = [link for link in g._fabric.links.values() if isinstance(link, ShmLink)]
    on_socket = sum(link.frames_on_socket for link in links)
    through_ring = sum(link.frames_sent - link.frames_on_socket for link in links)
    await g.barrier()
    return True, on_socket, through_ring


async def on_link_then_allreduce(
    g: ac.Group, act: Callable[[ShmLink], Awaitable[None]]
) -> tuple[str, str]:
    """Rank 0 does ``act`` to its shared-memory link to rank 1; both ranks then allreduce
    until the group fails. Returns the error class and its cause (``"no error"`` if none
    came)."""
    try:
        # (every rank's group formed first: a link error before its fabric knows the link
        # breaks that rank alone, and the peer then sees only the link closing)
        await g.barrier()
        if g.rank == 0:
            link = g._fabric.links[1]
            assert isinstance(link, ShmLink)
            assert link.shm
            await act(link)
        for _ in range(100):  # rank 0's first allreduce may complete before rank 1 reports
            await g.allreduce(np.ones(4, np.float32))
    except ac.AiocollectError as exc:
        cause = exc.__cause__ or exc if isinstance(exc, ac.GroupBrokenError) else exc
        return type(exc).__name__, f"{type(cause).__name__}: {cause}"
    return "no error", ""


async def bytes_on_the_socket(g: ac.Group, data: bytes, cuts: tuple[int, ...]) -> tuple[str, str]:
    """:func:`on_link_then_allreduce`, rank 0 writing ``data`` on the link's socket by
    hand, in pieces cut at ``cuts`` (one loop turn apart, so that they tend to arrive in
    separate reads)."""

    async def write(link: ShmLink) -> None:
        assert link.transport is not None
        for lo, hi in zip((0, *cuts), (*cuts, len(data)), strict=True):
            if data[lo:hi]:
                link.transport.write(data[lo:hi])
                await asyncio.sleep(0)

    return await on_link_then_allreduce(g, write)


def link_sockets_of(g: ac.Group) -> dict[int, tuple[str, str, bool]]:
    """Per peer: the family of its link's socket (``AF_UNIX``, ``AF_INET``...), how the link
    names its peer, and whether it is in shared memory mode."""
    out = {}
    for peer, link in sorted(g._fabric.links.items()):
        transport = getattr(link, "transport", None)
        sock = None if transport is None else transport.get_extra_info("socket")
        family = "none" if sock is None else socket.AddressFamily(sock.family).name
        out[peer] = (family, link.describe(), isinstance(link, ShmLink) and link.shm)
    return out


async def link_sockets(g: ac.Group) -> dict[str, Any]:
    """This rank's pid, its links' sockets (:func:`link_sockets_of`) and an allreduce's
    result (ranks r contribute r + 1, small and 1 MiB)."""
    found = link_sockets_of(g)
    small = np.full(3, g.rank + 1.0)
    large = np.full(1 << 18, g.rank + 1.0, np.float32)
    await asyncio.gather(g.allreduce(small), g.allreduce(large))
    sums = {float(small[0]), float(large.min()), float(large.max())}
    return {"pid": os.getpid(), "links": found, "sums": sorted(sums)}
