"""Elastic soak: SIGKILL a random member of an elastic group, over and over.

A standalone store (`aiocollect store`) and ``--world-size`` members that allreduce in a
loop (checking every sum). Each round the driver waits until every member of the current
generation has done a few allreduces, SIGKILLs a random one, and measures the time from
the kill to the moment each survivor's ``regroup()`` returned (wall clock, comparable
across processes); then it starts a replacement, which the members admit at their next
check of ``joiners()`` (every ``CHECK_EVERY`` allreduces, agreed through rank 0), so the
world size is back for the next round.

Usage::

    python tools/soak_elastic.py                  # 20 kills, 4 members  (make soak-elastic)
    python tools/soak_elastic.py --kills 50 --seed 3 --json soak.json

Prints one line per kill and the distribution (p50, p99, max) of regroup times and of
admission times; exits 1 if a round failed (a wrong sum, a survivor that did not regroup).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import random
import subprocess
import sys
import time
from typing import Any

import numpy as np

import aiocollect as ac

SECRET = "elastic-soak"
COUNT = 1 << 16
CHECK_EVERY = 20


async def _loop(group: ac.Group, conn: Any, ident: str) -> None:
    conn.send(("gen", ident, group.generation, group.rank, group.world_size, time.time()))
    done = 0
    while True:
        try:
            if done % CHECK_EVERY == 0:
                waiting = await group.joiners() if group.rank == 0 else 0
                if await group.broadcast_object(waiting) > 0:
                    group = await group.regroup(timeout=10.0)
                    conn.send(
                        ("gen", ident, group.generation, group.rank, group.world_size, time.time())
                    )
                    done = 0
                    continue
            buf = np.full(COUNT, group.rank + 1.0)
            await group.allreduce(buf)
            n = group.world_size
            if not np.all(buf == n * (n + 1) / 2):
                conn.send(("wrong", ident, group.generation))
            done += 1
            if done == 3:
                conn.send(("looping", ident, group.generation))
        except (ac.PeerError, ac.GroupBrokenError):
            group = await group.regroup(timeout=10.0)
            conn.send(("gen", ident, group.generation, group.rank, group.world_size, time.time()))
            done = 0


async def _member(url: str, rank: int | None, world: int, conn: Any) -> None:
    logging.getLogger("aiocollect").setLevel(logging.ERROR)
    ident = f"m{rank}" if rank is not None else f"j{os.getpid()}"
    if rank is None:
        group = await ac.join_group(url, secret=SECRET, timeout=60.0)
    else:
        group = await ac.open_group(
            rank, world, store=url, secret=SECRET, elastic=True, timeout=30.0
        )
    await _loop(group, conn, ident)


def member(url: str, rank: int | None, world: int, conn: Any) -> None:
    try:
        asyncio.run(_member(url, rank, world, conn))
    except ac.AiocollectError as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Driver:
    def __init__(self, url: str, world: int) -> None:
        self.url, self.world = url, world
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, Any] = {}
        self.conns: dict[Any, str] = {}
        self.gen: dict[str, tuple[int, int, int, float]] = {}  # ident -> gen, rank, size, t
        self.looping: dict[str, int] = {}
        self.failures: list[str] = []

    def start(self, rank: int | None) -> None:
        recv, send = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=member, args=(self.url, rank, self.world, send), daemon=True)
        p.start()
        send.close()
        key = f"m{rank}" if rank is not None else f"j{p.pid}"
        self.procs[key] = p
        self.conns[recv] = key

    def pump(self, until: Any, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while not until():
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError("no progress")
            for conn in mp_connection.wait(list(self.conns), timeout=left):
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    del self.conns[conn]
                    continue
                if msg[0] == "gen":
                    self.gen[msg[1]] = (msg[2], msg[3], msg[4], msg[5])
                elif msg[0] == "looping":
                    self.looping[msg[1]] = msg[2]
                else:
                    self.failures.append(repr(msg))

    def live(self) -> list[str]:
        return [k for k, p in self.procs.items() if p.is_alive()]


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/soak_elastic.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kills", type=int, default=20, help="members killed (default 20)")
    parser.add_argument("--world-size", type=int, default=4, help="members (default 4)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the choice of victim")
    parser.add_argument("--json", default=None, help="write the measurements here")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = dict(os.environ, AIOCOLLECT_SECRET=SECRET)
    store = subprocess.Popen(
        [sys.executable, "-m", "aiocollect", "store", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert store.stdout is not None
    url = "tcp://" + store.stdout.readline().split("listening on ", 1)[1].split()[0]
    d = Driver(url, args.world_size)
    regroup_s: list[float] = []
    admit_s: list[float] = []
    try:
        for r in range(args.world_size):
            d.start(r)
        gen = 0
        for k in range(args.kills):
            live = d.live()
            d.pump(lambda live=live, gen=gen: all(d.looping.get(i) == gen for i in live))
            victim = rng.choice(live)
            d.procs[victim].kill()
            killed = time.time()
            d.procs[victim].join(10)
            survivors = [i for i in live if i != victim]
            gen += 1
            d.pump(lambda s=survivors, gen=gen: all(d.gen.get(i, (-1,))[0] == gen for i in s))
            took = max(d.gen[i][3] for i in survivors) - killed
            regroup_s.append(took)
            d.start(None)  # the replacement
            asked = time.time()
            gen += 1
            d.pump(
                lambda gen=gen: (
                    len([i for i in d.live() if d.gen.get(i, (-1,))[0] == gen]) == args.world_size
                )
            )
            admitted = max(v[3] for v in d.gen.values() if v[0] == gen) - asked
            admit_s.append(admitted)
            print(
                f"kill {k + 1:2d}: {victim:>10s}  regroup {took * 1e3:7.1f} ms  "
                f"replacement admitted after {admitted:5.2f} s (generation {gen})",
                flush=True,
            )
            if d.failures:
                break
    except TimeoutError:
        d.failures.append(f"no progress after {len(regroup_s)} kills")
    finally:
        for p in d.procs.values():
            if p.is_alive():
                p.kill()
            p.join(10)
        store.terminate()
        store.wait(10)

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else float("nan")

    print(
        f"\n{len(regroup_s)} kills, world size {args.world_size}: regroup after a kill "
        f"p50 {pct(regroup_s, 50) * 1e3:.0f} ms, p99 {pct(regroup_s, 99) * 1e3:.0f} ms, "
        f"max {max(regroup_s, default=float('nan')) * 1e3:.0f} ms; admission p50 "
        f"{pct(admit_s, 50):.2f} s, p99 {pct(admit_s, 99):.2f} s (includes the "
        f"replacement's start-up)"
    )
    for f in d.failures:
        print("FAILED:", f)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"regroup_s": regroup_s, "admit_s": admit_s, "failures": d.failures}, fh)
    return 1 if d.failures or len(regroup_s) < args.kills else 0


if __name__ == "__main__":
    sys.exit(main())
