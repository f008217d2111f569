"""CPU time and wall time per large allreduce, one process per rank.

Run it with the launcher::

    aiocollect run -n 4 scripts/bulk_cpu.py                       # 64 MiB, 12 operations
    aiocollect run -n 4 scripts/bulk_cpu.py --mib 16 --iters 40
    aiocollect run -n 4 scripts/bulk_cpu.py --chunk-bytes 1048576  # force a chunk size
    aiocollect run -n 4 scripts/bulk_cpu.py --transport tcp --mib 16 --iters 20

Each rank runs 5 warm-up allreduces of ``--mib`` MiB (float32) and a barrier, then
``--iters`` back-to-back ones on uvloop, and prints the group's chunk size, its wall time
per operation and its user and system CPU per operation (``getrusage``), with context
switches and minor page faults. With more ranks than cores the sum of the ranks' CPU over
the cores bounds the wall time from below, which makes CPU per operation the steadier
figure on a shared, noisy machine (docs/benchmarks.md, *Fourteenth session*); compare two
trees by interleaving runs (``PYTHONPATH=<tree>``).
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import uvloop

import aiocollect as ac


async def main(
    mib: float, iters: int, chunk: int | None, algorithm: str | None, transport: str
) -> None:
    async with ac.open_group(chunk_bytes=chunk, transport=transport) as group:
        n = group.world_size
        buf = np.ones(max(n, int(mib * (1 << 18)) // n * n), np.float32)
        for _ in range(5):
            buf[...] = 1
            await group.allreduce(buf, algorithm=algorithm)
        await group.barrier()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for _ in range(iters):
            await group.allreduce(buf, algorithm=algorithm)
        t1 = time.perf_counter()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        await group.barrier()
        per = 1e3 / iters
        user = (r1.ru_utime - r0.ru_utime) * per
        sys_ = (r1.ru_stime - r0.ru_stime) * per
        switches = (r1.ru_nvcsw + r1.ru_nivcsw - r0.ru_nvcsw - r0.ru_nivcsw) / iters
        faults = (r1.ru_minflt - r0.ru_minflt) / iters
        print(
            f"rank {group.rank}: {mib:g} MiB allreduce, chunk {group.chunk_bytes}: wall "
            f"{(t1 - t0) * per:.2f} ms, CPU user {user:.2f} sys {sys_:.2f} total "
            f"{user + sys_:.2f} ms per operation, {switches:.1f} context switches, "
            f"{faults:.0f} minor faults",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=64.0)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--chunk-bytes", type=int, default=None)
    parser.add_argument("--algorithm", default=None)
    parser.add_argument("--transport", default="auto")
    ns = parser.parse_args()
    uvloop.run(main(ns.mib, ns.iters, ns.chunk_bytes, ns.algorithm, ns.transport))
