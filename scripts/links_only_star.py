"""A 4-byte star allreduce straight over aiocollect's links: what the op layer costs.

Run it with the launcher (any world size from 2)::

    AIOCOLLECT_TRANSPORT=tcp aiocollect run -n 4 scripts/links_only_star.py
    aiocollect run -n 4 scripts/links_only_star.py --iters 5000

Opens a group as usual, then skips everything above the transport: no operation objects,
no fingerprints registered with the fabric, no deadlines, no checks. Each leaf posts a
receive on its link to rank 0 (``Link.post_recv``) and sends its value (``Link.send``,
one DATA frame under a group id no real operation uses); rank 0 awaits the three frames,
adds them in rank order and sends the sum back. Prints each rank's p50 per operation and
its user and system CPU per operation, as ``scripts/op_latency.py`` (the same operation
through the library) and ``scripts/minimal_exchange.py --star`` (no library at all) do, so
the three side by side split the per-operation cost between the op layer, the links and
the interpreter (docs/benchmarks.md, *Twentieth session*). A yardstick that reaches into
the group's private state; not part of aiocollect.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import uvloop

import aiocollect as ac
from aiocollect._buffers import byte_view
from aiocollect.transport.base import Link
from aiocollect.transport.wire import DATA, HEADER, MAGIC, Key

GID = 0x7FFF_FFFF  # a group id no real operation uses
#: The frames' fingerprint (collective, dtype, elements, reduce op, root), as the header says.
FP = (1, 1, 1, 0, 0)
WARMUP = 300


def header(seq: int, slot: int) -> bytes:
    coll, dtype, count, rop, root = FP
    return HEADER.pack(MAGIC, DATA, coll, rop, dtype, GID, 0, seq, slot, root, count, 4)


async def main(iters: int) -> None:
    async with ac.open_group() as group:
        n, r = group.world_size, group.rank
        links: dict[int, Link] = group._fabric.links  # (a yardstick)
        value = np.ones(1, np.float32)
        got = [np.zeros(1, np.float32) for _ in range(n)]
        views = [byte_view(g) for g in got]
        payload = byte_view(value)

        async def step(seq: int) -> None:
            value[0] = r + 1
            if r == 0:
                futs = [
                    links[q].post_recv(Key(DATA, GID, seq, 0, 0), views[q], FP) for q in range(1, n)
                ]
                for fut in futs:
                    await fut
                for q in range(1, n):
                    np.add(value, got[q], out=value)
                head = header(seq, 1)
                for q in range(1, n):
                    links[q].send(head, payload)
            else:
                fut = links[0].post_recv(Key(DATA, GID, seq, 1, 0), views[0], FP)
                links[0].send(header(seq, 0), payload)
                await fut
                value[:] = got[0]
            assert value[0] == n * (n + 1) / 2, value

        await group.barrier()
        for i in range(WARMUP):
            await step(i)
        lat = np.empty(iters)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        for i in range(iters):
            t = time.perf_counter()
            await step(WARMUP + i)
            lat[i] = time.perf_counter() - t
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        us = 1e6 / iters
        print(
            f"links-only star, rank {r}: p50 {np.median(lat) * 1e6:.1f} us; CPU per op: user "
            f"{(r1.ru_utime - r0.ru_utime) * us:.1f} us, sys {(r1.ru_stime - r0.ru_stime) * us:.1f}"
            " us",
            flush=True,
        )
        await group.barrier()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=3000)
    uvloop.run(main(p.parse_args().iters))
