"""CPU time per small allreduce: two ranks in this process, so ``time.process_time()``
counts the work of both and not the time other processes take from them (a busy shared
machine swings wall-clock figures by tens of percent; this one much less).

Usage::

    python scripts/op_cpu_time.py tcp        # or auto, shm, memory
    python scripts/op_cpu_time.py tcp --iters 2000 --repeat 3
    python scripts/op_cpu_time.py tcp --uvloop --case barrier   # or broadcast

Prints the best of ``--repeat`` runs: CPU microseconds per 4-byte allreduce (both ranks
together), after 200 warm-up operations. docs/benchmarks.md, "Refactor check (issue 16)",
compares two trees with it (run it with each tree first on PYTHONPATH). Both ranks share
one loop, so a change in when frames are sent shows differently here than between two
processes (docs/benchmarks.md, "Twelfth session": use ``scripts/op_latency.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.store import MemoryStore

_names = itertools.count()


async def _cpu_per_op(transport: str, iters: int, case: str = "allreduce") -> float:
    """CPU seconds per operation: both ranks time the same ``iters`` allreduces, and both
    run in this process, so each one's span of process time counts the work of both."""
    name = f"cpu-{next(_names)}"

    async def one(rank: int) -> float:
        async with ac.open_group(
            rank, 2, store=MemoryStore(name), transport=transport, name=name
        ) as group:
            buf = np.zeros(1, np.float32)

            def call() -> Awaitable[Any]:
                if case == "broadcast":
                    return group.broadcast(buf)
                if case == "barrier":
                    return group.barrier()
                return group.allreduce(buf)

            for _ in range(200):
                await call()
            start = time.process_time()
            for _ in range(iters):
                await call()
            return time.process_time() - start

    return max(await asyncio.gather(one(0), one(1))) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("transport")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--case", choices=("allreduce", "broadcast", "barrier"), default="allreduce"
    )
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop (default: asyncio)")
    ns = parser.parse_args()
    run: Callable[[Coroutine[Any, Any, float]], float] = asyncio.run
    if ns.uvloop:
        import uvloop

        run = uvloop.run
    best = min(run(_cpu_per_op(ns.transport, ns.iters, ns.case)) for _ in range(ns.repeat))
    what = "4-byte " + ns.case if ns.case != "barrier" else "barrier"
    print(f"{ns.transport}: {best * 1e6:.1f} us CPU per {what} (2 ranks, one process)")


if __name__ == "__main__":
    main()
