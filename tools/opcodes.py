"""Python opcodes and calls per operation on each rank, one process per rank.

Deterministic where timings are not: use it for A/B checks of the per-operation path
(a change that adds or removes work shows as a change of the count, whatever the load of
the machine). Run it with the launcher::

    aiocollect run -n 4 tools/opcodes.py                          # 4-byte allreduce
    AIOCOLLECT_TRANSPORT=tcp aiocollect run -n 4 tools/opcodes.py --top 40
    aiocollect run -n 4 tools/opcodes.py --case barrier --iters 1000
    aiocollect run -n 2 tools/opcodes.py --size 16M --iters 50     # per-piece cost of bulk
    aiocollect run -n 4 tools/opcodes.py --lines Quick._go         # one function, per line

Each rank runs ``--warmup`` operations and a barrier, then counts, with ``sys.settrace``
and ``f_trace_opcodes``, every Python opcode and call its process executes during
``--iters`` operations, and prints the counts per operation, its ``--top`` functions and,
with ``--lines``, that function's opcodes per line. Every rank is a real process counted on
its own, so a star's root and its leaves show apart. Tracing slows every rank alike, so
the share of frames that arrive before their receive is posted, and with it the root's
count, still moves by a few percent from run to run; the leaves' counts are steady. The
busy-wait is off (``AIOCOLLECT_SPIN_US=0`` unless set) so that the count does not depend
on timing, as it is anyway where ranks outnumber cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

os.environ.setdefault("AIOCOLLECT_SPIN_US", "0")

import numpy as np
import uvloop

import aiocollect as ac
from aiocollect.bench.spec import parse_size


class OpcodeCounter:
    """A ``sys.settrace`` function counting opcodes and calls, per function too."""

    def __init__(self, lines_of: str | None = None) -> None:
        self.opcodes = 0
        self.calls = 0
        self.by_code: Counter[str] = Counter()
        #: with ``lines_of`` (a function's qualified name), its opcodes per line as well
        self.lines_of = lines_of
        self.by_line: Counter[int] = Counter()

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        """The global trace function: counts the call, traces its frame's opcodes."""
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


async def main(ns: argparse.Namespace) -> None:
    async with ac.open_group() as group:
        buf = np.zeros(max(1, parse_size(ns.size) // 4), np.float32)
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "allreduce": lambda: group.allreduce(buf),
            "broadcast": lambda: group.broadcast(buf),
            "barrier": lambda: group.barrier(),
        }
        call = calls[ns.case]
        for _ in range(ns.warmup):
            await call()
        await group.barrier()
        counter = OpcodeCounter(ns.lines)
        sys.settrace(counter.trace)
        for _ in range(ns.iters):
            await call()
        sys.settrace(None)
        await group.barrier()
        per = ns.iters
        lines = [
            f"rank {group.rank} {ns.case}: {counter.opcodes / per:.0f} opcodes "
            f"{counter.calls / per:.1f} calls per operation"
        ]
        lines += [
            f"    {k / per:7.1f}  {where}" for where, k in counter.by_code.most_common(ns.top)
        ]
        if ns.lines:
            lines.append(f"  {ns.lines}, per line:")
            lines += [f"    {k / per:7.1f}  line {n}" for n, k in sorted(counter.by_line.items())]
        await asyncio.sleep(0.05 * group.rank)  # (one rank's lines after another's)
        print("\n".join(lines), flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiocollect run -n N tools/opcodes.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--case", choices=("allreduce", "broadcast", "barrier"), default="allreduce"
    )
    parser.add_argument("--size", default="4", help="bytes (float32), e.g. 4, 4K, 16M (default 4)")
    parser.add_argument("--iters", type=int, default=2000, help="operations counted (2000)")
    parser.add_argument("--warmup", type=int, default=500, help="operations first (500)")
    parser.add_argument("--top", type=int, default=0, help="also list the top K functions")
    parser.add_argument(
        "--lines", metavar="QUALNAME", help="and this function's opcodes per line (Quick._go)"
    )
    return parser


if __name__ == "__main__":
    uvloop.run(main(_parser().parse_args()))
