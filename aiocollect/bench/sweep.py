"""The timing method, shared by every backend so aiocollect and gloo are measured alike.

For each case every rank: allocates and touches its buffers; runs ``warmup`` untimed
iterations, and more until ``warmup_seconds`` have passed (the median of the last
``warmup`` of them calibrates the iteration count so that a case takes about ``seconds``;
rank 0's choices are broadcast so all ranks agree); resets its peak-RSS mark; enters a
barrier; times each of ``iters`` iterations with ``perf_counter`` (a concurrent case times
K collectives in flight together, then K back to back, alternately) and its CPU time over
them all (user and system, ``getrusage``); reads its peak-RSS growth; runs the collective
once more on rank-dependent data and checks the result against the closed form; and finally
all ranks gather their per-iteration times, so that rank 0 reports, per iteration, the
maximum over ranks (for p50/p99), and the slowest rank's total time divided by the
iterations (NCCL-tests' time, for bandwidth: with collectives whose ranks can run ahead of
each other, like a broadcast root, per-iteration times alone would flatter). On rank 0 a
probe task sleeps 1 ms in a loop during the timed iterations and records how late it wakes
(event-loop lag); its idle floor is taken after the round's cases, not before them.

Why a warm-up by time: a small case runs 2-3x slower for its first 0.1-0.2 s after the
ranks have idled (for 0.2 s, say, as the idle lag probe sleeps), and five iterations of a
20 µs operation end long before that.

Collectives whose root finishes before its receivers (broadcast: the root's sends leave
and it returns) end every timed iteration with the backend's barrier, so the root waits
for the receivers and the next iteration cannot overlap this one; the barrier's own p50
(timed alone afterwards, ``SYNC_ITERS`` times) is recorded as ``sync_p50_us`` so a reader
can see what it adds.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from aiocollect.bench.spec import Array, Case, Shape, fill, shape, verify
from aiocollect.bench.stats import MIB, percentile

#: ``aiocollect bench``'s default for ``SweepConfig.warmup_seconds``.
WARMUP_SECONDS = 0.1
#: Bounds of the adaptive iteration count.
MIN_ITERS = 5
MAX_ITERS = 20_000
#: Collectives timed with a barrier after each iteration (the root would not wait).
SYNCED = frozenset({"broadcast"})
#: Barriers timed alone for ``sync_p50_us``.
SYNC_ITERS = 50
#: Period of the event-loop lag probe.
PROBE_PERIOD = 0.001

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass
class Buffers:
    """One set of a rank's buffers: numpy views (``send``, ``out``) for filling and
    checking, and whatever the backend passes to its collective (``native``)."""

    send: Array
    out: Array | None
    native: tuple[Any, Any]


class Backend(Protocol):
    """A communication library under test, already joined to its group."""

    name: str
    rank: int
    world_size: int
    has_loop_probe: bool

    def algorithm_for(self, collective: str, shp: Shape) -> str: ...
    def allocate(self, shp: Shape, dtype: np.dtype[Any]) -> Buffers: ...
    async def run(self, collective: str, bufs: Buffers) -> None: ...
    async def run_many(self, collective: str, sets: list[Buffers]) -> None: ...
    async def barrier(self) -> None: ...
    async def agree(self, value: int) -> int: ...
    async def gather(self, values: Array) -> Array: ...


@dataclass(frozen=True)
class SweepConfig:
    """What every rank of one backend measures."""

    cases: list[Case]
    dtype: str
    warmup: int
    iters: int | None
    seconds: float
    lag_probe: bool = True
    #: Warm up for at least this long too (the command's default is ``WARMUP_SECONDS``).
    warmup_seconds: float = 0.0


# -- peak resident set size ---------------------------------------------------------------


def _status_kib(field_name: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> int:
    """Reset the peak-RSS mark (Linux ``clear_refs``) and return the current RSS in bytes;
    where that is impossible, return the peak so far (growth is then a lower bound)."""
    try:
        _CLEAR_REFS.write_text("5")
        current = _status_kib("VmRSS")
        if current is not None:
            return current * 1024
    except OSError:
        pass
    return peak_rss()


def peak_rss() -> int:
    """The peak RSS in bytes since the last reset (``VmHWM``, else ``ru_maxrss``)."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


# -- event-loop lag probe -----------------------------------------------------------------


@dataclass
class LagProbe:
    """Sleeps ``PROBE_PERIOD`` in a loop and records how late each wake-up is (µs)."""

    enabled: bool
    samples: list[float] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.samples = []
        if self.enabled:
            self._task = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        clock = time.perf_counter
        while True:
            before = clock()
            await asyncio.sleep(PROBE_PERIOD)
            # Timers may fire a little early (libuv caches its clock): count lateness only.
            self.samples.append(max(0.0, clock() - before - PROBE_PERIOD) * 1e6)

    async def stop(self) -> dict[str, Any] | None:
        """Stop probing; the lag statistics in µs (None when disabled)."""
        task, self._task = self._task, None
        if task is None:
            return None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        s = self.samples
        return {
            "samples": len(s),
            "p50": percentile(s, 50),
            "p99": percentile(s, 99),
            "max": max(s) if s else float("nan"),
        }


# -- measuring ----------------------------------------------------------------------------


def calibrate(per_iter: float, seconds: float) -> int:
    """Iterations that take about ``seconds`` at ``per_iter`` seconds each (bounded)."""
    if per_iter <= 0 or not math.isfinite(per_iter):
        return MAX_ITERS
    return max(MIN_ITERS, min(MAX_ITERS, math.ceil(seconds / per_iter)))


async def measure(backend: Backend, case: Case, cfg: SweepConfig) -> dict[str, Any] | None:
    """Measure one case on every rank; rank 0 returns the record, the others None."""
    dtype = np.dtype(cfg.dtype)
    n, k, coll = backend.world_size, case.concurrency, case.collective
    shp = shape(coll, case.size, dtype.itemsize, n)
    sets = [backend.allocate(shp, dtype) for _ in range(k)]
    synced = coll in SYNCED

    async def together() -> float:
        t0 = time.perf_counter()
        if k == 1:
            await backend.run(coll, sets[0])
        else:
            await backend.run_many(coll, sets)
        if synced:
            await backend.barrier()
        return time.perf_counter() - t0

    async def in_sequence() -> float:
        t0 = time.perf_counter()
        for bufs in sets:
            await backend.run(coll, bufs)
        if synced:
            await backend.barrier()
        return time.perf_counter() - t0

    steps: list[Callable[[], Any]] = [together] if k == 1 else [together, in_sequence]
    warm = await _warm_up(backend, steps, cfg)
    iters = cfg.iters or calibrate(float(np.median(warm[-max(cfg.warmup, 1) :])), cfg.seconds)
    iters = await backend.agree(iters)
    base = reset_peak_rss()
    probe = LagProbe(enabled=cfg.lag_probe and backend.has_loop_probe and backend.rank == 0)
    await backend.barrier()
    probe.start()
    times = np.empty((len(steps), iters), dtype=np.float64)
    cpu = _cpu_seconds()
    for i in range(iters):
        for j, step in enumerate(steps):
            times[j, i] = await step()
    cpu = (_cpu_seconds() - cpu) / iters
    lag = await probe.stop()
    growth = (peak_rss() - base) / MIB
    ok = await _check(backend, coll, sets)
    sync = await _time_barriers(backend) if synced else np.empty(0)
    tail = np.array([cpu, growth, 1.0 if ok else 0.0])
    gathered = await backend.gather(np.concatenate([times.reshape(-1), sync, tail]))
    if backend.rank != 0:
        return None
    body = len(steps) * iters
    per_rank = gathered[:, :body].reshape(n, len(steps), iters) * 1e6
    worst = per_rank.max(axis=0)
    extra: dict[str, Any] = {}
    if synced:
        barriers = gathered[:, body : body + len(sync)].max(axis=0) * 1e6
        extra = {"sync": "barrier", "sync_p50_us": round(float(np.median(barriers)), 1)}
    return {
        "collective": coll,
        "name": case.name,
        "concurrency": k,
        "size": case.size,
        "bytes": shp.total_bytes,
        "count": shp.count,
        "dtype": cfg.dtype,
        "iters": iters,
        "warmup_iters": len(warm),
        "algorithm": backend.algorithm_for(coll, shp),
        "times_us": [round(float(t), 1) for t in worst[0]],
        # the floor's own statistic: the slowest rank's median (at most the p50 of times_us)
        "rank_p50_us": round(float(np.median(per_rank[:, 0], axis=1).max()), 1),
        "seq_times_us": [round(float(t), 1) for t in worst[1]] if k > 1 else None,
        # NCCL-tests' time: the slowest rank's whole batch divided by the iterations.
        "mean_us": round(float(per_rank[:, 0].sum(axis=1).max()) / iters, 3),
        "lag_us": lag,
        # each rank's CPU time (user + system) per timed iteration
        "cpu_us": [round(float(c) * 1e6, 1) for c in gathered[:, -3]],
        "rss_growth_mib": [round(float(g), 3) for g in gathered[:, -2]],
        "correct": bool(gathered[:, -1].min() == 1.0),
        "wrong_ranks": [int(r) for r in np.flatnonzero(gathered[:, -1] != 1.0)],
        **extra,
    }


def _cpu_seconds() -> float:
    """This process's CPU time so far, user and system (``getrusage``), in seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _warm_up(
    backend: Backend, steps: list[Callable[[], Any]], cfg: SweepConfig
) -> list[float]:
    """Run ``cfg.warmup`` untimed iterations (at least one), then more until
    ``cfg.warmup_seconds`` have passed since the first: rank 0 says how many more fill
    the time left (from its latest iterations) and every rank runs that many, so the
    ranks' operations keep matching. Returns the iterations' times (seconds)."""
    least = max(cfg.warmup, 1)
    warm: list[float] = []
    start = time.perf_counter()
    batch = least
    while batch > 0:
        for _ in range(batch):
            warm.append(sum([await step() for step in steps]))
        if cfg.warmup_seconds <= 0:
            break
        left = cfg.warmup_seconds - (time.perf_counter() - start)
        per = float(np.median(warm[-least:]))
        batch = min(MAX_ITERS - len(warm), math.ceil(left / per)) if left > 0 and per > 0 else 0
        batch = await backend.agree(max(0, batch))
    return warm


async def _time_barriers(backend: Backend) -> Array:
    """``SYNC_ITERS`` barriers timed one by one (seconds)."""
    out = np.empty(SYNC_ITERS, dtype=np.float64)
    await backend.barrier()
    for i in range(SYNC_ITERS):
        t0 = time.perf_counter()
        await backend.barrier()
        out[i] = time.perf_counter() - t0
    return out


async def _check(backend: Backend, coll: str, sets: list[Buffers]) -> bool:
    """Run the collective once on rank-dependent data; True if this rank's result is
    the closed form."""
    rank, n = backend.rank, backend.world_size
    for offset, bufs in enumerate(sets):
        fill(coll, bufs.send, bufs.out, rank, n, offset)
    if len(sets) == 1:
        await backend.run(coll, sets[0])
    else:
        await backend.run_many(coll, sets)
    return all(
        verify(coll, bufs.send, bufs.out, rank, n, offset) for offset, bufs in enumerate(sets)
    )


async def idle_lag(backend: Backend, seconds: float = 0.2) -> dict[str, Any] | None:
    """The lag probe's statistics on an idle loop (the floor of the per-case figures)."""
    probe = LagProbe(enabled=backend.has_loop_probe and backend.rank == 0)
    probe.start()
    await asyncio.sleep(seconds)
    return await probe.stop()
