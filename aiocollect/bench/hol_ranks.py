"""One rank of the head-of-line measurement (:mod:`aiocollect.bench.hol`): small
request/reply round trips, from many concurrent requesters, while bulk allreduces run.

:func:`hol_rank` is the measurement on an open group (a ``spawn_ranks`` target). Run as
a module it is also a rank script, so that the ranks can be started exactly as users start
theirs::

    aiocollect run -n 4 --start-method exec --transport auto \\
        -m aiocollect.bench.hol_ranks --size 64M --requesters 8 --loop asyncio --out r.json

(rank 0 writes the report to ``--out``; ``python -m aiocollect.bench.hol --launcher run``
does exactly that). ``--loop asyncio`` runs the rank with plain :func:`asyncio.run`,
``--loop uvloop`` with :func:`uvloop.run`.

The measurement, on every rank: a warm-up allreduce; ``--requesters`` coroutines on
rank 0, requester ``i`` sending ``--ping`` bytes to rank ``1 + i % (n - 1)`` and waiting
for them back (tag ``TAG + i``), ``--idle-pings`` times each, with the group otherwise
idle (the rate alone); ``--allreduces`` back-to-back allreduces of ``--size`` bytes alone
(bandwidth alone); then the allreduces again with the requesters running until they end
(round trips and rate under bulk load, bandwidth with the requests). Every rank runs a
loop-lag probe (how late a 1 ms ``asyncio.sleep`` wakes) through both bulk phases; rank 0
gathers every rank's lag.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from aiocollect.bench.spec import parse_size
from aiocollect.bench.stats import percentile

if TYPE_CHECKING:
    from aiocollect.group import Group

#: Tag of requester 0's round trips (requester i uses TAG + i); a first element of -1
#: ends them.
TAG = 7
#: Seconds the lag probe sleeps between looks (it records how much later it woke).
LAG_PERIOD = 1e-3


async def _allreduces(group: Group, data: np.ndarray[Any, Any], count: int) -> float:
    t0 = time.perf_counter()
    for _ in range(count):
        await group.allreduce(data)
    return time.perf_counter() - t0


async def _requester(
    group: Group, i: int, nbytes: int, until: asyncio.Future[Any] | None, count: int
) -> list[float]:
    """Requester ``i``'s round trips (µs): ``count`` of them, or until ``until`` is done."""
    peer, tag = _peer(group.world_size, i), TAG + i
    msg = np.zeros(max(1, nbytes // 4), dtype=np.float32)
    back = np.empty_like(msg)
    rtts: list[float] = []
    while (until is None and len(rtts) < count) or (until is not None and not until.done()):
        t0 = time.perf_counter()
        await group.send(msg, peer, tag=tag)
        await group.recv(back, peer, tag=tag)
        rtts.append((time.perf_counter() - t0) * 1e6)
    msg[0] = -1
    await group.send(msg, peer, tag=tag)
    return rtts


async def _responder(group: Group, i: int, nbytes: int) -> None:
    """Echo requester ``i``'s requests until its -1."""
    tag = TAG + i
    msg = np.empty(max(1, nbytes // 4), dtype=np.float32)
    while True:
        await group.recv(msg, 0, tag=tag)
        if msg[0] == -1:
            return
        await group.send(msg, 0, tag=tag)


def _peer(n: int, i: int) -> int:
    """The rank requester ``i`` (on rank 0) talks to."""
    return 1 + i % (n - 1)


async def _requests(
    group: Group, requesters: int, nbytes: int, until: asyncio.Future[Any] | None, count: int
) -> tuple[list[float], float]:
    """This rank's side of one phase of requests: on rank 0 the requesters' round trips
    (µs, all together) and the seconds they ran; elsewhere ``([], 0.0)`` after answering."""
    if group.rank != 0:
        mine = [i for i in range(requesters) if _peer(group.world_size, i) == group.rank]
        await asyncio.gather(*(_responder(group, i, nbytes) for i in mine))
        return [], 0.0
    t0 = time.perf_counter()
    got = await asyncio.gather(
        *(_requester(group, i, nbytes, until, count) for i in range(requesters))
    )
    return [rtt for rtts in got for rtt in rtts], time.perf_counter() - t0


class LagProbe:
    """How late a :data:`LAG_PERIOD` sleep wakes on this loop (µs), while started."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> list[float]:
        """Stop probing; returns the lags recorded since :meth:`start` (and clears them)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        lags, self.lags = self.lags, []
        return lags

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(LAG_PERIOD)
            self.lags.append(max(0.0, time.perf_counter() - t0 - LAG_PERIOD) * 1e6)


async def hol_rank(
    group: Group, size: int, allreduces: int, ping: int, idle_pings: int, requesters: int = 1
) -> dict[str, Any] | None:
    """One rank of the measurement (module docstring); rank 0 returns the report."""
    n = group.world_size
    data = np.ones(max(1, size // 4), dtype=np.float32)
    await group.allreduce(data)  # warm-up: links, scratch windows
    await group.barrier()
    idle, idle_seconds = await _requests(group, requesters, ping, None, idle_pings)
    await group.barrier()
    probe = LagProbe()
    probe.start()
    alone = await _allreduces(group, data, allreduces)
    lag_alone = await probe.stop()
    await group.barrier()
    probe.start()
    bulk = asyncio.ensure_future(_allreduces(group, data, allreduces))
    loaded, loaded_seconds = await _requests(group, requesters, ping, bulk, 0)
    with_pings = await bulk
    lag_loaded = await probe.stop()
    lags = await group.gather_object([summary(lag_alone), summary(lag_loaded)], root=0)
    await group.barrier()
    if group.rank != 0:
        return None
    assert lags is not None
    return {
        "world_size": n,
        "size": data.nbytes,
        "allreduces": allreduces,
        "ping": ping,
        "requesters": requesters,
        "idle_rtt_us": summary(idle),
        "loaded_rtt_us": summary(loaded, top=True),
        "requests_per_s_alone": _rate(idle, idle_seconds),
        "requests_per_s_loaded": _rate(loaded, loaded_seconds),
        "busbw_gbps_alone": busbw(n, data.nbytes * allreduces, alone),
        "busbw_gbps_with_pings": busbw(n, data.nbytes * allreduces, with_pings),
        "lag_us_bulk_alone": [rank[0] for rank in lags],
        "lag_us_with_pings": [rank[1] for rank in lags],
    }


def summary(samples: list[float], top: bool = False) -> dict[str, float]:
    """``n``, ``p50``, ``p99`` (and with ``top`` the ``max``) of ``samples``."""
    out = {"n": len(samples), "p50": percentile(samples, 50), "p99": percentile(samples, 99)}
    if top:
        out["max"] = max(samples) if samples else float("nan")
    return out


def _rate(samples: list[float], seconds: float) -> float:
    """Round trips per second (0.0 when none ran)."""
    return len(samples) / seconds if seconds > 0 else 0.0


def busbw(n: int, nbytes: float, seconds: float) -> float:
    """NCCL-tests bus bandwidth (1e9 B/s) of allreduces moving ``nbytes`` in all among
    ``n`` ranks in ``seconds``."""
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


def main(argv: Sequence[str] | None = None) -> int:
    """A rank started by ``aiocollect run`` (module docstring): join the group from the
    launcher's environment, measure, and on rank 0 write the report to ``--out``."""
    p = argparse.ArgumentParser(prog="python -m aiocollect.bench.hol_ranks")
    p.add_argument("--size", default="64M")
    p.add_argument("--allreduces", type=int, default=8)
    p.add_argument("--ping", default="1K")
    p.add_argument("--idle-pings", type=int, default=300)
    p.add_argument("--requesters", type=int, default=1)
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args(argv)
    sizes = (parse_size(ns.size), ns.allreduces, parse_size(ns.ping), ns.idle_pings)

    async def rank() -> None:
        from aiocollect.api import open_group

        async with open_group(timeout=600.0) as group:
            report = await hol_rank(group, *sizes, ns.requesters)
        if report is not None:
            ns.out.write_text(json.dumps(report))

    if ns.loop == "uvloop":
        import uvloop

        uvloop.run(rank())
    else:
        asyncio.run(rank())
    return 0


if __name__ == "__main__":
    sys.exit(main())
