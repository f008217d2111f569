"""allgatherv by ring against Bruck's rounds (``--fixed``: the fixed-size allgather by
direct against Bruck's rounds): where the automatic choice should switch.

For each world size, the median time of an allgatherv of one row of ``--bytes`` bytes per
rank, by ``ring`` and by ``bruck`` (forced), over TCP, in two settings: every rank on one
event loop (how many ranks per process run: ``aiocollect.testing.many``), and one process
per rank (``--procs``, the sizes that fit the machine). Printed: one line per world size
and setting with both medians in microseconds::

    PYTHONPATH=. python tools/allgatherv_crossover.py               # 2 3 4 8 16 64 on one loop
    PYTHONPATH=. python tools/allgatherv_crossover.py --procs 2 3 4 8
    PYTHONPATH=. python tools/allgatherv_crossover.py --fixed 8 16 32 64

Not a test: one measurement (docs/algorithms.md, "allgatherv", quotes it).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.testing import run_ranks, spawn_ranks

ALGORITHMS = ("ring", "bruck")
FIXED = ("direct", "bruck")


async def _timed(g: ac.Group, nbytes: int, reps: int, fixed: bool) -> dict[str, float]:
    """Median seconds of ``reps`` allgathervs (``fixed``: allgathers) per algorithm, on
    this rank (each round of the loop starts after a barrier, so every rank times the
    same operations)."""
    row = np.full((1, nbytes), g.rank % 256, np.uint8)
    out: dict[str, float] = {}
    for alg in FIXED if fixed else ALGORITHMS:

        async def once() -> None:
            if fixed:
                await g.allgather(row[0], algorithm=alg)  # noqa: B023 (awaited in the loop)
            else:
                await g.allgatherv(row, algorithm=alg)  # noqa: B023

        await once()  # (plans, links)
        times = []
        for _ in range(reps):
            await g.barrier()
            start = time.perf_counter()
            await once()
            times.append(time.perf_counter() - start)
        out[alg] = statistics.median(times)
    return out


async def _one_loop(n: int, nbytes: int, reps: int, fixed: bool) -> dict[str, float]:
    res = await run_ranks(n, _timed, nbytes, reps, fixed, transport="tcp", timeout=600)
    return {alg: max(r[alg] for r in res) for alg in res[0]}


async def _procs(n: int, nbytes: int, reps: int, fixed: bool) -> dict[str, float]:
    res: list[Any] = await spawn_ranks(
        n, _timed, nbytes, reps, fixed, timeout=600, transport="tcp", uvloop=True
    )
    return {alg: max(r[alg] for r in res) for alg in res[0]}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="PYTHONPATH=. python tools/allgatherv_crossover.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("sizes", type=int, nargs="*", default=[2, 3, 4, 8, 16, 64])
    parser.add_argument("--procs", action="store_true", help="one process per rank")
    parser.add_argument("--bytes", type=int, default=4, help="bytes per rank (one row)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument(
        "--fixed", action="store_true", help="the fixed-size allgather: direct against bruck"
    )
    args = parser.parse_args()
    setting = "processes" if args.procs else "one loop"
    for n in args.sizes:
        run = _procs if args.procs else _one_loop
        got = asyncio.run(run(n, args.bytes, args.reps, args.fixed))
        print(
            f"{n:5d} ranks ({setting}, {args.bytes} B each): "
            + "  ".join(f"{alg} {t * 1e6:9.0f} us" for alg, t in got.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
