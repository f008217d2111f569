"""Rank bodies for the fault tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

import numpy as np

import aiocollect as ac


async def loop_until_failure(
    g: ac.Group, size: int, ready_key: str, algorithm: str | None = None
) -> dict[str, Any]:
    """Allreduce in a loop; once a few have succeeded, publish readiness in the store (the
    test waits on it before injecting the fault), then report the first error and when it
    was raised (time.time, comparable across processes)."""
    buf = np.ones(size, np.float32)
    done = 0
    try:
        while True:
            await g.allreduce(buf, algorithm=algorithm)
            buf[:] = 1
            done += 1
            if done == 3:
                await g.store.set(f"{ready_key}/{g.rank}", str(os.getpid()).encode())
    except ac.AiocollectError as exc:
        if isinstance(exc, ac.GroupBrokenError) and isinstance(exc.__cause__, ac.PeerError):
            # the previous collective finished just before the failure arrived: this call
            # raised GroupBrokenError caused by it (documented behaviour)
            exc = exc.__cause__
        later = ""
        try:
            g.barrier()
        except ac.GroupBrokenError as broken:
            later = type(broken.__cause__).__name__
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "at": time.time(),
            "rank_attr": getattr(exc, "rank", None),
            "ranks": getattr(exc, "ranks", None),
            "later": later,
            "done": done,
        }


async def reopen_after_failure(g: ac.Group, size: int, ready_key: str) -> dict[str, Any]:
    """As loop_until_failure, then open a new group (new name) among the survivors."""
    result = await loop_until_failure(g, size, ready_key)
    return result


async def open_after_close(g: ac.Group) -> list[int]:
    """A few operations over every link size path, then the group's close: the peers whose
    connection is still open right after ``aclose`` returned (none: nothing outlives it).
    Warnings are errors in this process, as where uvloop's loop found a connection still
    open at its close and refused to close (EBUSY)."""
    import warnings

    warnings.simplefilter("error")
    for count in (1, 1 << 18):
        await g.allreduce(np.ones(count, np.float32))
    await g.barrier()
    await g.aclose()
    links = g._fabric.links  # (the links the close ended)
    return sorted(
        peer
        for peer, link in links.items()
        if getattr(link, "transport", None) is not None and not link.gone.is_set()  # type: ignore[attr-defined]
    )


async def close_links_then_linger(g: ac.Group, linger: float) -> tuple[str, float]:
    """Rank 1 ends its connections without GOODBYE or ABORT (as a process's exit does) and
    lives on ``linger`` seconds; rank 0 waits in an allreduce rank 1 never calls. Returns
    (what rank 0 raised, when: time.time) on rank 0, ("ended", when its process goes on to
    exit) on rank 1."""
    if g.rank == 1:
        await g.barrier()
        for link in g._fabric.links.values():
            fd = link.transport.get_extra_info("socket").fileno()  # type: ignore[attr-defined]
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)  # (the peer reads the end now)
        await asyncio.sleep(linger)  # (the fault: this process lives on meanwhile)
        return ("ended", time.time())
    await g.barrier()
    try:
        await g.allreduce(np.ones(4, np.float32))
    except ac.AiocollectError as exc:
        return (type(exc).__name__, time.time())
    return ("no error", time.time())
