"""Many ranks per process over real TCP links: large groups on one machine.

A group of hundreds or thousands of ranks is ``procs`` processes of ``per`` ranks each,
every rank a group of its own on its process's event loop, linked to the others over TCP
through a standalone ``aiocollect store`` (docs/multinode.md, "Forming large groups")::

    python -m aiocollect.testing.many 4 128            # 512 ranks, links on demand
    python -m aiocollect.testing.many 4 32 --links eager

:func:`open_ranks` opens the ranks of one process; :func:`run_many` starts the store and
the processes, each of which forms its ranks, checks allreduce (4 B and 1 MiB), broadcast,
barrier, alltoall and a split on every rank (exact results), and reports its figures
(each step also as a line on standard error as it ends: a large group's run takes minutes);
:func:`run_many` returns them gathered (:class:`ManyResult`). Alltoall links every pair:
it runs only where each process's descriptor limit holds its ranks' full mesh (else
``alltoall_s`` is absent).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect import _fdlimit
from aiocollect.store import Store, open_store
from aiocollect.transport.tcp_link import TcpLink

#: Elements of the large allreduce (float32: 1 MiB).
LARGE = 1 << 18
#: The figures reported as the mean over the processes (every other: the most of any).
MEAN_FIGURES = frozenset(
    {"store_requests_per_rank", "store_bytes_per_rank", "records_read_per_rank"}
)


async def open_ranks(
    ranks: Sequence[int], world_size: int, stores: Sequence[Store] | None = None, **kwargs: Any
) -> list[ac.Group]:
    """Open ranks ``ranks`` of a group of ``world_size`` on this event loop, at once.

    Args:
        ranks: the ranks this process hosts.
        world_size: the group's size.
        stores: each rank's store (in the order of ``ranks``), or None to give them all
            ``kwargs["store"]``.
        **kwargs: as :func:`aiocollect.open_group` takes them (``store`` at least, unless
            ``stores`` is given).

    Returns:
        The groups, in the order of ``ranks``.

    Raises:
        BaseException: the first rank's error; the ranks that opened are aborted first.
    """
    each: list[dict[str, Any]] = [
        dict(kwargs) if stores is None else {**kwargs, "store": s}
        for s in (stores if stores is not None else [None] * len(ranks))
    ]
    made = await asyncio.gather(
        *(ac.open_group(r, world_size, **e) for r, e in zip(ranks, each, strict=True)),
        return_exceptions=True,
    )
    failed = [g for g in made if isinstance(g, BaseException)]
    groups = [g for g in made if isinstance(g, ac.Group)]
    if failed:
        for g in groups:
            g.abort()
        raise failed[0]
    return groups


class CountedStore(Store):
    """A view of ``inner`` (reading the same data: ``shared_reads`` is the inner store's)
    that counts its requests, the bytes of their keys and values, and the rendezvous
    records it reads. Closing it closes ``inner``."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.timeout = inner.timeout
        self.requests = self.bytes = self.records = 0

    @property
    def shared_reads(self) -> Hashable | None:
        return self.inner.shared_reads

    def _count(self, keys: Sequence[str], values: Sequence[bytes] = ()) -> None:
        self.requests += 1
        self.bytes += sum(len(k) for k in keys) + sum(len(v) for v in values)
        self.records += sum("/rank/" in k for k in keys) if values else 0

    async def set(self, key: str, value: bytes) -> None:
        self._count([key], [value])
        await self.inner.set(key, value)

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        value = await self.inner.get(key, timeout=timeout)
        self._count([key], [value])
        return value

    async def multi_get(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes]:
        values = await self.inner.multi_get(keys, timeout=timeout)
        self._count(keys, values)
        return values

    async def add(self, key: str, amount: int) -> int:
        self._count([key])
        return await self.inner.add(key, amount)

    async def wait(self, keys: Sequence[str], *, timeout: float | None = None) -> None:
        self._count(keys)
        await self.inner.wait(keys, timeout=timeout)

    async def check(self, keys: Sequence[str]) -> list[bool]:
        self._count(keys)
        return await self.inner.check(keys)

    async def delete(self, key: str) -> bool:
        self._count([key])
        return await self.inner.delete(key)

    async def close(self) -> None:
        await self.inner.close()


async def _timed(groups: list[ac.Group], what: Any) -> float:
    start = time.monotonic()
    await asyncio.gather(*(what(g) for g in groups))
    return time.monotonic() - start


def _progress(groups: list[ac.Group], what: str) -> None:
    """One line on standard error for a step this process finished (a large group's run
    takes minutes: which step it is on shows where it waits)."""
    first, last = groups[0].rank, groups[-1].rank
    print(f"many: ranks {first}-{last}: {what}", file=sys.stderr, flush=True)


async def _check(groups: list[ac.Group], world_size: int, alltoall: bool) -> dict[str, float]:
    """Run each check on every rank of this process; the seconds each took here (each
    also reported on standard error as it ends: :func:`_progress`)."""
    figures: dict[str, float] = {}

    async def small(g: ac.Group) -> None:
        x = np.full(1, g.rank + 1, dtype=np.int32)
        await g.allreduce(x)
        assert x[0] == world_size * (world_size + 1) // 2, (g.rank, x)

    async def large(g: ac.Group) -> None:
        x = np.full(LARGE, 1.0, dtype=np.float32)
        await g.allreduce(x)
        assert (x == world_size).all(), (g.rank, x[:4])

    async def broadcast(g: ac.Group) -> None:
        x = np.arange(16, dtype=np.int64) if g.rank == world_size - 1 else np.zeros(16, np.int64)
        await g.broadcast(x, root=world_size - 1)
        assert (x == np.arange(16)).all(), (g.rank, x)

    async def barrier(g: ac.Group) -> None:
        await g.barrier()

    async def exchange(g: ac.Group) -> None:
        out = await g.alltoall(np.arange(world_size, dtype=np.int64) + world_size * g.rank)
        assert (out == np.arange(world_size) * world_size + g.rank).all(), g.rank

    async def split(g: ac.Group) -> None:
        sub = await g.split(g.rank % 2)
        assert sub is not None
        x = np.full(1, g.rank, dtype=np.int64)
        await sub.allreduce(x)
        assert x[0] == sum(range(g.rank % 2, world_size, 2)), (g.rank, x)
        await sub.aclose()

    async def step(name: str, what: Any) -> float:
        secs = await _timed(groups, what)
        _progress(groups, f"{name} {secs:.2f} s")
        return secs

    await step("first allreduce 4 B", small)  # (the first: plans, and the links of sub-steps)
    figures["allreduce_4B_s"] = await step("allreduce 4 B", small)
    await step("first allreduce 1 MiB", large)
    figures["allreduce_1MiB_s"] = await step("allreduce 1 MiB", large)
    figures["broadcast_s"] = await step("broadcast", broadcast)
    figures["barrier_s"] = await step("barrier", barrier)
    figures["links_after_collectives"] = max(len(g._fabric.links) for g in groups)
    figures["sockets_after_collectives"] = max(_sockets(g) for g in groups)
    if alltoall and _mesh_fits(len(groups), world_size):  # (alltoall links every pair)
        figures["alltoall_s"] = await step("alltoall", exchange)
    figures["split_s"] = await step("split", split)
    return figures


def _sockets(g: ac.Group) -> int:
    """The rank's sockets to its peers: a connection per link, and the small-frame lanes
    of those TCP links that carried bulk."""
    return sum(
        2 if isinstance(link, TcpLink) and link.laned else 1 for link in g._fabric.links.values()
    )


def _mesh_fits(per: int, world_size: int) -> bool:
    """Whether this process's descriptor limit holds the full mesh of its ``per`` ranks
    (``world_size - 1`` links each, and the store's connections and listeners)."""
    soft = _fdlimit.limits()
    return soft is None or soft[0] < 0 or per * (world_size + 2) + _fdlimit.SPARE <= soft[0]


async def _child(
    url: str, first: int, per: int, world_size: int, links: str, alltoall: bool
) -> dict[str, Any]:
    start = time.monotonic()
    stores = [
        CountedStore((await open_store(url, rank=r, timeout=600))[0])
        for r in range(first, first + per)
    ]
    try:
        groups = await open_ranks(
            range(first, first + per), world_size, stores, transport="tcp", links=links, timeout=600
        )
        figures: dict[str, Any] = {"formed_s": time.monotonic() - start}
        _progress(groups, f"formed {figures['formed_s']:.2f} s")
        figures["sockets_at_open"] = max(len(g._fabric.links) for g in groups)
        # (formation's store requests per rank, claiming included; bytes of keys and values)
        figures["store_requests_per_rank"] = sum(s.requests for s in stores) / per
        figures["store_bytes_per_rank"] = sum(s.bytes for s in stores) / per
        figures["records_read_per_rank"] = sum(s.records for s in stores) / per
        try:
            figures.update(await _check(groups, world_size, alltoall))
            figures["descriptors_per_rank"] = len(os.listdir("/proc/self/fd")) / per
        finally:
            closing = time.monotonic()
            await asyncio.gather(*(g.aclose() for g in groups))
            figures["close_s"] = time.monotonic() - closing
    finally:
        await asyncio.gather(*(s.close() for s in stores), return_exceptions=True)
    return figures


@dataclass
class ManyResult:
    """What :func:`run_many` measured: the slowest process's seconds for each step (from
    the process's start, then per step), the most links of any rank at open (which are
    its sockets then) and after allreduce, broadcast and barrier, and its most sockets
    then (its links and the small-frame lanes of those that carried bulk; before alltoall
    links every pair), the store requests, bytes and records read per rank while the
    group formed (the mean over every rank), and the wall time of the whole run."""

    ranks: int
    links: str
    figures: dict[str, float]
    wall_s: float


def start_store() -> tuple[subprocess.Popen[str], str]:
    """Start a standalone ``aiocollect store`` on a free loopback port, without a secret.

    Returns:
        The store's process and its URL (``tcp://127.0.0.1:PORT``).

    Raises:
        RuntimeError: the store did not start (its process is reaped).
    """
    store = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aiocollect.store",
            *("--host", "127.0.0.1", "--port", "0", "--insecure"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert store.stdout is not None
    found = re.search(r":(\d+) ", store.stdout.readline())
    if found is None:
        stop_processes([store])
        raise RuntimeError("the store did not start")
    return store, f"tcp://127.0.0.1:{found.group(1)}"


def stop_processes(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Kill those of ``procs`` that still run and reap every one (bounded: 10 s each)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(Exception):
            proc.communicate(timeout=10)


def run_many(
    procs: int, per: int, links: str = "lazy", timeout: float = 900, alltoall: bool = True
) -> ManyResult:
    """Start a standalone store and ``procs`` processes of ``per`` ranks each over TCP
    and run the checks (module docstring) on every rank.

    Args:
        procs: processes.
        per: ranks per process.
        links: ``lazy`` or ``eager`` (``open_group(links=)``).
        timeout: seconds for the whole run.
        alltoall: whether to check alltoall (which links every pair) too.

    Returns:
        The figures.

    Raises:
        RuntimeError: a process failed (its output is in the message) or the run took
            longer than ``timeout``.
    """
    start = time.monotonic()
    store, url = start_store()
    kids: list[subprocess.Popen[str]] = []
    try:
        world = procs * per
        kids = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "aiocollect.testing.many",
                    "--child",
                    url,
                    str(p * per),
                    str(per),
                    str(world),
                    links,
                    str(int(alltoall)),
                ],
                stdout=subprocess.PIPE,  # (the figures; progress and errors: stderr)
                text=True,
            )
            for p in range(procs)
        ]
        outs = [k.communicate(timeout=max(1.0, timeout - (time.monotonic() - start))) for k in kids]
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{procs} x {per} ranks: not done within {timeout} s") from None
    finally:
        stop_processes([*kids, store])
    results: list[dict[str, float]] = []
    for kid, (out, _) in zip(kids, outs, strict=True):
        last = out.strip().splitlines()[-1:] if out else []
        if kid.returncode != 0 or not last or not last[0].startswith("{"):
            raise RuntimeError(
                f"a process failed (exit {kid.returncode}; its errors are on standard "
                f"error):\n{out[-3000:]}"
            )
        results.append(json.loads(last[0]))
    # (store traffic: the mean per rank over every process; the rest: the slowest process)
    figures = {
        k: (statistics.fmean if k in MEAN_FIGURES else max)(r[k] for r in results)
        for k in results[0]
    }
    return ManyResult(procs * per, links, figures, time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring): prints the figures as JSON."""
    args = argv if argv is not None else sys.argv[1:]
    if args[:1] == ["--child"]:
        url, first, per, world, links, every = args[1:7]
        figures = asyncio.run(_child(url, int(first), int(per), int(world), links, every == "1"))
        print(json.dumps(figures), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="python -m aiocollect.testing.many")
    parser.add_argument("procs", type=int)
    parser.add_argument("per", type=int)
    parser.add_argument("--links", choices=("lazy", "eager"), default="lazy")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--no-alltoall", action="store_true", help="skip alltoall")
    ns = parser.parse_args(args)
    result = run_many(ns.procs, ns.per, ns.links, ns.timeout, not ns.no_alltoall)
    shown = {k: round(v, 3) for k, v in result.figures.items()}
    print(json.dumps({"ranks": result.ranks, "links": result.links, **shown}))
    print(f"wall {result.wall_s:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
