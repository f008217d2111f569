"""Where a large allreduce spends its time, phase by phase, against the floor's phases.

    python scripts/pull_phases.py --floor                      # the floor, two ranks
    aiocollect run -n 2 scripts/pull_phases.py                 # aiocollect's pull allreduce
    aiocollect run -n 4 scripts/pull_phases.py --mib 64 --iters 60

Without ``--floor`` (under the launcher) each rank runs 20 warm-up allreduces of ``--mib``
MiB (float32, the pull allreduce: ``collectives/pull.py``) and a barrier, then ``--iters``
timed ones, and prints the median per operation of: the wait for the peers' address
frames (``address``), the read-and-fold of the reduce-scatter (``fold``), the waits for
the done and finished frames (``waits``), the allgather's reads (``read``) and the whole
operation (``total``). The phases are timed by wrapping the module's own steps, so the
operation runs the library's code unchanged apart from a ``perf_counter`` call around
each step.

With ``--floor`` the same bytes go through the framework-free floor's data flow
(``aiocollect.bench.floor``: blocking code, a barrier between phases; its refill before
each iteration is outside the timing, as there) with the same phases timed: ``fold``,
``bar1`` (the barrier after it), ``read`` and ``bar2``. The data phases read and add the
same bytes in both, so their difference is the library's; the waits are each side's way
of saying a phase ended. A diagnostic (docs/benchmarks.md, *Twenty-fifth session*), not
part of aiocollect; the machine's noise moves both by 10-20 % within minutes, so
alternate the two and compare runs of the same minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import uvloop

import aiocollect as ac
from aiocollect.bench import floor
from aiocollect.collectives import pull

_spent: dict[str, float] = {}


def _timed(name: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            _spent[name] = _spent.get(name, 0.0) + time.perf_counter() - t

    return wrapper


def _wrap() -> None:
    ex = pull._Exchange
    ex.fold = _timed("fold", ex.fold)  # type: ignore[method-assign]
    ex.read = _timed("read", ex.read)  # type: ignore[method-assign]
    ex.address = _timed("address", ex.address)  # type: ignore[method-assign]
    ex.handed_back = _timed("waits", ex.handed_back)  # type: ignore[method-assign]
    pull._arrival = _timed("waits", pull._arrival)  # type: ignore[assignment]


def _report(who: str, rows: list[dict[str, float]], keys: list[str]) -> None:
    cells = [f"{k} {statistics.median(r.get(k, 0.0) for r in rows) * 1e3:.3f}" for k in keys]
    # one write per line: the floor's ranks share the terminal
    sys.stdout.write(f"{who}: " + "  ".join(cells) + " ms (medians per operation)\n")
    sys.stdout.flush()


async def _library(mib: float, iters: int) -> None:
    _wrap()
    np.seterr(all="ignore")  # (the sums grow without a refill: timing only)
    async with ac.open_group() as group:
        n = group.world_size
        buf = np.ones(max(n, int(mib * (1 << 18)) // n * n), np.float32)
        for _ in range(20):
            await group.allreduce(buf, algorithm="pull")
        await group.barrier()
        rows = []
        for _ in range(iters):
            _spent.clear()
            t = time.perf_counter()
            await group.allreduce(buf, algorithm="pull")
            _spent["total"] = time.perf_counter() - t
            rows.append(dict(_spent))
        await group.barrier()
        await asyncio.sleep(0.05 * group.rank)  # (one rank's line after another's)
        keys = ["address", "fold", "waits", "read", "total"]
        _report(f"aiocollect rank {group.rank}", rows, keys)


def _floor_worker(
    rank: int,
    n: int,
    nbytes: int,
    iters: int,
    table: Any,
    bar: Any,
    out: Any,
) -> None:
    """The floor's pull-and-add worker (aiocollect.bench.floor) with its phases timed."""
    own = np.full(nbytes // 4, rank + 1, np.float32)
    scratch = np.empty(pull.RS_STEP // 4, np.float32)
    table[2 * rank], table[2 * rank + 1] = os.getpid(), own.ctypes.data
    bar.wait(floor.BARRIER_SECONDS)
    peers = [(int(table[2 * p]), int(table[2 * p + 1])) for p in range(n)]
    stamps: list[tuple[str, float]] = []  # (a phase, when it ended)
    rows = []
    for _ in range(iters):
        own[...] = rank + 1
        bar.wait(floor.BARRIER_SECONDS)
        stamps[:] = [("start", time.perf_counter())]
        floor.pull_and_add(
            rank, own, scratch, peers, bar, lambda p: stamps.append((p, time.perf_counter()))
        )
        row = {p: t - stamps[i][1] for i, (p, t) in enumerate(stamps[1:])}
        row["total"] = stamps[-1][1] - stamps[0][1]
        rows.append(row)
    _report(f"floor rank {rank}", rows, ["fold", "bar1", "read", "bar2", "total"])
    blk = own.size // n
    ok = bool((own[: blk * n] == n * (n + 1) / 2).all())
    out.put((rank, [r["total"] for r in rows], ok))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=16.0)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--floor", action="store_true", help="time the floor's phases")
    parser.add_argument("-n", type=int, default=2, help="ranks (with --floor)")
    ns = parser.parse_args()
    if ns.floor:
        size = max(ns.n, int(ns.mib * (1 << 18)) // ns.n * ns.n) * 4
        floor.collect_pulls(_floor_worker, ns.n, (size, ns.iters))
    else:
        uvloop.run(_library(ns.mib, ns.iters))
