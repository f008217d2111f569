"""Rank bodies for the mismatch tests in real processes (module level, so spawned ranks can
import them)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import aiocollect as ac


async def wrong_root(g: ac.Group, wrong: int, root: int, count: int) -> dict[str, Any]:
    """Broadcast from rank 0, except that rank ``wrong`` passes ``root=root``. Reports what
    the broadcast raised and when; a rank whose broadcast succeeded returns, and learns of
    the mismatch (if at all) from ``aclose`` — which then raises in the child."""
    await g.barrier()
    t0 = time.monotonic()
    try:
        await g.broadcast(np.zeros(count, np.float32), root=root if g.rank == wrong else 0)
    except ac.MismatchError as exc:
        return {"error": "MismatchError", "message": str(exc), "elapsed": time.monotonic() - t0}
    except ac.GroupBrokenError as exc:
        return {
            "error": "GroupBrokenError",
            "message": str(exc),
            "cause": type(exc.__cause__).__name__,
            "elapsed": time.monotonic() - t0,
        }
    return {"error": None, "elapsed": time.monotonic() - t0}


async def wrong_root_then_barrier(g: ac.Group, wrong: int, root: int, count: int) -> dict[str, Any]:
    """As :func:`wrong_root`, then a barrier: a rank whose broadcast succeeded learns the
    mismatch there (GroupBrokenError caused by it, or MismatchError while in flight)."""
    first = await wrong_root(g, wrong, root, count)
    if first["error"] is not None:
        return first
    t0 = time.monotonic() - first["elapsed"]
    try:
        await g.barrier()
    except ac.MismatchError as exc:
        return {
            "error": "MismatchError",
            "message": str(exc),
            "at": "barrier",
            "elapsed": time.monotonic() - t0,
        }
    except ac.GroupBrokenError as exc:
        return {
            "error": "GroupBrokenError",
            "message": str(exc),
            "at": "barrier",
            "cause": type(exc.__cause__).__name__,
            "elapsed": time.monotonic() - t0,
        }
    return {"error": None, "elapsed": time.monotonic() - t0}


async def raise_on_rank(g: ac.Group, bad: int) -> None:
    """Every rank joins an allreduce, except ``bad``, which raises KeyError('missing')."""
    await g.barrier()
    if g.rank == bad:
        raise KeyError("missing")
    await g.allreduce(np.ones(1000, np.float32))


async def fewer_operations(g: ac.Group, short: int) -> dict[str, Any]:
    """Every rank but ``short`` calls a second broadcast, rooted at ``short``, that
    ``short`` never calls; ``short`` closes after the first. Reports what the other ranks'
    broadcasts raised (the first may already fail: a peer's ABORT can overtake its data)."""
    try:
        await g.broadcast(np.zeros(8, np.float32), root=0)
        if g.rank == short:
            return {"error": None}
        await g.broadcast(np.zeros(8, np.float32), root=short)
    except ac.MismatchError as exc:
        return {"error": "MismatchError", "message": str(exc)}
    except ac.GroupBrokenError as exc:
        return {
            "error": "GroupBrokenError",
            "message": str(exc),
            "cause": type(exc.__cause__).__name__,
        }
    return {"error": None}
