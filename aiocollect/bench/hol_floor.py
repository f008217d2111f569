"""The head-of-line floor: a small round trip while bulk allreduces run, with no framework.

``python -m aiocollect.bench.hol --floor`` runs it after aiocollect's own measurement
(:mod:`aiocollect.bench.hol`), in the same invocation, so that the two are read as a
same-run ratio. It answers: on this host, with this many ranks on its cores, how long does
a 1 KiB round trip take while every rank moves bulk data, if nothing but the data flow
and the round trip run?

Every rank runs ``allreduces`` back-to-back allreduces of ``nbytes`` (float32) by the
bandwidth floor's data flow (:mod:`aiocollect.bench.floor`: rank r reads block r of every
peer with ``process_vm_readv`` and adds it into its own, then reads every other block
from its owner), in the pieces aiocollect's pull allreduce uses (``RS_STEP`` read and
added, ``AG_STEP`` read, per piece). Between pieces, and while waiting at the phase
barriers, a rank *services*: rank 0 sends a ``ping``-byte message to rank 1 when none is
outstanding and takes rank 1's echo when it is there (recording the round trip); rank 1
echoes what came. That is what an event loop does between the pieces of a collective, so
the round trip can only be as prompt as the pieces and the host's scheduler let it be.

The phase barriers (dissemination over socket pairs, as the barrier floor) wait in
``select`` on their socket and the ping socket together, so that no wait blocks the round
trip. Rank 0 also records how late each service comes after the previous one plus 1 ms
(as the event-loop lag probe records how late a 1 ms sleep wakes), from the services
that fell due.

Every rank checks its result against the closed form (a wrong one fails the run). Nothing
here is part of aiocollect's data path; it is a yardstick.
"""

from __future__ import annotations

import os
import select
import socket
import time
from multiprocessing.synchronize import Barrier
from typing import Any, NamedTuple

import numpy as np

from aiocollect._buffers import byte_view
from aiocollect.bench.floor import fold
from aiocollect.bench.floor_ranks import BARRIER_SECONDS, collect_pulls, distances, ring_pairs
from aiocollect.collectives.pull import AG_STEP, RS_STEP
from aiocollect.transport import cma


class HolFloor(NamedTuple):
    """Rank 0's samples (microseconds) from one run."""

    #: Round trips completed while the allreduces ran.
    rtt_us: list[float]
    #: How late each due 1 ms service came (the lag probe's statistic).
    lag_us: list[float]
    #: Seconds the allreduces took (rank 0, the whole batch).
    bulk_seconds: float


class _Pinger:
    """Rank 0's or rank 1's end of the round trip (non-blocking socket); the rest of the
    ranks hold None."""

    def __init__(self, sock: socket.socket, rank: int, nbytes: int) -> None:
        self.sock = sock
        self.rank = rank
        self.nbytes = nbytes
        self.msg = b"p" * nbytes
        self.inbox = bytearray()
        self.outbox = b""
        self.sent_at: float | None = None
        self.rtts: list[float] = []
        self.lags: list[float] = []
        self.due = time.perf_counter() + 1e-3

    def service(self) -> None:
        """One look at the socket: send, echo or take what is due. Never blocks."""
        now = time.perf_counter()
        if self.rank == 0 and now >= self.due:
            self.lags.append((now - self.due) * 1e6)
            self.due = now + 1e-3
        if self.outbox:
            self._flush()
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            data = None
        if data:
            self.inbox += data
        while len(self.inbox) >= self.nbytes:
            del self.inbox[: self.nbytes]
            if self.rank == 1:
                self.outbox += self.msg
                self._flush()
            elif self.sent_at is not None:
                self.rtts.append((time.perf_counter() - self.sent_at) * 1e6)
                self.sent_at = None
        if self.rank == 0 and self.sent_at is None and not self.outbox:
            self.sent_at = time.perf_counter()
            self.outbox = self.msg
            self._flush()

    def _flush(self) -> None:
        try:
            sent = self.sock.send(self.outbox)
        except BlockingIOError:
            return
        self.outbox = self.outbox[sent:]


def _wait(sock: socket.socket, pinger: _Pinger | None) -> None:
    """Take one byte from ``sock``, servicing the round trip while it has not come."""
    deadline = time.monotonic() + BARRIER_SECONDS
    watch = [sock] if pinger is None else [sock, pinger.sock]
    while True:
        if pinger is not None:
            pinger.service()
        ready, _, _ = select.select(watch, [], [], 1e-3 if pinger is not None else 1.0)
        if sock in ready:
            if not sock.recv(1):
                raise RuntimeError("a peer closed its barrier socket")
            return
        if time.monotonic() > deadline:
            raise RuntimeError("a peer did not reach the barrier")


def _worker(
    rank: int,
    n: int,
    socks: dict[tuple[int, int], socket.socket],
    ping_socks: tuple[socket.socket, socket.socket],
    nbytes: int,
    allreduces: int,
    ping: int,
    table: Any,
    start: Barrier,
    out: Any,
) -> None:
    count = nbytes // 4
    own = np.ones(count, np.float32)
    blk = count // n
    scratch = np.empty(max(1, min(blk, RS_STEP // 4)), np.float32)
    view = byte_view(own)
    table[2 * rank], table[2 * rank + 1] = os.getpid(), own.ctypes.data
    steps = [
        (socks[(rank, (rank + d) % n)], socks[(rank, -1 - (rank - d) % n)]) for d in distances(n)
    ]
    pinger: _Pinger | None = None
    if rank < 2:
        sock = ping_socks[rank]
        sock.setblocking(False)
        pinger = _Pinger(sock, rank, ping)

    def service() -> None:
        if pinger is not None:
            pinger.service()

    def barrier() -> None:
        for tx, rx in steps:
            tx.sendall(b"b")
            _wait(rx, pinger)

    start.wait(BARRIER_SECONDS)
    peers = [(int(table[2 * p]), int(table[2 * p + 1])) for p in range(n)]
    np.seterr(all="ignore")
    barrier()
    t0 = time.perf_counter()
    lo = rank * blk
    for _ in range(allreduces):
        for step in range(1, n):
            pid, base = peers[(rank + step) % n]
            fold(pid, base, own, scratch, lo, lo + blk, service)
        barrier()
        for step in range(1, n):
            q = (rank + step) % n
            pid, base = peers[q]
            a, e = q * blk * 4, (q + 1) * blk * 4
            while a < e:
                b = min(e, a + AG_STEP)
                cma.pull(pid, view[a:b], base + a)
                a = b
                service()
        barrier()
    seconds = time.perf_counter() - t0
    ok = bool((own == _expected(n, allreduces)).all())
    floor = None if rank or pinger is None else HolFloor(pinger.rtts, pinger.lags, seconds)
    out.put((rank, floor, ok))


def _expected(n: int, allreduces: int) -> np.float32:
    """Every element after ``allreduces`` allreduces of all-ones arrays among ``n`` ranks,
    in float32 as the ranks fold it (each value added to itself n - 1 times in turn;
    inf once it overflows), so that the check can be exact."""
    value = np.float32(1.0)
    with np.errstate(over="ignore"):
        for _ in range(allreduces):
            acc = value
            for _ in range(n - 1):
                acc = np.float32(acc + value)
            value = acc
    return value


def measure(n: int, nbytes: int, allreduces: int, ping: int = 1024) -> HolFloor:
    """Run the head-of-line floor among ``n`` forked ranks (module docstring).

    Raises:
        ValueError: ``n < 2``, or ``nbytes`` is not a positive multiple of ``4 * n``.
        OSError: this host cannot use ``process_vm_readv``.
        RuntimeError: a rank failed, or computed a wrong result.
    """
    if n < 2 or nbytes <= 0 or nbytes % (4 * n) or ping <= 0:
        raise ValueError(f"need 2+ ranks, a size that is a multiple of {4 * n} bytes, a ping")
    socks = ring_pairs(n, distances(n))
    ping_socks = socket.socketpair()
    try:
        results = collect_pulls(_worker, n, (socks, ping_socks, nbytes, allreduces, ping))
    finally:
        for s in (*socks.values(), *ping_socks):
            s.close()
    floor: HolFloor = next(got for rank, got, _ in results if rank == 0)
    return floor
