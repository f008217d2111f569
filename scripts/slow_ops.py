"""Hunt for stalls: every operation of a mix, timed one by one, and the slow ones listed.

Run it with the launcher, on the transport to probe::

    aiocollect run -n 2 scripts/slow_ops.py                       # 8 MiB, 150 rounds, auto
    aiocollect run -n 3 scripts/slow_ops.py --size 1 --rounds 100
    AIOCOLLECT_TRANSPORT=tcp aiocollect run -n 2 scripts/slow_ops.py --threshold 0.1

Each round runs allreduce, broadcast, allgather, reduce_scatter and a ring of send/recv
on buffers of ``--size`` MiB (float32), one after the other, on uvloop; each rank prints
its slowest time per operation and every operation that took longer than
``--threshold`` seconds. A healthy run of the defaults on the development machine lists
none (the slowest 8 MiB operation takes tens of milliseconds); a lost wake-up shows as
operations of about a second, the age at which the group's mismatch check sends a frame
on the link and so wakes it (docs/benchmarks.md, *A stall over shared memory*). It is a
probe for long runs, not a test: it asserts nothing and its threshold is a wall-clock
time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import uvloop

import aiocollect as ac


async def main(mib: float, rounds: int, threshold: float) -> None:
    async with ac.open_group() as group:
        n, rank = group.world_size, group.rank
        count = max(n, int(mib * (1 << 18)) // n * n)
        buf = np.ones(count, np.float32)
        gathered = np.empty((n, count), np.float32)
        block = np.empty(count // n, np.float32)
        incoming = np.empty(count, np.float32)

        async def sendrecv() -> None:
            sent = group.send(buf, (rank + 1) % n, tag=1)
            await group.recv(incoming, (rank - 1) % n, tag=1)
            await sent

        ops: dict[str, Callable[[], Awaitable[Any]]] = {
            "allreduce": lambda: group.allreduce(buf),
            "broadcast": lambda: group.broadcast(buf, root=0),
            "allgather": lambda: group.allgather(buf, gathered),
            "reduce_scatter": lambda: group.reduce_scatter(buf, block),
            "send/recv": sendrecv,
        }
        slowest = dict.fromkeys(ops, 0.0)
        slow: list[tuple[int, str, float]] = []
        clock = time.perf_counter
        for i in range(rounds):
            for name, call in ops.items():
                buf[...] = 1  # (the allreduce doubles it otherwise)
                t = clock()
                await call()
                took = clock() - t
                slowest[name] = max(slowest[name], took)
                if took > threshold:
                    slow.append((i, name, took))
        worst = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in slowest.items())
        listed = ", ".join(f"round {i} {k} {t:.2f} s" for i, k, t in slow) or "none"
        print(
            f"rank {rank} of {n}, {mib:g} MiB x {rounds} rounds: slowest (ms) {worst}; "
            f"over {threshold:g} s: {listed}",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=8.0, help="MiB per buffer")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--threshold", type=float, default=0.3, help="seconds")
    ns = parser.parse_args()
    uvloop.run(main(ns.size, ns.rounds, ns.threshold))
