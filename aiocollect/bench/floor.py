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
- ``latency``: a small float32 allreduce (4 bytes unless ``--sizes`` says otherwise) by
  recursive doubling over blocking Unix socket pairs (N a power of two), numpy adds.
  Prints the median time per allreduce (slowest rank).

The same for the two cases of ``aiocollect bench`` that are not collectives of data
(:func:`measure` with ``collective``):

- ``barrier``: a dissemination barrier over blocking socket pairs (one byte to rank
  r + 2^k, one from rank r - 2^k, for each k with 2^k < N; any N).
- ``sendrecv`` (every rank sends to r+1 and receives from r-1 at once): below
  ``BULK_MIN`` over blocking socket pairs, the send and the receive overlapping where the
  socket cannot take the whole payload at once; from ``BULK_MIN`` each rank reads rank
  r-1's buffer with ``process_vm_readv`` (one copy, as aiocollect's shared-memory links
  pull a large payload), between two barriers.

:func:`measure` picks the floor of one size as ``aiocollect bench --floor`` does in
every round: for allreduce and sendrecv the latency floor below ``BULK_MIN`` bytes (where
a frame's cost is the time), the bandwidth floor from there (where the copies are).

Every rank checks its result against the closed form; a wrong one fails the run (exit 1).
Rank processes are forked (:mod:`aiocollect.bench.floor_ranks`); they exit with the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np

from aiocollect._buffers import byte_view
from aiocollect.bench.floor_ranks import (
    BARRIER_SECONDS,
    Floor,
    distances,
    ring_pairs,
    run_pairs,
    run_pulls,
    timed,
)
from aiocollect.bench.spec import format_size, parse_size, parse_sizes
from aiocollect.transport import cma

#: :func:`measure` uses the bandwidth floor from this many bytes, the latency floor below
#: (the size from which shared-memory links send by reference: ``cma.PULL_MIN``).
BULK_MIN = cma.PULL_MIN
#: Iterations of the latency floor and the bandwidth floor (the defaults of the functions,
#: the command and :func:`measure`, which ``aiocollect bench --floor`` runs). Far longer
#: runs settle lower on a two-core host: the blocking 4-byte ping-pong measured 7-11 µs over
#: 20,000 iterations against 14-16 µs over 3,000 (``python -m aiocollect.bench.floor
#: latency -n 2 --iters 20000``).
LATENCY_ITERS = 3000
BANDWIDTH_ITERS = 15


def fold(
    pid: int,
    base: int,
    own: np.ndarray[Any, np.dtype[np.float32]],
    scratch: np.ndarray[Any, np.dtype[np.float32]],
    lo: int,
    hi: int,
    between: Callable[[], None] | None = None,
) -> None:
    """Add elements ``lo:hi`` of process ``pid``'s float32 array at address ``base`` into
    ``own[lo:hi]``, read ``scratch.size`` elements at a time into ``scratch``
    (``process_vm_readv``); ``between`` is called after every piece."""
    sview = byte_view(scratch)
    off = lo
    while off < hi:
        m = min(scratch.size, hi - off)
        cma.pull(pid, sview[: m * 4], base + off * 4)
        np.add(own[off : off + m], scratch[:m], out=own[off : off + m])
        off += m
        if between is not None:
            between()


def pull_and_add(
    rank: int,
    own: np.ndarray[Any, np.dtype[np.float32]],
    scratch: np.ndarray[Any, np.dtype[np.float32]],
    peers: list[tuple[int, int]],
    bar: Barrier,
) -> None:
    """One allreduce of the floor's data flow among ``len(peers)`` ranks (each peer's pid
    and the address of its ``own``): fold block ``rank`` of every peer's array into this
    rank's, a barrier, read every other block from the rank that reduced it, a barrier."""
    n = len(peers)
    blk = own.size // n
    lo = rank * blk
    for step in range(1, n):
        pid, base = peers[(rank + step) % n]
        fold(pid, base, own, scratch, lo, lo + blk)
    bar.wait(BARRIER_SECONDS)
    view = byte_view(own)
    for step in range(1, n):
        q = (rank + step) % n
        pid, base = peers[q]
        cma.pull(pid, view[q * blk * 4 : (q + 1) * blk * 4], base + q * blk * 4)
    bar.wait(BARRIER_SECONDS)


def _pull_worker(
    rank: int, n: int, nbytes: int, chunk: int, iters: int, table: Any, bar: Barrier, out: Any
) -> None:
    count = nbytes // 4
    own = np.full(count, rank + 1, np.float32)
    scratch = np.empty(max(1, chunk // 4), np.float32)
    table[2 * rank], table[2 * rank + 1] = os.getpid(), own.ctypes.data
    bar.wait(BARRIER_SECONDS)
    peers = [(int(table[2 * p]), int(table[2 * p + 1])) for p in range(n)]
    times = []
    # The sums are checked against the closed form afterwards; a pull that copied garbage
    # must give a wrong result, not a floating-point warning (an error where warnings are).
    np.seterr(all="ignore")
    for _ in range(iters):
        own[...] = rank + 1
        bar.wait(BARRIER_SECONDS)
        start = time.perf_counter()
        pull_and_add(rank, own, scratch, peers, bar)
        times.append(time.perf_counter() - start)
    ok = bool((own[: count // n * n] == n * (n + 1) / 2).all())
    out.put((rank, times, ok))


def bandwidth(n: int, nbytes: int, chunk: int = 1 << 20, iters: int = BANDWIDTH_ITERS) -> Floor:
    """Seconds per allreduce of ``nbytes`` (float32) among ``n`` ranks (the slowest rank's
    median), by the pull-and-add data flow above.

    Raises:
        ValueError: ``nbytes`` is not a positive multiple of ``4 * n``, or ``n < 2``.
        OSError: this host cannot use process_vm_readv (no Linux, or forbidden).
        RuntimeError: a rank failed or computed a wrong result."""
    if n < 2 or nbytes <= 0 or nbytes % (4 * n):
        raise ValueError(f"need 2+ ranks and a size that is a multiple of {4 * n} bytes")
    return run_pulls(_pull_worker, n, (nbytes, chunk, iters))


def _doubling_worker(
    rank: int,
    n: int,
    socks: dict[tuple[int, int], socket.socket],
    iters: int,
    nbytes: int,
    out: Any,
) -> None:
    val = np.ones(nbytes // 4, np.float32)
    raw = bytearray(nbytes)
    got = np.frombuffer(raw, np.float32)

    def step() -> bool:
        mask = 1
        while mask < n:
            sock = socks[(rank, rank ^ mask)]
            sock.sendall(byte_view(val))
            sock.recv_into(raw, nbytes, socket.MSG_WAITALL)
            np.add(val, got, out=val)  # (in place: val is the enclosing array)
            mask <<= 1
        ok = bool((val == n).all())
        val[...] = 1
        return ok

    out.put((rank, *timed(iters, step)))


def latency(n: int, iters: int = LATENCY_ITERS, nbytes: int = 4) -> Floor:
    """Seconds per allreduce of ``nbytes`` (float32, 4 by default) among ``n`` ranks (a
    power of two; the slowest rank's median), by recursive doubling over blocking socket
    pairs.

    Raises:
        ValueError: ``n`` is not a power of two of at least 2, or ``nbytes`` is not a
            positive multiple of 4.
        RuntimeError: a rank failed or computed a wrong result."""
    if n < 2 or n & (n - 1):
        raise ValueError("recursive doubling needs a power-of-two number of ranks")
    if nbytes <= 0 or nbytes % 4:
        raise ValueError(f"need a size that is a positive multiple of 4 bytes, got {nbytes}")
    socks: dict[tuple[int, int], socket.socket] = {}
    for r in range(n):
        mask = 1
        while mask < n:
            p = r ^ mask
            if r < p:
                socks[(r, p)], socks[(p, r)] = socket.socketpair()
            mask <<= 1
    return run_pairs(_doubling_worker, n, socks, (iters, nbytes))


def _barrier_worker(
    rank: int, n: int, socks: dict[tuple[int, int], socket.socket], iters: int, out: Any
) -> None:
    steps = [
        (socks[(rank, (rank + d) % n)], socks[(rank, -1 - (rank - d) % n)]) for d in distances(n)
    ]
    got = bytearray(1)

    def step() -> bool:
        for tx, rx in steps:
            tx.sendall(b"b")
            rx.recv_into(got, 1, socket.MSG_WAITALL)
        return True  # (nothing to check in a barrier)

    out.put((rank, *timed(iters, step)))


def barrier(n: int, iters: int = LATENCY_ITERS) -> Floor:
    """Seconds per barrier among ``n`` ranks (any n from 2; the slowest rank's median):
    a dissemination barrier, one byte per step over blocking socket pairs.

    Raises:
        ValueError: fewer than 2 ranks.
        RuntimeError: a rank failed."""
    if n < 2:
        raise ValueError("a barrier floor needs 2+ ranks")
    return run_pairs(_barrier_worker, n, ring_pairs(n, distances(n)), (iters,))


def _exchange(tx: socket.socket, rx: socket.socket, data: memoryview, into: memoryview) -> None:
    """Send ``data`` on ``tx`` while receiving ``len(into)`` bytes from ``rx``: one send
    and one blocking receive where the socket takes the whole payload (small ones), else
    both as the sockets allow (a rank that sent first and waited for its peer to read
    would wait for ever if every rank did)."""
    try:
        sent = tx.send(data, socket.MSG_DONTWAIT)
    except BlockingIOError:  # full of what the peer has not read yet
        sent = 0
    got = 0
    while sent < len(data):
        readable, writable, _ = select.select([rx] if got < len(into) else [], [tx], [])
        if writable:
            with contextlib.suppress(BlockingIOError):  # (taken by the peer meanwhile)
                sent += tx.send(data[sent:], socket.MSG_DONTWAIT)
        if readable:
            got += rx.recv_into(into[got:], len(into) - got)
    if got < len(into):
        rx.recv_into(into[got:], len(into) - got, socket.MSG_WAITALL)


def _shift_worker(
    rank: int,
    n: int,
    socks: dict[tuple[int, int], socket.socket],
    iters: int,
    nbytes: int,
    out: Any,
) -> None:
    tx, rx = socks[(rank, (rank + 1) % n)], socks[(rank, -1 - (rank - 1) % n)]
    data = memoryview(bytes([rank % 251]) * nbytes)
    into = memoryview(bytearray(nbytes))

    def step() -> bool:
        into[0] = into[nbytes - 1] = 255  # (no rank sends 255: each iteration must land)
        _exchange(tx, rx, data, into)
        return into[nbytes - 1] == (rank - 1) % n % 251 and into[0] == into[nbytes - 1]

    out.put((rank, *timed(iters, step)))


def sendrecv_latency(n: int, nbytes: int, iters: int = LATENCY_ITERS) -> Floor:
    """Seconds per send to rank r+1 with a receive from rank r-1 (every rank at once,
    ``nbytes`` each; the slowest rank's median) over blocking socket pairs.

    Raises:
        ValueError: fewer than 2 ranks, or ``nbytes`` not positive.
        RuntimeError: a rank failed or received the wrong bytes."""
    if n < 2 or nbytes <= 0:
        raise ValueError("need 2+ ranks and a positive size")
    return run_pairs(_shift_worker, n, ring_pairs(n, [1]), (iters, nbytes))


def _shift_pull_worker(
    rank: int, n: int, nbytes: int, iters: int, table: Any, bar: Barrier, out: Any
) -> None:
    send = np.full(nbytes, rank % 251, np.uint8)
    into = np.zeros(nbytes, np.uint8)
    table[2 * rank], table[2 * rank + 1] = os.getpid(), send.ctypes.data
    bar.wait(BARRIER_SECONDS)
    prev = (rank - 1) % n
    pid, base = int(table[2 * prev]), int(table[2 * prev + 1])
    view = byte_view(into)
    times = []
    for _ in range(iters):
        into[0] = into[-1] = 255
        bar.wait(BARRIER_SECONDS)
        start = time.perf_counter()
        cma.pull(pid, view, base)
        bar.wait(BARRIER_SECONDS)
        times.append(time.perf_counter() - start)
    ok = bool(into[0] == into[-1] == prev % 251)
    out.put((rank, times, ok))


def sendrecv_bandwidth(n: int, nbytes: int, iters: int = BANDWIDTH_ITERS) -> Floor:
    """Seconds per send to rank r+1 with a receive from rank r-1 (every rank at once,
    ``nbytes`` each; the slowest rank's median): each rank reads rank r-1's buffer with
    ``process_vm_readv``, between two barriers.

    Raises:
        ValueError: fewer than 2 ranks, or ``nbytes`` not positive.
        OSError: this host cannot use process_vm_readv.
        RuntimeError: a rank failed or read the wrong bytes."""
    if n < 2 or nbytes <= 0:
        raise ValueError("need 2+ ranks and a positive size")
    return run_pulls(_shift_pull_worker, n, (nbytes, iters))


#: The cases :func:`measure` has a floor for.
FLOORED = ("allreduce", "barrier", "sendrecv")


def _check_floored(collective: str) -> None:
    """Raises ValueError unless ``collective`` has a floor (``FLOORED``)."""
    if collective not in FLOORED:
        raise ValueError(f"no floor for {collective!r} (only {', '.join(FLOORED)})")


def method(nbytes: int, collective: str = "allreduce") -> str:
    """Which floor :func:`measure` runs for ``collective`` at ``nbytes`` (at any world
    size): ``"latency"`` below ``BULK_MIN`` bytes and for a barrier, else
    ``"bandwidth"``."""
    return "latency" if nbytes < BULK_MIN or collective == "barrier" else "bandwidth"


def measure(n: int, nbytes: int, collective: str = "allreduce") -> tuple[str, int, Floor]:
    """The floor of ``collective`` (one of ``FLOORED``) with ``nbytes`` among ``n``
    ranks: ``(method, bytes measured, its Floor)``. For an allreduce the latency floor
    (:func:`method`) measures ``nbytes`` rounded down to a multiple of 4 (at least 4), the
    bandwidth floor ``nbytes`` rounded down to a multiple of ``4 n``; a size that rounds
    to nothing is an error. A sendrecv measures ``nbytes`` (at least 1), a barrier 0.

    Raises:
        ValueError: the floor cannot measure this (an unknown collective, a rank count
            not a power of two for the allreduce's latency floor, a size too small for
            its bandwidth floor, fewer than 2 ranks).
        OSError: this host cannot use process_vm_readv (the bandwidth floors).
        RuntimeError: a rank failed or computed a wrong result."""
    _check_floored(collective)
    how = method(nbytes, collective)
    if collective == "barrier":
        return how, 0, barrier(n)
    if collective == "sendrecv":
        size = max(1, nbytes)
        if how == "latency":
            return how, size, sendrecv_latency(n, size)
        return how, size, sendrecv_bandwidth(n, size)
    if how == "latency":
        size = max(4, nbytes // 4 * 4)
        return how, size, latency(n, nbytes=size)
    size = nbytes // (4 * n) * (4 * n)
    return how, size, bandwidth(n, size)


def _measure_main(n: int, sizes: str, out: Path, collective: str = "allreduce") -> int:
    """``measure``: the floor of ``collective`` at every size (:func:`measure`; a barrier
    once, at size 0), one JSON record per size, ``{"collective", "size", "method",
    "bytes", "us", "us_each"}`` (:class:`Floor`'s two statistics, in µs) or
    ``{"collective", "size", "error"}`` where the floor cannot measure
    it; a progress line per size on stderr. Exit status 1 only for bad arguments."""
    try:
        wanted = [0] if collective == "barrier" else parse_sizes(sizes)
        _check_floored(collective)
    except ValueError as exc:
        print(f"floor: {exc}", file=sys.stderr)
        return 1
    records: list[dict[str, Any]] = []
    for size in wanted:
        what = f"floor {collective} N={n} {format_size(size)}"
        try:
            how, nbytes, got = measure(n, size, collective)
        except (ValueError, OSError, RuntimeError) as exc:
            records.append({"collective": collective, "size": size, "error": str(exc)})
            print(f"{what}: not measured: {exc}", file=sys.stderr)
            continue
        records.append(
            {
                "collective": collective,
                "size": size,
                "method": how,
                "bytes": nbytes,
                "us": got.seconds * 1e6,
                "us_each": got.each * 1e6,
            }
        )
        print(
            f"{what} ({how}): p50 {got.seconds * 1e6:.1f} us (slowest rank per iteration: "
            f"{got.each * 1e6:.1f} us)",
            file=sys.stderr,
            flush=True,
        )
    out.write_text(json.dumps(records))
    return 0


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
    bw.add_argument(
        "--iters",
        type=int,
        default=BANDWIDTH_ITERS,
        help=f"timed iterations (default {BANDWIDTH_ITERS})",
    )
    lat = sub.add_parser("latency", help="small allreduce over blocking sockets")
    lat.add_argument("-n", "--nproc", default="2", help="rank counts, e.g. 2,4 (default 2)")
    lat.add_argument("--sizes", default="4", help="bytes per allreduce (default 4)")
    lat.add_argument("--iters", type=int, default=LATENCY_ITERS, help="timed iterations")
    each = sub.add_parser(
        "measure", help="the floor of each size, as aiocollect bench --floor runs it (JSON)"
    )
    each.add_argument("-n", "--nproc", type=int, default=2, help="ranks (default 2)")
    each.add_argument(
        "--collective",
        default="allreduce",
        choices=FLOORED,
        help="whose floor (default allreduce; a barrier has one size, 0)",
    )
    each.add_argument("--sizes", required=True, help="sizes in bytes (ignored for barrier)")
    each.add_argument("--json", type=Path, required=True, help="write the results here")
    ns = parser.parse_args(argv)
    if ns.what == "measure":
        return _measure_main(ns.nproc, ns.sizes, ns.json, ns.collective)
    try:
        ranks = [int(x) for x in str(ns.nproc).split(",")]
        if ns.what == "bandwidth":
            chunk = parse_size(ns.chunk)
            for n in ranks:
                for size in parse_sizes(ns.sizes):
                    t = bandwidth(n, size, chunk, ns.iters).seconds
                    busbw = size / t * 2 * (n - 1) / n / 1e9
                    print(
                        f"floor allreduce N={n} {size >> 20}MiB (chunk {chunk >> 10}KiB): "
                        f"{t * 1e3:.2f} ms, busbw {busbw:.2f} GB/s",
                        flush=True,
                    )
        else:
            for n in ranks:
                for size in parse_sizes(ns.sizes):
                    t = latency(n, ns.iters, size).seconds
                    print(
                        f"floor allreduce N={n} {format_size(size)}B: p50 {t * 1e6:.0f} us",
                        flush=True,
                    )
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"floor: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
