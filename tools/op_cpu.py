"""Wall time and CPU time per operation on each rank, one process per rank.

Run it with the launcher::

    aiocollect run -n 2 tools/op_cpu.py                           # 4-byte allreduce
    AIOCOLLECT_TRANSPORT=tcp aiocollect run -n 4 tools/op_cpu.py --case barrier
    aiocollect run -n 4 tools/op_cpu.py --size 64M                 # bulk: 64 MiB, 12 ops
    aiocollect run -n 4 tools/op_cpu.py --size 16M --chunk-bytes 1M --algorithm ring
    aiocollect run -n 2 tools/op_cpu.py --size 64M --lag           # and the loop's lag
    aiocollect run -n 2 tools/op_cpu.py --case sendrecv --size 1K  # a send/recv round trip

Each rank runs ``--warmup`` operations and a barrier, then ``--iters`` back to back (on
uvloop unless ``--asyncio``), and prints one line: the group's chunk size, the mean, p50
and p99 of its per-operation wall time, its user and system CPU per operation
(``getrusage``), its context switches and minor page faults per operation. Nothing else
runs per operation but one clock read, so it isolates the per-operation path; the ranks
are real processes, so a frame arrives when the peer's process sends it.

With more ranks than cores the sum of the ranks' CPU over the cores bounds the wall time
from below, which makes CPU per operation the steadier figure on a shared machine. Compare
two trees by alternating runs (``PYTHONPATH=<tree>``; ``tools/alternate.py`` reads these
lines).

``--lag``: rank 0 also runs a task that sleeps 1 ms in a loop (as ``aiocollect bench``'s
lag probe does) and prints the lag's p50 and p99 and, for every sample more than 1.5 ms
late, its lag and the loop thread's CPU time during it (``time.thread_time``): CPU about
the wall time means the loop was busy (callbacks or system calls held it), well below it
that the process was waiting for a core.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.bench.spec import parse_size

#: Sizes from which the defaults of ``--iters`` and ``--warmup`` are those of bulk.
BULK = 1 << 20
#: The lag probe's sleep, and the lateness from which a sample is listed.
PERIOD = 0.001
LATE = 0.0015


async def _probe(out: list[tuple[float, float]]) -> None:
    while True:
        wall, cpu = time.perf_counter(), time.thread_time()
        await asyncio.sleep(PERIOD)
        out.append((time.perf_counter() - wall - PERIOD, time.thread_time() - cpu))


def _lag_line(samples: list[tuple[float, float]]) -> str:
    if not samples:
        return "lag: no samples"
    s = np.array(samples) * 1e3
    lag, cpu = s[:, 0], s[:, 1]
    late = lag > LATE * 1e3
    return (
        f"lag: {len(s)} samples, p50 {np.median(lag):.2f} ms, p99 "
        f"{np.percentile(lag, 99):.2f} ms; {int(late.sum())} over {LATE * 1e3:g} ms "
        "(lag / loop-thread CPU, ms): "
        + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(lag[late], cpu[late], strict=True))
    )


async def main(ns: argparse.Namespace) -> None:
    nbytes = parse_size(ns.size)
    bulk = nbytes >= BULK
    iters = ns.iters or (12 if bulk else 5000)
    warmup = ns.warmup if ns.warmup is not None else (5 if bulk else 300)
    chunk = None if ns.chunk_bytes is None else parse_size(ns.chunk_bytes)
    async with ac.open_group(transport=ns.transport, chunk_bytes=chunk) as group:
        n = group.world_size
        count = max(1, nbytes // 4)
        if bulk:  # (a multiple of the world size: every rank's block alike)
            count = max(n, count // n * n)
        buf = np.zeros(count, np.float32)
        alg = ns.algorithm
        peer = group.rank ^ 1
        if ns.case == "sendrecv" and n % 2:
            raise SystemExit("--case sendrecv pairs the ranks: run an even number")

        async def round_trip() -> None:
            if group.rank % 2 == 0:
                await group.send(buf, peer)
                await group.recv(buf, peer)
            else:
                await group.recv(buf, peer)
                await group.send(buf, peer)

        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "allreduce": lambda: group.allreduce(buf, algorithm=alg),
            "broadcast": lambda: group.broadcast(buf),
            "barrier": lambda: group.barrier(algorithm=alg),
            "sendrecv": round_trip,
        }
        call = calls[ns.case]
        for _ in range(warmup):
            await call()
        await group.barrier()
        samples: list[tuple[float, float]] = []
        loop = asyncio.get_running_loop()
        probe = loop.create_task(_probe(samples)) if ns.lag and group.rank == 0 else None
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
        if probe is not None:
            probe.cancel()
        await group.barrier()
        us = 1e6 / iters
        what = "" if ns.case == "barrier" else f" {count * 4} B"
        line = (
            f"rank {group.rank} {ns.case}{what}, chunk {group.chunk_bytes}: mean "
            f"{wall * us:.1f} us, p50 {np.median(lat) * 1e6:.1f}, p99 "
            f"{np.percentile(lat, 99) * 1e6:.1f}; CPU per op: user "
            f"{(r1.ru_utime - r0.ru_utime) * us:.1f} us, sys "
            f"{(r1.ru_stime - r0.ru_stime) * us:.1f} us; context switches per op: "
            f"{(r1.ru_nvcsw - r0.ru_nvcsw) / iters:.2f} voluntary, "
            f"{(r1.ru_nivcsw - r0.ru_nivcsw) / iters:.2f} involuntary; minor faults per op: "
            f"{(r1.ru_minflt - r0.ru_minflt) / iters:.0f}"
        )
        if probe is not None:
            line += "\n" + _lag_line(samples)
        print(line, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiocollect run -n N tools/op_cpu.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--case", choices=("allreduce", "broadcast", "barrier", "sendrecv"), default="allreduce"
    )
    parser.add_argument("--size", default="4", help="bytes (float32), e.g. 4, 4K, 64M (default 4)")
    parser.add_argument(
        "--iters", type=int, help=f"timed operations (default 5000; 12 from {BULK >> 20} MiB)"
    )
    parser.add_argument(
        "--warmup", type=int, help=f"operations first (default 300; 5 from {BULK >> 20} MiB)"
    )
    parser.add_argument(
        "--algorithm", default=None, help="allreduce's or barrier's algorithm (default: auto)"
    )
    parser.add_argument("--chunk-bytes", help="the group's chunk size, e.g. 1M (default: chosen)")
    parser.add_argument(
        "--transport", help="auto, tcp, shm, ... (default: AIOCOLLECT_TRANSPORT, else auto)"
    )
    parser.add_argument("--lag", action="store_true", help="probe rank 0's event-loop lag")
    parser.add_argument("--asyncio", action="store_true", help="run on asyncio, not uvloop")
    return parser


if __name__ == "__main__":
    args = _parser().parse_args()
    if args.asyncio:
        asyncio.run(main(args))
    else:
        import uvloop

        uvloop.run(main(args))
