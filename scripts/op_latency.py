"""Back-to-back latency and CPU per small operation, one process per rank.

Run it with the launcher::

    aiocollect run -n 2 scripts/op_latency.py                 # 4-byte allreduce
    AIOCOLLECT_TRANSPORT=tcp aiocollect run -n 2 scripts/op_latency.py --case barrier
    AIOCOLLECT_SPIN_US=0 aiocollect run -n 2 scripts/op_latency.py --iters 5000

Each rank runs ``--iters`` operations one after the other on uvloop (after 300 warm-up
ones and a barrier) and prints the mean, p50 and p99 of its per-operation wall time and
its user and system CPU per operation (``getrusage``). Unlike ``aiocollect bench`` there
is no lag probe, no baseline and no per-iteration bookkeeping beyond one clock read, so
it isolates the per-operation path; unlike ``scripts/op_cpu_time.py`` (both ranks in one
process, one loop) the ranks are real processes, so a frame arrives when the peer's
process sends it (docs/benchmarks.md, *Twelfth session*). The machine is shared and
noisy: compare two trees by interleaving runs (``PYTHONPATH=<tree>``).
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import uvloop

import aiocollect as ac


async def main(iters: int, case: str, algorithm: str | None, count: int) -> None:
    async with ac.open_group() as group:
        buf = np.zeros(count, np.float32)
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "allreduce": lambda: group.allreduce(buf, algorithm=algorithm),
            "broadcast": lambda: group.broadcast(buf),
            "barrier": lambda: group.barrier(algorithm=algorithm),
        }
        call = calls[case]
        for _ in range(300):
            await call()
        await group.barrier()
        lat = np.empty(iters)
        clock = time.perf_counter
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = clock()
        for i in range(iters):
            t = clock()
            await call()
            lat[i] = clock() - t
        wall = clock() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        us = 1e6 / iters
        print(
            f"rank {group.rank} {case}: mean {wall * us:.1f} us, p50 "
            f"{np.median(lat) * 1e6:.1f}, p99 {np.percentile(lat, 99) * 1e6:.1f}; CPU per op: "
            f"user {(r1.ru_utime - r0.ru_utime) * us:.1f} us, sys "
            f"{(r1.ru_stime - r0.ru_stime) * us:.1f} us; context switches per op: "
            f"{(r1.ru_nvcsw - r0.ru_nvcsw) / iters:.2f} voluntary, "
            f"{(r1.ru_nivcsw - r0.ru_nivcsw) / iters:.2f} involuntary",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument(
        "--case", choices=("allreduce", "broadcast", "barrier"), default="allreduce"
    )
    parser.add_argument(
        "--algorithm", default=None, help="allreduce's or barrier's algorithm (default: auto)"
    )
    parser.add_argument("--count", type=int, default=1, help="float32 elements (default 1)")
    ns = parser.parse_args()
    uvloop.run(main(ns.iters, ns.case, ns.algorithm, ns.count))
