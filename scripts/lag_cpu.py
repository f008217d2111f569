"""Event-loop lag during back-to-back allreduces, with the loop thread's CPU time in each
late sample: was a late wake-up the loop being busy (CPU about the wall time: our own
callbacks or system calls held it) or the process waiting for a core (CPU well below)?

Run it with the launcher::

    aiocollect run -n 2 scripts/lag_cpu.py --transport tcp          # 64 MiB, 40 operations
    aiocollect run -n 2 scripts/lag_cpu.py --transport auto --mib 16 --iters 100

Rank 0 runs a task that sleeps 1 ms in a loop (as ``aiocollect bench``'s lag probe does)
while every rank runs ``--iters`` allreduces of ``--mib`` MiB (float32) on uvloop, and
prints the time per operation, the lag's p50 and p99 over all samples, and for every
sample more than 1.5 ms late its lag and the loop thread's CPU time during it
(``time.thread_time``). Compare trees by interleaving runs (``PYTHONPATH=<tree>``);
docs/benchmarks.md, *Seventeenth session*.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import uvloop

import aiocollect as ac

#: The probe's sleep, and the lateness from which a sample is listed.
PERIOD = 0.001
LATE = 0.0015


async def _probe(out: list[tuple[float, float]]) -> None:
    while True:
        wall, cpu = time.perf_counter(), time.thread_time()
        await asyncio.sleep(PERIOD)
        out.append((time.perf_counter() - wall - PERIOD, time.thread_time() - cpu))


async def main(transport: str, mib: float, iters: int) -> None:
    async with ac.open_group(transport=transport) as group:
        buf = np.ones(max(1, int(mib * (1 << 18))), np.float32)
        for _ in range(3):
            await group.allreduce(buf)
        await group.barrier()
        samples: list[tuple[float, float]] = []
        probe = asyncio.get_running_loop().create_task(_probe(samples)) if group.rank == 0 else None
        t0 = time.perf_counter()
        for _ in range(iters):
            await group.allreduce(buf)
        per = (time.perf_counter() - t0) / iters * 1e3
        if probe is not None:
            probe.cancel()
            s = np.array(samples) * 1e3
            lag, cpu = s[:, 0], s[:, 1]
            late = lag > LATE * 1e3
            print(
                f"{transport} {mib:g} MiB: {per:.1f} ms per operation; {len(s)} samples, lag "
                f"p50 {np.median(lag):.2f} ms, p99 {np.percentile(lag, 99):.2f} ms; "
                f"{int(late.sum())} over {LATE * 1e3:g} ms (lag / loop-thread CPU, ms): "
                + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(lag[late], cpu[late], strict=True)),
                flush=True,
            )
        await group.barrier()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--mib", type=float, default=64.0)
    parser.add_argument("--iters", type=int, default=40)
    ns = parser.parse_args()
    uvloop.run(main(ns.transport, ns.mib, ns.iters))
