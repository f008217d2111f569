"""Python opcodes per small operation on each rank, one process per rank.

Run it with the launcher::

    aiocollect run -n 4 scripts/rank_opcodes.py                 # 4-byte allreduce
    AIOCOLLECT_TRANSPORT=tcp aiocollect run -n 4 scripts/rank_opcodes.py --top 40
    aiocollect run -n 4 scripts/rank_opcodes.py --case barrier --iters 1000

Each rank runs 500 warm-up operations and a barrier, then counts, with ``sys.settrace``
and ``f_trace_opcodes``, every Python opcode its process executes during ``--iters``
operations, and prints the count per operation and its ``--top`` functions. Unlike
``scripts/op_opcodes.py`` (every rank on one event loop, so a frame is sent before its
peer has posted the receive far more often than between processes) the ranks are real
processes and each one is counted on its own: the star's root and its leaves apart
(docs/benchmarks.md, *Twenty-third session*). Tracing slows every rank alike, so the
share of frames that arrive before their receive, and with it the root's count, still
moves by a few percent from run to run; the leaves' counts are steady. The busy-wait
is off (``AIOCOLLECT_SPIN_US=0`` unless set, as in op_opcodes), as it is anyway where
ranks outnumber cores.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import uvloop
from op_opcodes import OpcodeCounter  # (scripts/, the script's directory, is on sys.path)

import aiocollect as ac


async def main(iters: int, case: str, count: int, top: int, lines_of: str | None) -> None:
    async with ac.open_group() as group:
        buf = np.zeros(count, np.float32)
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "allreduce": lambda: group.allreduce(buf),
            "broadcast": lambda: group.broadcast(buf),
            "barrier": lambda: group.barrier(),
        }
        call = calls[case]
        for _ in range(500):
            await call()
        await group.barrier()
        counter = OpcodeCounter(lines_of)
        sys.settrace(counter.trace)
        for _ in range(iters):
            await call()
        sys.settrace(None)
        await group.barrier()
        lines = [f"rank {group.rank} {case}: {counter.opcodes / iters:.0f} opcodes per operation"]
        lines += [f"    {k / iters:7.1f}  {where}" for where, k in counter.by_code.most_common(top)]
        if lines_of:
            lines.append(f"  {lines_of}, per line:")
            lines += [f"    {k / iters:7.1f}  line {n}" for n, k in sorted(counter.by_line.items())]
        await asyncio.sleep(0.05 * group.rank)  # (one rank's lines after another's)
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument(
        "--case", choices=("allreduce", "broadcast", "barrier"), default="allreduce"
    )
    parser.add_argument("--count", type=int, default=1, help="float32 elements (default 1)")
    parser.add_argument("--top", type=int, default=0, help="also list the top functions")
    parser.add_argument(
        "--lines", metavar="QUALNAME", help="and this function's opcodes per line (Quick._go)"
    )
    ns = parser.parse_args()
    uvloop.run(main(ns.iters, ns.case, ns.count, ns.top, ns.lines))
