"""The floors' rank processes: start them, collect what they measured, time their steps.

Every floor of :mod:`aiocollect.bench.floor` (and the head-of-line floor,
:mod:`aiocollect.bench.hol_floor`) runs as ``n`` forked rank processes of one worker
function that puts ``(rank, result, ok)`` on a queue: :func:`collect` starts them and
gathers those (killing them all when one fails), :func:`collect_pulls` also gives them a
table of each rank's pid and buffer address for ``process_vm_readv``, and :func:`run`,
:func:`run_pulls` and :func:`run_pairs` reduce per-iteration times to a :class:`Floor`.
:func:`timed` times a worker's steps after a warm-up; :func:`ring_pairs` and
:func:`distances` make the blocking socket pairs of the socket floors.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from aiocollect.transport import cma

_CTX = mp.get_context("fork")
#: A rank waiting longer than this at a barrier gives up (exits non-zero).
BARRIER_SECONDS = 60.0


class Floor(NamedTuple):
    """One floor, two statistics of the same run (seconds per operation)."""

    #: The slowest rank's median: the floor (what ``aiocollect bench --floor`` divides
    #: its p50 by, the ``x floor`` column).
    seconds: float
    #: The median over iterations of each iteration's slowest rank: ``aiocollect
    #: bench``'s p50 statistic. Never lower; higher where ranks wait for each other in
    #: turn or outnumber the cores.
    each: float


def collect(target: Any, n: int, args: tuple[Any, ...]) -> list[tuple[int, Any, bool]]:
    """Start ``n`` forked ranks of ``target`` (called with the rank, ``n``, ``args`` and a
    queue, on which each puts ``(rank, result, ok)``) and return what they put, once all
    have; kill them all if one fails.

    Raises:
        RuntimeError: a rank failed (exited non-zero without a result) or said its result
            was wrong (``ok`` false)."""
    out = _CTX.Queue()
    procs = [_CTX.Process(target=target, args=(r, n, *args, out), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    results: list[tuple[int, Any, bool]] = []
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
    return results


def run(target: Any, n: int, args: tuple[Any, ...]) -> Floor:
    """:func:`collect` for ranks that put their per-iteration seconds; both statistics of
    their times (:class:`Floor`).

    Raises:
        RuntimeError: a rank failed or computed a wrong result."""
    return statistics(collect(target, n, args))


def statistics(results: list[tuple[int, Any, bool]]) -> Floor:
    """Both statistics (:class:`Floor`) of the ranks' per-iteration seconds."""
    return Floor(
        float(max(np.median(t) for _, t, _ in results)),
        float(np.median(np.max([t for _, t, _ in results], axis=0))),
    )


def run_pulls(target: Any, n: int, args: tuple[Any, ...]) -> Floor:
    """:func:`run` for ranks that read each other's memory (:func:`collect_pulls`).

    Raises:
        OSError: this host cannot use process_vm_readv (no Linux, or forbidden).
        RuntimeError: as :func:`run`."""
    return statistics(collect_pulls(target, n, args))


def collect_pulls(target: Any, n: int, args: tuple[Any, ...]) -> list[tuple[int, Any, bool]]:
    """:func:`collect` for ranks that read each other's memory: ``target`` gets ``args``,
    then a shared table for each rank's pid and buffer address, then a barrier.

    Raises:
        OSError: this host cannot use process_vm_readv (no Linux, or forbidden).
        RuntimeError: as :func:`collect`."""
    reason = cma.self_check()
    if reason is not None:
        raise OSError(reason)
    table = _CTX.Array("Q", 2 * n, lock=False)
    return collect(target, n, (*args, table, _CTX.Barrier(n)))


def run_pairs(
    target: Any, n: int, socks: dict[tuple[int, int], socket.socket], args: tuple[Any, ...]
) -> Floor:
    """:func:`run` for ranks over the socket pairs ``socks`` (``target`` gets them, then
    ``args``), closed here whatever happens."""
    try:
        return run(target, n, (socks, *args))
    finally:
        for s in socks.values():
            s.close()


def timed(iters: int, step: Callable[[], bool]) -> tuple[list[float], bool]:
    """Run ``step`` ``iters`` times and a tenth more first to warm up, timing each run
    after those: the times (seconds) and whether every ``step`` said its result was
    right."""
    times = []
    ok = True
    for i in range(iters + iters // 10):
        start = time.perf_counter()
        ok = step() and ok
        if i >= iters // 10:
            times.append(time.perf_counter() - start)
    return times, ok


def ring_pairs(n: int, steps: Sequence[int]) -> dict[tuple[int, int], socket.socket]:
    """Blocking socket pairs from every rank r to rank (r + d) % n for each distance d in
    ``steps``: ``socks[(r, q)]`` is r's end towards q, ``socks[(q, -1 - r)]`` q's end
    from r (the two keys differ even where d = n - d)."""
    socks: dict[tuple[int, int], socket.socket] = {}
    for d in steps:
        for r in range(n):
            q = (r + d) % n
            socks[(r, q)], socks[(q, -1 - r)] = socket.socketpair()
    return socks


def distances(n: int) -> list[int]:
    """A dissemination barrier's steps among ``n`` ranks: 1, 2, 4, ... below ``n``."""
    return [1 << k for k in range(max(0, (n - 1).bit_length()))]
