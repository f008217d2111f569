"""Elastic regroup at scale: how long the survivors of a large group take to regroup after
one rank is killed.

``PROCS`` processes of ``PER`` ranks each (on one event loop per process, over TCP, through
a standalone ``aiocollect store``) and one process with one more rank form an elastic
group and run 4-byte allreduces back to back; the lone rank's process is killed
(SIGKILL) once every rank is ready. Every survivor catches the failure, calls
``regroup()``, checks one allreduce on the next generation (exact) and reports when its
failure came and when ``regroup()`` returned. Printed: the world size, the slowest
survivor's seconds from the kill to its failure and to its ``regroup()`` returning, and
the new world size::

    PYTHONPATH=. python tools/regroup_scale.py 3 85      # 256 ranks, 255 survive

Not a test: one measurement (docs/failures.md, *Elastic groups*, quotes it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.testing.many import open_ranks, start_store, stop_processes


async def _member(g: ac.Group, failed: list[float]) -> dict[str, Any]:
    x = np.ones(1, np.int64)
    try:
        while True:
            x[:] = 1
            await g.allreduce(x)
    except (ac.PeerError, ac.GroupBrokenError):
        failed.append(time.time())
    nxt = await g.regroup(timeout=60.0)
    back = time.time()
    y = np.ones(1, np.int64)
    await nxt.allreduce(y)
    assert y[0] == nxt.world_size, (nxt.rank, y)
    return {"back": back, "world": nxt.world_size, "next": nxt}


async def _child(url: str, first: int, per: int, world: int) -> dict[str, Any]:
    groups = await open_ranks(
        range(first, first + per), world, store=url, transport="tcp", elastic=True, timeout=120
    )
    await asyncio.gather(*(g.allreduce(np.ones(1, np.int64)) for g in groups))
    print(json.dumps({"event": "ready"}), flush=True)
    if per == 1 and first == world - 1:  # the victim: waits to be killed
        await asyncio.sleep(3600)
    failed: list[float] = []
    done = await asyncio.gather(*(_member(g, failed) for g in groups))
    await asyncio.gather(*(d["next"].aclose() for d in done))
    return {
        "failed": max(failed),
        "back": max(d["back"] for d in done),
        "world": done[0]["world"],
    }


def run(procs: int, per: int) -> dict[str, Any]:
    """Form ``procs`` x ``per`` + 1 ranks, kill the last one, measure the regroup."""
    world = procs * per + 1
    store, url = start_store()
    starts = [(p * per, per) for p in range(procs)] + [(world - 1, 1)]
    kids = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", url, str(first), str(n), str(world)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for first, n in starts
    ]
    try:
        start = time.monotonic()
        for kid in kids:
            assert kid.stdout is not None
            line = kid.stdout.readline()
            if "ready" not in line:
                raise RuntimeError(f"a process failed before it was ready: {line!r}")
        formed = time.monotonic() - start
        time.sleep(1.0)
        killed = time.time()
        kids[-1].send_signal(signal.SIGKILL)
        outs = [kid.communicate(timeout=300)[0] for kid in kids[:-1]]
        reports = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    finally:
        stop_processes([*kids, store])
    return {
        "ranks": world,
        "formed_s": round(formed, 2),
        "kill_to_failure_s": round(max(r["failed"] for r in reports) - killed, 3),
        "kill_to_regrouped_s": round(max(r["back"] for r in reports) - killed, 3),
        "next_world": reports[0]["world"],
    }


def main() -> int:
    """The command line (module docstring)."""
    args = sys.argv[1:]
    if args[:1] == ["--child"]:
        url, first, per, world = args[1:5]
        report = asyncio.run(_child(url, int(first), int(per), int(world)))
        print(json.dumps(report), flush=True)
        return 0
    parser = argparse.ArgumentParser(
        prog="python tools/regroup_scale.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "procs", type=int, help="processes of PER ranks each (besides the lone one)"
    )
    parser.add_argument("per", type=int, help="ranks per process")
    ns = parser.parse_args(args)
    print(json.dumps(run(ns.procs, ns.per)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
