"""Head-of-line blocking: a small send/recv round trip while bulk allreduces run.

``python -m aiocollect.bench.hol -n 2 --transport tcp --size 64M --allreduces 8``

Every rank runs ``--allreduces`` back-to-back allreduces of ``--size`` bytes; meanwhile
rank 0 sends ``--ping`` bytes to rank 1 and waits for them back, over and over, on the
same group (so on the same links). Before that it times the same round trip with the
group idle, and the allreduces alone, so the report has, from one run: the round trip's
p50/p99 idle and under load, and bulk bandwidth with and without the pings. Prints one
JSON line (``--json F`` also writes it).

``--transport tls`` runs the measurement on a TLS group (mutual certificate
authentication) opened beside the spawned one, with throw-away certificates made for the
run (:mod:`aiocollect.testing.certs`: the ``cryptography`` package or the ``openssl``
command).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from aiocollect.bench.report import load_average
from aiocollect.bench.spec import parse_size
from aiocollect.bench.stats import percentile

if TYPE_CHECKING:
    from aiocollect.group import Group
    from aiocollect.testing.certs import Certs

#: Tag of the round trips; a first element of -1 ends them.
TAG = 7


async def _allreduces(group: Group, data: np.ndarray[Any, Any], count: int) -> float:
    t0 = time.perf_counter()
    for _ in range(count):
        await group.allreduce(data)
    return time.perf_counter() - t0


async def _pinger(
    group: Group, nbytes: int, until: asyncio.Future[Any] | None, count: int
) -> list[float]:
    """Rank 0's round trips (µs): ``count`` of them, or until ``until`` is done."""
    msg = np.zeros(max(1, nbytes // 4), dtype=np.float32)
    back = np.empty_like(msg)
    rtts: list[float] = []
    while (until is None and len(rtts) < count) or (until is not None and not until.done()):
        t0 = time.perf_counter()
        await group.send(msg, 1, tag=TAG)
        await group.recv(back, 1, tag=TAG)
        rtts.append((time.perf_counter() - t0) * 1e6)
    msg[0] = -1
    await group.send(msg, 1, tag=TAG)
    return rtts


async def _ponger(group: Group, nbytes: int) -> None:
    msg = np.empty(max(1, nbytes // 4), dtype=np.float32)
    while True:
        await group.recv(msg, 0, tag=TAG)
        if msg[0] == -1:
            return
        await group.send(msg, 0, tag=TAG)


async def hol_rank(
    group: Group, size: int, allreduces: int, ping: int, idle_pings: int
) -> dict[str, Any] | None:
    """One rank of the measurement (a ``spawn_ranks`` target); rank 0 returns the report."""
    data = np.ones(max(1, size // 4), dtype=np.float32)
    await group.allreduce(data)  # warm-up: links, scratch windows
    await group.barrier()
    idle: list[float] = []
    if group.rank == 0:
        idle = await _pinger(group, ping, None, idle_pings)
    elif group.rank == 1:
        await _ponger(group, ping)
    await group.barrier()
    alone = await _allreduces(group, data, allreduces)
    await group.barrier()
    bulk = asyncio.ensure_future(_allreduces(group, data, allreduces))
    loaded: list[float] = []
    if group.rank == 0:
        loaded = await _pinger(group, ping, bulk, 0)
    elif group.rank == 1:
        await _ponger(group, ping)
    with_pings = await bulk
    await group.barrier()
    if group.rank != 0:
        return None
    n = group.world_size
    return {
        "world_size": n,
        "size": data.nbytes,
        "allreduces": allreduces,
        "ping": ping,
        "idle_rtt_us": _summary(idle),
        "loaded_rtt_us": _summary(loaded, top=True),
        "busbw_gbps_alone": _busbw(n, data.nbytes * allreduces, alone),
        "busbw_gbps_with_pings": _busbw(n, data.nbytes * allreduces, with_pings),
    }


def _summary(samples: list[float], top: bool = False) -> dict[str, float]:
    """``n``, ``p50``, ``p99`` (and with ``top`` the ``max``) of ``samples``."""
    out = {"n": len(samples), "p50": percentile(samples, 50), "p99": percentile(samples, 99)}
    if top:
        out["max"] = max(samples) if samples else float("nan")
    return out


def _busbw(n: int, nbytes: float, seconds: float) -> float:
    """NCCL-tests bus bandwidth (1e9 B/s) of allreduces moving ``nbytes`` in all among
    ``n`` ranks in ``seconds``."""
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


async def tls_hol_rank(
    group: Group, certs: Certs, size: int, allreduces: int, ping: int, idle_pings: int
) -> dict[str, Any] | None:
    """:func:`hol_rank` on a TLS group opened beside ``group``."""
    from aiocollect.api import open_group

    async with open_group(
        group.rank,
        group.world_size,
        store=group.store,
        transport="tls",
        ssl=certs.config(group.rank),
        name="bench-hol-tls",
        timeout=600.0,
    ) as t:
        return await hol_rank(t, size, allreduces, ping, idle_pings)


def _floor_report(n: int, size: int, allreduces: int, ping: int) -> dict[str, Any]:
    """The head-of-line floor's entries for the report (:mod:`aiocollect.bench.hol_floor`):
    its round trip's p50/p99/max, its lag p50/p99 and its bus bandwidth; ``floor_error``
    instead where it cannot run here."""
    from aiocollect.bench import hol_floor

    nbytes = size - size % (4 * n)
    try:
        floor = hol_floor.measure(n, nbytes, allreduces, ping)
    except (ValueError, OSError, RuntimeError) as exc:
        return {"floor_error": str(exc)}
    return {
        "floor_loaded_rtt_us": _summary(floor.rtt_us, top=True),
        "floor_lag_us": _summary(floor.lag_us),
        "floor_busbw_gbps": _busbw(n, nbytes * allreduces, floor.bulk_seconds),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurement in spawned ranks and print its JSON line."""
    from aiocollect.cli.forked import default_start_method
    from aiocollect.testing.certs import make_certs
    from aiocollect.testing.spawn import spawn_ranks

    p = argparse.ArgumentParser(prog="python -m aiocollect.bench.hol")
    p.add_argument("-n", "--nproc", type=int, default=2)
    p.add_argument("--transport", default="tcp", help="auto, tcp, shm or tls")
    p.add_argument("--size", default="64M")
    p.add_argument("--allreduces", type=int, default=8)
    p.add_argument("--ping", default="1K")
    p.add_argument("--idle-pings", type=int, default=300)
    p.add_argument(
        "--floor",
        action="store_true",
        help="then the same measurement with no framework (aiocollect.bench.hol_floor)",
    )
    p.add_argument(
        "--start-method",
        choices=("fork", "exec"),
        default=None,
        help="fork the ranks from a process that imported aiocollect (as aiocollect run "
        "does by default) or start fresh interpreters (default: $AIOCOLLECT_START_METHOD, "
        "else fork)",
    )
    p.add_argument("--json", type=Path)
    ns = p.parse_args(argv)
    method = ns.start_method or default_start_method()
    if ns.nproc < 2:
        p.error("-n must be at least 2")
    start = load_average()

    sizes = (parse_size(ns.size), ns.allreduces, parse_size(ns.ping), ns.idle_pings)

    async def run(tmp: str) -> list[Any]:
        if ns.transport == "tls":
            certs = make_certs(Path(tmp), ns.nproc)
            target: Any = tls_hol_rank
            args: tuple[Any, ...] = (certs, *sizes)
            options: dict[str, Any] = {}
        else:
            target, args, options = hol_rank, sizes, {"transport": ns.transport}
        results: list[Any] = await spawn_ranks(
            ns.nproc,
            target,
            *args,
            timeout=600.0,
            uvloop=True,
            start_method="forkserver" if method == "fork" else "spawn",
            **options,
        )
        return results

    with tempfile.TemporaryDirectory(prefix="aiocollect-hol-") as tmp:
        results = asyncio.run(run(tmp))
    report = {**results[0], "transport": ns.transport, "start_method": method}
    if ns.floor:
        report.update(_floor_report(ns.nproc, *sizes[:3]))
    report.update(loadavg_start=start, loadavg_end=load_average())
    text = json.dumps(report)
    print(text)
    if ns.json is not None:
        ns.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
