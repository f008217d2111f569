"""Floors: what this host's processes achieve with no framework at all.

``python -m aiocollect.bench.floor bandwidth -n 2 --sizes 16M,64M`` and
``python -m aiocollect.bench.floor latency -n 2`` measure the same data flows as aiocollect's
shared-memory allreduce, written as plain blocking code with no event loop, frames, mailbox
or checks, so the gap between ``aiocollect bench`` and these numbers is what the library
costs, and the gap between these numbers and a speed target says whether any design of
that data flow can reach the target on this machine (docs/shm.md, *Against the targets*).

- ``bandwidth``: an allreduce of N float32 arrays, direct reduce-scatter then allgather.
  Rank r pulls block r of every peer's array with ``process_vm_readv`` in ``--chunk``
  pieces into a small buffer and adds each into its own block (numpy), a barrier, then
  pulls every other block straight from its owner into place, a barrier. That is what a
  ring moves per rank (2 (N-1)/N of the data, one copy each, (N-1)/N reduced) with the
  fewest copies and no pipelining overhead. Prints the median time of the slowest rank and
  the NCCL-tests bus bandwidth, as ``aiocollect bench`` does.
- ``latency``: a 4-byte float32 allreduce by recursive doubling over blocking Unix socket
  pairs (N a power of two), numpy adds. Prints the median time per allreduce (slowest
  rank).

Every rank checks its result against the closed form; a wrong one fails the run (exit 1).
Rank processes are forked; they exit with the run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
from collections.abc import Sequence
from multiprocessing.synchronize import Barrier
from typing import Any

import numpy as np

from aiocollect._buffers import byte_view
from aiocollect.bench.spec import parse_size, parse_sizes
from aiocollect.transport import cma

_CTX = mp.get_context("fork")
#: A rank waiting longer than this at a barrier gives up (exits non-zero).
BARRIER_SECONDS = 60.0


def _pull_worker(
    rank: int, n: int, nbytes: int, chunk: int, iters: int, table: Any, bar: Barrier, out: Any
) -> None:
    count = nbytes // 4
    own = np.full(count, rank + 1, np.float32)
    scratch = np.empty(max(1, chunk // 4), np.float32)
    table[2 * rank], table[2 * rank + 1] = os.getpid(), own.ctypes.data
    bar.wait(BARRIER_SECONDS)
    peers = [(int(table[2 * p]), int(table[2 * p + 1])) for p in range(n)]
    blk = count // n
    view = byte_view(own)
    sview = byte_view(scratch)
    times = []
    # The sums are checked against the closed form afterwards; a pull that copied garbage
    # must give a wrong result, not a floating-point warning (an error where warnings are).
    np.seterr(all="ignore")
    for _ in range(iters):
        own[...] = rank + 1
        bar.wait(BARRIER_SECONDS)
        start = time.perf_counter()
        lo = rank * blk
        for step in range(1, n):
            pid, base = peers[(rank + step) % n]
            off = lo
            while off < lo + blk:
                m = min(scratch.size, lo + blk - off)
                cma.pull(pid, sview[: m * 4], base + off * 4)
                np.add(own[off : off + m], scratch[:m], out=own[off : off + m])
                off += m
        bar.wait(BARRIER_SECONDS)
        for step in range(1, n):
            q = (rank + step) % n
            pid, base = peers[q]
            cma.pull(pid, view[q * blk * 4 : (q + 1) * blk * 4], base + q * blk * 4)
        bar.wait(BARRIER_SECONDS)
        times.append(time.perf_counter() - start)
    ok = bool((own[: blk * n] == n * (n + 1) / 2).all())
    out.put((rank, float(np.median(times)), ok))


def _run(target: Any, n: int, args: tuple[Any, ...]) -> float:
    """Start ``n`` forked ranks of ``target``; the slowest rank's median seconds.

    Raises:
        RuntimeError: a rank failed or computed a wrong result."""
    out = _CTX.Queue()
    procs = [_CTX.Process(target=target, args=(r, n, *args, out), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    results: list[tuple[int, float, bool]] = []
    try:
        while len(results) < n:
            try:
                results.append(out.get(timeout=0.5))
            except queue.Empty:
                # a rank that died without a result leaves the others at a barrier
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(
                        f"a rank failed: exit codes {[p.exitcode for p in procs]}"
                    ) from None
    finally:
        for p in procs:
            if len(results) < n:
                p.kill()  # the run failed: the others would wait at a barrier
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    wrong = sorted(r for r, _, ok in results if not ok)
    if wrong:
        raise RuntimeError(f"wrong result on rank(s) {wrong}")
    return float(max(t for _, t, _ in results))


def bandwidth(n: int, nbytes: int, chunk: int = 1 << 20, iters: int = 15) -> float:
    """Seconds per allreduce of ``nbytes`` (float32) among ``n`` ranks (the slowest rank's
    median), by the pull-and-add data flow above.

    Raises:
        ValueError: ``nbytes`` is not a positive multiple of ``4 * n``, or ``n < 2``.
        OSError: this host cannot use process_vm_readv (no Linux, or forbidden).
        RuntimeError: a rank failed or computed a wrong result."""
    if n < 2 or nbytes <= 0 or nbytes % (4 * n):
        raise ValueError(f"need 2+ ranks and a size that is a multiple of {4 * n} bytes")
    reason = cma.self_check()
    if reason is not None:
        raise OSError(reason)
    table = _CTX.Array("Q", 2 * n, lock=False)
    bar = _CTX.Barrier(n)
    return _run(_pull_worker, n, (nbytes, chunk, iters, table, bar))


def _doubling_worker(
    rank: int, n: int, socks: dict[tuple[int, int], socket.socket], iters: int, out: Any
) -> None:
    val = np.ones(1, np.float32)
    raw = bytearray(4)
    got = np.frombuffer(raw, np.float32)
    times = []
    ok = True
    for i in range(iters + iters // 10):
        start = time.perf_counter()
        mask = 1
        while mask < n:
            sock = socks[(rank, rank ^ mask)]
            sock.sendall(val.tobytes())
            sock.recv_into(raw, 4, socket.MSG_WAITALL)
            val += got
            mask <<= 1
        ok = ok and bool(val[0] == n)
        val[0] = 1
        if i >= iters // 10:  # the first tenth warms up
            times.append(time.perf_counter() - start)
    out.put((rank, float(np.median(times)), ok))


def latency(n: int, iters: int = 3000) -> float:
    """Seconds per 4-byte allreduce among ``n`` ranks (a power of two; the slowest rank's
    median), by recursive doubling over blocking socket pairs.

    Raises:
        ValueError: ``n`` is not a power of two of at least 2.
        RuntimeError: a rank failed or computed a wrong result."""
    if n < 2 or n & (n - 1):
        raise ValueError("recursive doubling needs a power-of-two number of ranks")
    socks: dict[tuple[int, int], socket.socket] = {}
    for r in range(n):
        mask = 1
        while mask < n:
            p = r ^ mask
            if r < p:
                socks[(r, p)], socks[(p, r)] = socket.socketpair()
            mask <<= 1
    try:
        return _run(_doubling_worker, n, (socks, iters))
    finally:
        for s in socks.values():
            s.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aiocollect.bench.floor",
        description=__doc__.split("\n\n")[0] if __doc__ else "",
    )
    sub = parser.add_subparsers(dest="what", required=True)
    bw = sub.add_parser("bandwidth", help="pull-and-add allreduce, no framework")
    bw.add_argument("-n", "--nproc", default="2", help="rank counts, e.g. 2,4 (default 2)")
    bw.add_argument("--sizes", default="16M,64M", help="default 16M,64M")
    bw.add_argument("--chunk", default="1M", help="pull-and-add piece (default 1M)")
    bw.add_argument("--iters", type=int, default=15, help="timed iterations (default 15)")
    lat = sub.add_parser("latency", help="4-byte allreduce over blocking sockets")
    lat.add_argument("-n", "--nproc", default="2", help="rank counts, e.g. 2,4 (default 2)")
    lat.add_argument("--iters", type=int, default=3000, help="timed iterations")
    ns = parser.parse_args(argv)
    try:
        ranks = [int(x) for x in str(ns.nproc).split(",")]
        if ns.what == "bandwidth":
            chunk = parse_size(ns.chunk)
            for n in ranks:
                for size in parse_sizes(ns.sizes):
                    t = bandwidth(n, size, chunk, ns.iters)
                    busbw = size / t * 2 * (n - 1) / n / 1e9
                    print(
                        f"floor allreduce N={n} {size >> 20}MiB (chunk {chunk >> 10}KiB): "
                        f"{t * 1e3:.2f} ms, busbw {busbw:.2f} GB/s",
                        flush=True,
                    )
        else:
            for n in ranks:
                t = latency(n, ns.iters)
                print(f"floor allreduce N={n} 4B: p50 {t * 1e6:.0f} us", flush=True)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"floor: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
