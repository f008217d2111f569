"""CPU time per collective operation: two ranks on one event loop over memory links.

Both ranks run in this process, so the process CPU time per operation is what the library
itself costs (argument checks, algorithm choice, fingerprint, schedule, frames, reduction)
with no cross-process scheduling in it; on a loaded machine it varies far less than wall
time. Use it for A/B checks of refactors: run it alternately against two trees, e.g.

    for i in 1 2 3 4; do
      PYTHONPATH=/tmp/before python scripts/op_cost.py
      PYTHONPATH=$PWD python scripts/op_cost.py
    done

Prints one line: ``case=microseconds`` per case (the best of ``--repeats`` runs of
``--iters`` operations after a warm-up). Every result is checked (zeros stay zeros, the
gathered blocks are the ranks' own); a wrong one exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.testing import run_ranks

CASES = (
    "allreduce4",
    "broadcast4",
    "allgather4",
    "allreduce64K",
    "reduce_scatter64K",
    "allreduce1M_ring",
)


def _op(g: ac.Group, case: str) -> tuple[Callable[[], Awaitable[Any]], Callable[[], bool]]:
    """The operation of ``case`` on group ``g`` and a check of its result."""
    if case == "allgather4":
        buf = np.full(1, g.rank, np.float32)
        out = np.empty((g.world_size, 1), np.float32)
        return lambda: g.allgather(buf, out), lambda: out.ravel().tolist() == [0.0, 1.0]
    if case == "reduce_scatter64K":
        send = np.zeros(32768, np.float32)
        dest = np.empty(16384, np.float32)
        return (lambda: g.reduce_scatter(send, dest, algorithm="ring"), lambda: not dest.any())
    elems = {"allreduce4": 1, "broadcast4": 1, "allreduce64K": 16384, "allreduce1M_ring": 1 << 18}[
        case
    ]
    buf = np.zeros(elems, np.float32)
    if case == "broadcast4":
        return lambda: g.broadcast(buf), lambda: not buf.any()
    algorithm = "ring" if case.endswith("_ring") else None
    return lambda: g.allreduce(buf, algorithm=algorithm), lambda: not buf.any()


async def _rank(g: ac.Group, case: str, iters: int) -> float:
    run, ok = _op(g, case)
    for _ in range(20):
        await run()
    await g.barrier()
    start = time.process_time()
    for _ in range(iters):
        await run()
    took = time.process_time() - start
    if not ok():
        raise SystemExit(f"op_cost: {case} gave a wrong result on rank {g.rank}")
    return took / iters * 1e6


async def _main(iters: int, repeats: int) -> str:
    parts = []
    for case in CASES:
        n = iters if case.endswith("4") else max(1, iters // 10)
        best = min([max(await run_ranks(2, _rank, case, n)) for _ in range(repeats)])
        parts.append(f"{case}={best:.1f}")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=3000, help="operations per run (small cases)")
    p.add_argument("--repeats", type=int, default=3, help="runs per case; the best is shown")
    ns = p.parse_args(argv)
    print(asyncio.run(_main(ns.iters, ns.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
