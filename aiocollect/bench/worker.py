"""One rank of a benchmark: ``python -m aiocollect.bench.worker --backend B ...``.

Started by :mod:`aiocollect.bench.runner` (one process per rank and per round) or run in
the ``aiocollect bench`` process itself when it joins a multi-node run (``--store``,
``--rank``). Rank 0 prints a progress line per case to stderr (tagged with ``--name``, by
default the backend; ``aiocollect/tcp`` when ``aiocollect bench --compare`` measures two
transports) and writes the records of its rounds as JSON to ``--result``. A spawned
worker exits on its own when its parent dies, so an interrupted benchmark leaves no rank
behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from aiocollect.bench.backends import AiocollectBackend, GlooBackend
from aiocollect.bench.spec import Case
from aiocollect.bench.stats import progress_line
from aiocollect.bench.sweep import Backend, SweepConfig, idle_lag, measure

T = TypeVar("T")

#: Exit status of a worker whose parent went away.
ORPHANED = 3


@dataclass(frozen=True)
class RankOptions:
    """How a rank joins its group (the same for every rank)."""

    transport: str = "tcp"
    chunk_bytes: int | None = None
    algorithm: str | None = None
    timeout: float = 120.0
    loop: str = "asyncio"


def encode(cfg: SweepConfig, opts: RankOptions) -> str:
    """The JSON passed to worker processes."""
    sweep = asdict(cfg)
    sweep["cases"] = [[c.collective, c.size, c.concurrency] for c in cfg.cases]
    return json.dumps({"sweep": sweep, "options": asdict(opts)})


def decode(text: str) -> tuple[SweepConfig, RankOptions]:
    doc = json.loads(text)
    sweep = dict(doc["sweep"])
    sweep["cases"] = [Case(str(c), int(s), int(k)) for c, s, k in sweep["cases"]]
    return SweepConfig(**sweep), RankOptions(**doc["options"])


async def sweep(
    backend: Backend, cfg: SweepConfig, label: str, name: str | None = None
) -> dict[str, Any]:
    """Measure every case once (one round); rank 0's result holds the records.

    ``name`` tags the progress lines (default: the backend's name).
    """
    records = []
    for case in cfg.cases:
        record = await measure(backend, case, cfg)
        if record is not None:
            records.append(record)
            print(
                progress_line(name or backend.name, label, record, backend.world_size),
                file=sys.stderr,
                flush=True,
            )
    # The idle floor of the loop lag comes last: idling first slowed the first case
    # (bench/sweep.py, "Why a warm-up by time").
    idle = await idle_lag(backend) if cfg.lag_probe else None
    return {
        "backend": backend.name,
        "label": label,
        "idle_lag_us": idle,
        "records": records,
        "loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
    }


async def aiocollect_rounds(
    rank: int,
    world_size: int,
    store: str,
    cfg: SweepConfig,
    opts: RankOptions,
    labels: Sequence[str],
    name: str | None = None,
) -> list[dict[str, Any]]:
    """Open one aiocollect group and run one round per label in it (``name``: see
    :func:`sweep`)."""
    from aiocollect.api import open_group

    async with open_group(
        rank,
        world_size,
        store=store,
        transport=opts.transport,
        chunk_bytes=opts.chunk_bytes,
        timeout=opts.timeout,
        name="bench",
    ) as group:
        backend = AiocollectBackend(group, opts.algorithm)
        rounds = [await sweep(backend, cfg, label, name) for label in labels]
        for one in rounds:  # the size the group chose when none was given
            one["chunk_bytes"] = group.chunk_bytes
        return rounds


def gloo_round(
    rank: int,
    world_size: int,
    init_method: str,
    cfg: SweepConfig,
    opts: RankOptions,
    label: str,
    name: str | None = None,
) -> dict[str, Any]:
    """Join a torch.distributed gloo group through ``init_method`` and run one round."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=opts.timeout),
    )
    try:
        return asyncio.run(sweep(GlooBackend(torch, rank, world_size), cfg, label, name))
    finally:
        dist.destroy_process_group()


def run_loop(loop: str, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on uvloop (``loop == "uvloop"``) or the default asyncio loop."""
    if loop == "uvloop":
        import uvloop

        result: T = uvloop.run(coro)
        return result
    return asyncio.run(coro)


def _watch_parent(parent: int | None) -> None:
    """Exit (status ``ORPHANED``) when the parent process goes away (e.g. it was killed by
    SIGKILL, or interrupted while starting this rank), checked now and every 0.5 s.
    ``parent`` is the pid of the process that started this one (``--parent``): a parent
    that died while this rank was still importing is noticed too (``os.getppid()`` is
    then already the reaper's pid). None: whatever parent this rank has now."""
    if parent is None:
        parent = os.getppid()
    elif os.getppid() != parent:
        os._exit(ORPHANED)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(ORPHANED)

    threading.Thread(target=watch, name="bench-parent-watch", daemon=True).start()


def write_result(path: Path, rounds: list[dict[str, Any]]) -> None:
    """Write atomically, so the parent never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rounds))
    tmp.replace(path)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a spawned rank; returns its exit status."""
    parser = argparse.ArgumentParser(prog="python -m aiocollect.bench.worker")
    parser.add_argument("--backend", choices=("aiocollect", "gloo"), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument(
        "--rendezvous", required=True, help="aiocollect store URL or gloo init_method"
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--name", help="tag of the progress lines (default: the backend)")
    parser.add_argument("--parent", type=int, help="pid of the process that started it")
    ns = parser.parse_args(argv)
    _watch_parent(ns.parent)
    cfg, opts = decode(ns.config)
    try:
        if ns.backend == "aiocollect":
            rounds = run_loop(
                opts.loop,
                aiocollect_rounds(
                    ns.rank, ns.world_size, ns.rendezvous, cfg, opts, [ns.label], ns.name
                ),
            )
        else:
            rounds = [
                gloo_round(ns.rank, ns.world_size, ns.rendezvous, cfg, opts, ns.label, ns.name)
            ]
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the parent reports
        return 130
    if ns.rank == 0:
        write_result(ns.result, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
