"""allgatherv by ring against Bruck's rounds: where the automatic choice should switch.

For each world size, the median time of an allgatherv of one row of ``--bytes`` bytes per
rank, by ``ring`` and by ``bruck`` (forced), over TCP, in two settings: every rank on one
event loop (how many ranks per process run: ``aiocollect.testing.many``), and one process
per rank (``--procs``, the sizes that fit the machine). Printed: one line per world size
and setting with both medians in microseconds::

    PYTHONPATH=. python tools/allgatherv_crossover.py               # 2 3 4 8 16 64 on one loop
    PYTHONPATH=. python tools/allgatherv_crossover.py --procs 2 3 4 8

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


async def _timed(g: ac.Group, nbytes: int, reps: int) -> dict[str, float]:
    """Median seconds of ``reps`` allgathervs per algorithm, on this rank (each round of
    the loop starts after a barrier, so every rank times the same operations)."""
    row = np.full((1, nbytes), g.rank % 256, np.uint8)
    out: dict[str, float] = {}
    for alg in ALGORITHMS:
        await g.allgatherv(row, algorithm=alg)  # (plans, links)
        times = []
        for _ in range(reps):
            await g.barrier()
            start = time.perf_counter()
            await g.allgatherv(row, algorithm=alg)
            times.append(time.perf_counter() - start)
        out[alg] = statistics.median(times)
    return out


async def _one_loop(n: int, nbytes: int, reps: int) -> dict[str, float]:
    res = await run_ranks(n, _timed, nbytes, reps, transport="tcp", timeout=600)
    return {alg: max(r[alg] for r in res) for alg in ALGORITHMS}


async def _procs(n: int, nbytes: int, reps: int) -> dict[str, float]:
    res: list[Any] = await spawn_ranks(
        n, _timed, nbytes, reps, timeout=600, transport="tcp", uvloop=True
    )
    return {alg: max(r[alg] for r in res) for alg in ALGORITHMS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes", type=int, nargs="*", default=[2, 3, 4, 8, 16, 64])
    parser.add_argument("--procs", action="store_true", help="one process per rank")
    parser.add_argument("--bytes", type=int, default=4, help="bytes per rank (one row)")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    setting = "processes" if args.procs else "one loop"
    for n in args.sizes:
        run = _procs if args.procs else _one_loop
        got = asyncio.run(run(n, args.bytes, args.reps))
        print(
            f"{n:5d} ranks ({setting}, {args.bytes} B each): "
            + "  ".join(f"{alg} {got[alg] * 1e6:9.0f} us" for alg in ALGORITHMS),
            flush=True,
        )


if __name__ == "__main__":
    main()
