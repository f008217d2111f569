"""Where a slow head-of-line round trip loses its time: each hop timed on its own.

Run it with the launcher (any world size from 2)::

    aiocollect run -n 4 scripts/hol_oneway.py
    aiocollect run -n 4 scripts/hol_oneway.py --mib 64 --allreduces 6 --slow-ms 3

Every rank runs ``--allreduces`` back-to-back allreduces of ``--mib`` MiB (float32, the
group's default transport); meanwhile rank 0 sends rank 1 a 1 KiB message stamped with
``time.perf_counter()`` (CLOCK_MONOTONIC, the same clock in every process on a host) and
rank 1 stamps it again on arrival and before echoing it. For every round trip slower than
``--slow-ms``, rank 0 prints the hop from 0 to 1, the time inside rank 1 and the hop back,
and the time since the first allreduce began. docs/benchmarks.md (*Twentieth session*)
uses it: at four ranks on two cores the slow hops cluster at one scheduler tick.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import uvloop

import aiocollect as ac

TAG = 7


async def main(mib: float, allreduces: int, slow_ms: float) -> None:
    async with ac.open_group() as group:
        data = np.ones(max(group.world_size, int(mib * (1 << 18))), np.float32)
        await group.allreduce(data)
        await group.barrier()
        began = time.perf_counter()

        async def bulk() -> None:
            for _ in range(allreduces):
                await group.allreduce(data)

        task = asyncio.ensure_future(bulk())
        if group.rank == 0:
            msg = np.zeros(128, np.float64)  # [stop, sent, arrived at 1, echoed by 1]
            back = np.empty_like(msg)
            trips: list[tuple[float, float, float, float]] = []
            while not task.done():
                msg[1] = time.perf_counter()
                await group.send(msg, 1, tag=TAG)
                await group.recv(back, 1, tag=TAG)
                trips.append((back[1], back[2], back[3], time.perf_counter()))
            msg[0] = -1
            await group.send(msg, 1, tag=TAG)
            slow = [t for t in trips if t[3] - t[0] > slow_ms * 1e-3]
            for t0, t1, t2, t3 in slow:
                print(
                    f"round trip {(t3 - t0) * 1e3:.2f} ms at {(t0 - began) * 1e3:.1f} ms: "
                    f"0->1 {(t1 - t0) * 1e3:.2f}, in 1 {(t2 - t1) * 1e3:.2f}, "
                    f"1->0 {(t3 - t2) * 1e3:.2f} ms"
                )
            hops = np.array([(t1 - t0, t2 - t1, t3 - t2) for t0, t1, t2, t3 in trips]) * 1e3
            p50 = np.median(hops, axis=0) if len(trips) else np.full(3, np.nan)
            print(
                f"{len(trips)} round trips, {len(slow)} over {slow_ms:g} ms; median hops: "
                f"0->1 {p50[0]:.3f}, in 1 {p50[1]:.3f}, 1->0 {p50[2]:.3f} ms",
                flush=True,
            )
        elif group.rank == 1:
            msg = np.empty(128, np.float64)
            while True:
                await group.recv(msg, 0, tag=TAG)
                msg[2] = time.perf_counter()
                if msg[0] == -1:
                    break
                msg[3] = time.perf_counter()
                await group.send(msg, 0, tag=TAG)
        await task
        await group.barrier()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=64.0)
    p.add_argument("--allreduces", type=int, default=6)
    p.add_argument("--slow-ms", type=float, default=3.0)
    ns = p.parse_args()
    uvloop.run(main(ns.mib, ns.allreduces, ns.slow_ms))
