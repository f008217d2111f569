"""One rank of a job over namespace hosts (:mod:`aiocollect.testing.hosts`), run as
``python -m aiocollect.testing.hosts_rank MODE [ARGS]`` with the group's environment; it
prints one JSON line with its results and exits 0, or fails with a traceback.

Modes:

- ``check [LOOP]``: allreduces of 4 B, 64 KiB and 4 MiB of int64 and float32 data (SUM),
  each alone and three in flight at once, on ``asyncio`` or ``uvloop`` (LOOP). Integer
  results must be exact; every rank reports a digest of each result, which must agree
  on every rank; then a broadcast of 64 KiB from every root and a barrier after each, a
  reduce of 64 KiB (int64) to every root, a reduce_scatter of 1000 int64 per rank, an
  allgather of 1000 int32 per rank and an allgatherv of 0-2 rows of 5 int16 per rank.
  Reports the topology, the algorithm chosen per collective and size, the digests, and
  what ``bytes 16777216 auto`` reports.
- ``bytes SIZE ALGORITHM``: one warm-up, then one allreduce of SIZE bytes of float32
  (``auto`` or a named algorithm) between two barriers; each host's leader reports the
  bytes that left its host's interface meanwhile (``tx_bytes``), the others 0.
- ``cut TIMEOUT``: a group with that timeout (seconds) runs 1 MiB allreduces until one
  fails, printing ``{"event": "ready"}`` after three (with the world ranks it has links
  to), then ``{"event": "error", ...}`` (the exception's type, its cause's, the rank
  blamed, the message, and when) and exits at once (a test cuts a host off meanwhile).
- ``stall SECONDS``: rank 0 sends 32 MiB to rank 1, which first blocks its event loop
  for SECONDS (reading nothing: its receive window closes, its host's kernel still
  answers), then receives it; a barrier; every rank reports how long that took.
- ``opcpu SIZE ALGORITHM ITERS``: ITERS allreduces of SIZE bytes back to back; every
  rank reports one line in ``tools/op_cpu.py``'s form (p50 wall time, CPU per operation),
  which ``tools/alternate.py`` reads.
- ``bench SIZES ALGORITHMS ITERS``: per size (comma separated, bytes) and algorithm
  (comma separated), the median time of ITERS allreduces of float32; rank 0 reports
  them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

import numpy as np

import aiocollect as ac

SIZES = (4, 64 * 1024, 4 * 1024 * 1024)
DTYPES = (np.int64, np.float32)


def _data(n: int, dtype: Any, rank: int, salt: int) -> np.ndarray[Any, Any]:
    base = (np.arange(n) * 7 + salt) % 1013
    if np.dtype(dtype).kind == "f":
        return (base * (rank + 1) / 3.0).astype(dtype)
    return (base * (rank + 1)).astype(dtype)


def _digest(arr: np.ndarray[Any, Any]) -> str:
    return hashlib.sha256(arr.tobytes()).hexdigest()[:16]


async def check(group: ac.Group) -> dict[str, Any]:
    n, r = group.world_size, group.rank
    digests: dict[str, str] = {}
    chosen = {}
    for nbytes in SIZES:
        chosen[str(nbytes)] = group.chosen_algorithm("allreduce", nbytes)
        for dtype in DTYPES:
            count = max(1, nbytes // np.dtype(dtype).itemsize)
            bufs = [_data(count, dtype, r, salt) for salt in range(3)]
            await group.allreduce(bufs[0])
            await asyncio.gather(group.allreduce(bufs[1]), group.allreduce(bufs[2]))
            for salt, buf in enumerate(bufs):
                if np.dtype(dtype).kind == "i":
                    want = sum(_data(count, dtype, k, salt) for k in range(n))
                    np.testing.assert_array_equal(buf, want)
                else:
                    want64 = sum(_data(count, np.float64, k, salt) for k in range(n))
                    np.testing.assert_allclose(buf, want64, rtol=1e-5)
                digests[f"{nbytes}/{np.dtype(dtype).name}/{salt}"] = _digest(buf)
    for root in range(n):
        b = np.full(16 * 1024, r, np.int32)
        await group.broadcast(b, root=root)
        assert (b == root).all(), (root, b[:4])
        await group.barrier()
    for root in range(n):
        c = _data(8 * 1024, np.int64, r, root)
        await group.reduce(c, root=root)
        ranks = range(n) if r == root else [r]  # the root gets the sum, the others theirs
        np.testing.assert_array_equal(c, sum(_data(8 * 1024, np.int64, k, root) for k in ranks))
    scattered = await group.reduce_scatter(np.arange(1000 * n, dtype=np.int64) * (r + 1))
    whole = np.arange(1000 * n) * (n * (n + 1) // 2)
    np.testing.assert_array_equal(scattered, whole[r * 1000 : (r + 1) * 1000])
    gathered = await group.allgather(np.arange(1000, dtype=np.int32) + r)
    np.testing.assert_array_equal(gathered, np.arange(1000) + np.arange(n)[:, None])
    rows = await group.allgatherv(np.full((r % 3, 5), r, np.int16))  # some send no rows
    for k, got in enumerate(rows):
        np.testing.assert_array_equal(got, np.full((k % 3, 5), k))
    chosen["allgatherv"] = group.chosen_algorithm("allgatherv", 0)
    chosen["broadcast"] = group.chosen_algorithm("broadcast", 64 * 1024)
    chosen["reduce"] = group.chosen_algorithm("reduce", 64 * 1024)
    chosen["allgather"] = group.chosen_algorithm("allgather", 4000 * n)
    chosen["reduce_scatter"] = group.chosen_algorithm("reduce_scatter", 8000 * n)
    chosen["barrier"] = group.chosen_algorithm("barrier", 0)
    stats = group.statistics()
    counted = await count_bytes(group, 16 * 1024 * 1024, "auto")
    return {
        **counted,
        "rank": r,
        "topology": stats.topology,
        "chosen": chosen,
        "digests": digests,
        "cross_host_bytes": stats.cross_host.bytes_sent,
        "same_host_bytes": stats.same_host.bytes_sent,
    }


def _tx_bytes() -> int:
    ifname = os.environ["AIOCOLLECT_IFNAME"]
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
        return int(f.read())


async def count_bytes(group: ac.Group, nbytes: int, algorithm: str) -> dict[str, Any]:
    buf = np.ones(nbytes // 4, np.float32)
    alg = None if algorithm == "auto" else algorithm
    await group.allreduce(buf, algorithm=alg)
    await group.barrier()
    leader = group.statistics().topology["local_rank"] == 0
    before = _tx_bytes() if leader else 0
    await group.allreduce(buf, algorithm=alg)
    await group.barrier()
    after = _tx_bytes() if leader else 0
    return {
        "rank": group.rank,
        "tx_bytes": after - before,
        "algorithm": group.chosen_algorithm("allreduce", nbytes) if alg is None else alg,
    }


async def bench(
    group: ac.Group, sizes: list[int], algorithms: list[str], iters: int
) -> dict[str, Any]:
    out: dict[str, dict[str, float]] = {}
    for nbytes in sizes:
        buf = np.ones(max(1, nbytes // 4), np.float32)
        row = out.setdefault(str(nbytes), {})
        for algorithm in algorithms:
            alg = None if algorithm == "auto" else algorithm
            await group.allreduce(buf, algorithm=alg)
            times = []
            for _ in range(iters):
                await group.barrier()
                t0 = time.perf_counter()
                await group.allreduce(buf, algorithm=alg)
                times.append(time.perf_counter() - t0)
            name = group.chosen_algorithm("allreduce", nbytes) if alg is None else alg
            row[f"{algorithm} ({name})"] = statistics.median(times)
    return {"rank": group.rank, "median_s": out}


async def op_cpu(group: ac.Group, nbytes: int, algorithm: str, iters: int) -> dict[str, Any]:
    """``iters`` allreduces of ``nbytes`` of float32 back to back (after ``iters // 10 + 1``
    warm-up ones and a barrier): this rank's p50 wall time and CPU per operation, in µs, as
    ``tools/op_cpu.py`` prints them."""
    buf = np.ones(max(1, nbytes // 4), np.float32)
    alg = None if algorithm == "auto" else algorithm
    for _ in range(iters // 10 + 1):
        await group.allreduce(buf, algorithm=alg)
    await group.barrier()
    lat = []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(iters):
        t0 = time.perf_counter()
        await group.allreduce(buf, algorithm=alg)
        lat.append(time.perf_counter() - t0)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    await group.barrier()
    us = 1e6 / iters
    line = (
        f"rank {group.rank} allreduce {nbytes} B {algorithm} "
        f"({group.chosen_algorithm('allreduce', nbytes) if alg is None else alg}): "
        f"p50 {statistics.median(lat) * 1e6:.1f}; CPU per op: user "
        f"{(r1.ru_utime - r0.ru_utime) * us:.1f} us, sys {(r1.ru_stime - r0.ru_stime) * us:.1f} us"
    )
    return {"rank": group.rank, "line": line}


async def cut(timeout: float) -> None:
    group = await ac.open_group(timeout=timeout)
    buf = np.ones(256 * 1024, np.float32)
    done = 0
    try:
        while True:
            await group.allreduce(buf)
            done += 1
            if done == 3:
                linked = sorted(group._fabric.links)
                ready = {"event": "ready", "rank": group.rank, "links": linked}
                print(json.dumps(ready), flush=True)
    except ac.AiocollectError as exc:
        cause = exc.__cause__ if isinstance(exc, ac.GroupBrokenError) else None
        blamed = cause if cause is not None else exc
        error = {
            "event": "error",
            "rank": group.rank,
            "type": type(exc).__name__,
            "cause": type(cause).__name__ if cause else None,
            "peer": getattr(blamed, "rank", None),
            "message": str(blamed),
            "at": time.time(),
        }
        print(json.dumps(error), flush=True)
    group.abort()
    os._exit(0)  # the store's host may be cut off: nothing to wait for


async def stall(group: ac.Group, seconds: float) -> dict[str, Any]:
    buf = np.ones(8 << 20, np.float32)
    start = time.monotonic()
    if group.rank == 0:
        await group.send(buf, 1)
    elif group.rank == 1:
        time.sleep(seconds)  # noqa: ASYNC251 (blocks the loop on purpose: nothing is read)
        await group.recv(buf, 0)
    await group.barrier()
    return {"rank": group.rank, "took": time.monotonic() - start}


async def main(argv: list[str]) -> dict[str, Any]:
    mode = argv[0]
    if mode == "cut":
        await cut(float(argv[1]))
    async with ac.open_group(timeout=60.0) as group:
        if mode == "check":
            return await check(group)
        if mode == "bytes":
            return await count_bytes(group, int(argv[1]), argv[2])
        if mode == "stall":
            return await stall(group, float(argv[1]))
        if mode == "opcpu":
            return await op_cpu(group, int(argv[1]), argv[2], int(argv[3]))
        if mode == "bench":
            sizes = [int(s) for s in argv[1].split(",")]
            return await bench(group, sizes, argv[2].split(","), int(argv[3]))
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["check"] and args[1:2] == ["uvloop"]:
        import uvloop

        result = uvloop.run(main(args))
    else:
        result = asyncio.run(main(args))
    print(json.dumps(result), flush=True)
