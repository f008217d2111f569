"""Python opcodes per small operation and rank: deterministic, unlike timings.

Two ranks run in this process over real sockets (``--transport tcp``, or ``auto`` for
shared memory); after a warm-up, ``sys.settrace`` with ``f_trace_opcodes`` counts every
Python opcode and call executed while both ranks run ``--iters`` operations, divided by
the operations and the ranks. The busy-wait is switched off (``AIOCOLLECT_SPIN_US=0``)
so that the count does not depend on timing. Usage::

    python scripts/op_opcodes.py                      # every case, N=2, tcp
    python scripts/op_opcodes.py -n 4 --transport auto allreduce4
    python scripts/op_opcodes.py --uvloop --transport auto --iters 10 allreduce16M

Prints ``case: opcodes calls`` per operation and rank. Use it for A/B checks of the
per-operation path (docs/benchmarks.md, "Small operations, third round"), but not for
changes in *when* frames are sent: with both ranks on one loop a frame sent in the call
lands before the other rank's call has posted its receive, which two processes seldom do
(benchmarks.md, "Twelfth session"; use ``scripts/op_latency.py`` for those).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import numpy as np

os.environ.setdefault("AIOCOLLECT_SPIN_US", "0")

import aiocollect as ac
from aiocollect.store import MemoryStore

CASES = ("allreduce4", "allreduce4K", "broadcast4", "barrier", "sendrecv4")
#: Elements of the allreduce cases; ``allreduce16M`` (not run by default) counts the
#: per-piece cost of bulk: with 1 MiB chunks, 16 pieces per operation and rank at N=2.
SIZES = {"allreduce4K": 1024, "allreduce16M": 4 << 20}
_names = itertools.count()


class OpcodeCounter:
    """A ``sys.settrace`` function counting opcodes and calls, per function too
    (``scripts/rank_opcodes.py`` uses it as well)."""

    def __init__(self, lines_of: str | None = None) -> None:
        self.opcodes = 0
        self.calls = 0
        self.by_code: Counter[str] = Counter()
        #: with ``lines_of`` (a function's qualified name), its opcodes per line as well
        self.lines_of = lines_of
        self.by_line: Counter[int] = Counter()

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            self.calls += 1
            frame.f_trace_opcodes = True
            return self._local
        return None

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.opcodes += 1
            code = frame.f_code
            self.by_code[f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_qualname}"] += 1
            if code.co_qualname == self.lines_of:
                self.by_line[frame.f_lineno] += 1
        return self._local


def _op(g: ac.Group, case: str) -> Callable[[], Awaitable[Any]]:
    if case == "barrier":
        return g.barrier
    if case == "sendrecv4":
        buf = np.zeros(1, np.float32)
        if g.rank == 0:
            return lambda: g.send(buf, 1)
        if g.rank == 1:
            return lambda: g.recv(buf, 0)

        async def idle() -> None:
            return None

        return idle
    buf = np.zeros(SIZES.get(case, 1), np.float32)
    if case == "broadcast4":
        return lambda: g.broadcast(buf)
    return lambda: g.allreduce(buf)


async def _count(n: int, transport: str, case: str, iters: int, counter: OpcodeCounter) -> None:
    name = f"opc-{next(_names)}"
    ready = asyncio.Barrier(n)
    done = asyncio.Barrier(n)

    async def one(rank: int) -> None:
        async with ac.open_group(
            rank, n, store=MemoryStore(name), transport=transport, name=name
        ) as g:
            run = _op(g, case)
            for _ in range(5 if case in SIZES and SIZES[case] > 1 << 16 else 200):
                await run()
            await g.barrier()
            if await ready.wait() == 0:
                sys.settrace(counter.trace)
            await ready.wait()
            for _ in range(iters):
                await run()
            if await done.wait() == 0:
                sys.settrace(None)
            await done.wait()

    await asyncio.gather(*(one(r) for r in range(n)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--top", type=int, default=0, help="also list the top functions")
    ns = parser.parse_args()
    if ns.uvloop:
        import uvloop

        uvloop.install()
    for case in ns.cases:
        counter = OpcodeCounter()
        asyncio.run(_count(ns.n, ns.transport, case, ns.iters, counter))
        per = ns.iters * (2 if case == "sendrecv4" else ns.n)
        ops, calls = counter.opcodes / per, counter.calls / per
        print(f"{case}: {ops:.0f} opcodes {calls:.1f} calls per op and rank", flush=True)
        for where, k in counter.by_code.most_common(ns.top):
            print(f"    {k / per:7.1f}  {where}")


if __name__ == "__main__":
    main()
