"""Allreduce timing over shm and tcp (not a test: ``python -m tests.support.timing``).

Prints, per world size, transport and size: the lowest per-batch median time per allreduce
(the latency figure), the median over batches of the mean time per allreduce (slowest rank)
and the bus bandwidth 2(n-1)/n * bytes / mean, also for the best batch (the machine is
shared, so the best batch is the closest to a quiet machine). Ranks are spawned processes
on uvloop, float32, with a barrier before each batch.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.testing import spawn_ranks


async def measure(
    g: ac.Group, sizes: list[int], seconds: float, algorithm: str | None, batches: int
) -> list[tuple[int, float, float, float]]:
    out = []
    for size in sizes:
        buf = np.zeros(max(1, size // 4), np.float32)
        for _ in range(3):
            await g.allreduce(buf, algorithm=algorithm)
        # agree on an iteration count from rank 0's estimate
        t0 = time.perf_counter()
        await g.allreduce(buf, algorithm=algorithm)
        est = np.array([max(3, min(2000, int(seconds / max(1e-6, time.perf_counter() - t0))))])
        await g.broadcast(est, root=0)
        iters = int(est[0])
        p50s, means = [], []
        for _ in range(batches):  # the machine is shared: keep the best batch too
            times = []
            await g.barrier()
            for _ in range(iters):
                t = time.perf_counter()
                await g.allreduce(buf, algorithm=algorithm)
                times.append(time.perf_counter() - t)
            total = np.array([sum(times)])
            await g.allreduce(total, op=ac.MAX)
            p50s.append(statistics.median(times))
            means.append(float(total[0]) / iters)
        out.append((size, min(p50s), statistics.median(means), min(means)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, nargs="+", default=[2, 4])
    p.add_argument("--transport", nargs="+", default=["shm", "tcp"])
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 16 << 20, 64 << 20])
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--algorithm")
    p.add_argument("--batches", type=int, default=5, help="timed batches per size")
    p.add_argument("--asyncio", action="store_true", help="default loop instead of uvloop")
    args = p.parse_args()

    async def run() -> None:
        for n in args.n:
            for transport in args.transport:
                res: Any = await spawn_ranks(
                    n,
                    measure,
                    args.sizes,
                    args.seconds,
                    args.algorithm,
                    args.batches,
                    transport=transport,
                    uvloop=not args.asyncio,
                    timeout=1200,
                )
                for size, p50, mean, best in res[0]:
                    factor = 2 * (n - 1) / n * size / 1e9
                    print(
                        f"n={n} {transport:4} size={size:>9} best-p50={p50 * 1e6:9.1f}us "
                        f"mean={mean * 1e6:9.1f}us busbw={factor / mean:6.3f} GB/s "
                        f"(best batch {factor / best:6.3f})",
                        flush=True,
                    )

    asyncio.run(run())


if __name__ == "__main__":
    main()
