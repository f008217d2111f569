"""Soak test: SIGKILL a random rank of a running allreduce loop, over and over.

Each run spawns ``--world-size`` rank processes (``aiocollect.testing.spawn_ranks``) that
allreduce in a loop. Once every rank has finished a few allreduces (each publishes its
readiness in the store; the driver waits on the store), the driver waits a random moment,
SIGKILLs a random rank and records, for every survivor, the time from the kill to the
exception its collective raised. A run fails when a survivor does not raise
``PeerDisconnected`` naming the victim (``.rank``), or does not finish at all.

A survivor whose collective completed just before the failure reached it learns of it
from its next call, which raises ``GroupBrokenError`` with that ``PeerDisconnected`` as
``__cause__`` (the documented contract). Such survivors are counted apart ("told between
collectives") and accepted, unless ``--strict``.

Usage::

    python examples/soak_kill.py                  # 100 runs, 4 ranks
    python examples/soak_kill.py --runs 20 --seed 7 --json soak.json

Prints one line per run, then the distribution of detection times (p50, p99, max) and
the number of failed runs; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.store import open_store
from aiocollect.testing import spawn_ranks

SIZES = (256, 4096, 1 << 16, 1 << 18, 1 << 20)  # float32 elements: 1 KiB .. 4 MiB
READY = "soak/ready"


async def allreduce_loop(g: ac.Group, size: int, verbose: bool) -> dict[str, Any]:
    """Rank body (module level, so spawned processes can import it): allreduce until the
    group breaks; publish readiness after 3 allreduces; report the first error and when
    it was raised (``time.time()``, comparable across processes)."""
    if not verbose:  # every survivor logs "group broken" otherwise
        logging.getLogger("aiocollect").setLevel(logging.ERROR)
    buf = np.ones(size, np.float32)
    done = 0
    try:
        while True:
            await g.allreduce(buf)
            if buf[0] != g.world_size:
                return {
                    "error": "WrongResult",
                    "message": f"{buf[0]}",
                    "at": time.time(),
                    "rank_attr": None,
                    "done": done,
                }
            buf[:] = 1
            done += 1
            if done == 3:
                await g.store.set(f"{READY}/{g.rank}", b"1")
    except ac.AiocollectError as exc:
        at = time.time()
        cause = exc.__cause__
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "at": at,
            "rank_attr": getattr(exc, "rank", None),
            "done": done,
            "cause": type(cause).__name__ if cause is not None else None,
            "cause_rank": getattr(cause, "rank", None),
        }


async def wait_ready(store_url: str, world_size: int, timeout: float) -> None:
    store, _ = await open_store(store_url, rank=1, timeout=timeout)
    try:
        await store.wait([f"{READY}/{r}" for r in range(world_size)], timeout=timeout)
    finally:
        await store.close()


async def one_run(world_size: int, rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    size = rng.choice(SIZES)
    victim = rng.randrange(world_size)
    pause = rng.uniform(0.0, args.max_pause)
    job = spawn_ranks(
        world_size,
        allreduce_loop,
        size,
        args.verbose,
        timeout=args.timeout,
        transport=args.transport,
    )
    try:
        await wait_ready(job.store, world_size, args.timeout)
        await asyncio.sleep(pause)  # the random moment (not a synchronisation)
        killed_at = time.time()
        job.kill(victim)
        outcomes = await job.outcomes()
    finally:
        job.terminate()
    detections: dict[int, float] = {}
    problems: list[str] = []
    between: list[int] = []
    for rank, out in enumerate(outcomes):
        if rank == victim:
            continue
        if out[0] != "ok":
            problems.append(f"rank {rank}: {out[0]} {out[1:]}")
            continue
        res = out[1]
        detections[rank] = res["at"] - killed_at
        if res["error"] == "PeerDisconnected" and res["rank_attr"] == victim:
            continue
        if (
            res["error"] == "GroupBrokenError"
            and res["cause"] == "PeerDisconnected"
            and res["cause_rank"] == victim
        ):
            between.append(rank)
            if not args.strict:
                continue
        problems.append(
            f"rank {rank}: {res['error']} (rank={res['rank_attr']}, cause "
            f"{res['cause']} rank={res['cause_rank']}): {res['message']}"
        )
    return {
        "size": size,
        "victim": victim,
        "pause": pause,
        "detections": detections,
        "problems": problems,
        "between": between,
    }


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def main(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    print(
        f"soak_kill: {args.runs} runs, {args.world_size} ranks, transport {args.transport}, "
        f"seed {seed}, python {platform.python_version()}, {os.cpu_count()} cpus",
        flush=True,
    )
    samples: list[float] = []
    runs: list[dict[str, Any]] = []
    failed = 0
    told_between = 0
    started = time.monotonic()
    for i in range(args.runs):
        try:
            run = await one_run(args.world_size, rng, args)
        except Exception as exc:  # a run that could not even start counts as failed
            run = {
                "size": None,
                "victim": None,
                "pause": 0.0,
                "detections": {},
                "problems": [f"driver: {type(exc).__name__}: {exc}"],
                "between": [],
            }
        runs.append(run)
        times = list(run["detections"].values())
        samples.extend(times)
        failed += bool(run["problems"])
        told_between += len(run["between"])
        worst = f"{max(times) * 1000:7.1f} ms" if times else "      -   "
        status = "ok" if not run["problems"] else "FAIL " + "; ".join(run["problems"])
        if run["between"] and not run["problems"]:
            status += f" (ranks {run['between']} told between collectives)"
        print(
            f"run {i + 1:3d}/{args.runs}: kill rank {run['victim']} "
            f"(size {run['size']}, +{run['pause'] * 1000:3.0f} ms) detected in <= {worst}"
            f"  {status}",
            flush=True,
        )
    elapsed = time.monotonic() - started
    ms = [t * 1000 for t in samples]
    summary = {
        "runs": args.runs,
        "world_size": args.world_size,
        "seed": seed,
        "transport": args.transport,
        "survivor_samples": len(ms),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms) if ms else float("nan"),
        "failed_runs": failed,
        "told_between_collectives": told_between,
        "seconds": elapsed,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    print(
        f"\ndetection time (kill -> survivor's exception), {len(ms)} survivors: "
        f"p50 {summary['p50_ms']:.1f} ms, p99 {summary['p99_ms']:.1f} ms, "
        f"max {summary['max_ms']:.1f} ms"
    )
    print(
        f"survivors told between collectives (GroupBrokenError caused by "
        f"PeerDisconnected naming the victim): {told_between}"
    )
    print(
        f"failed runs (a survivor without PeerDisconnected naming the victim): {failed}"
        f" of {args.runs}; {elapsed:.0f} s"
    )
    if args.json:  # written off the loop, like any file I/O in a coroutine
        report = json.dumps({"summary": summary, "runs": runs}, indent=1)
        await asyncio.to_thread(Path(args.json).write_text, report)
    return 1 if failed else 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--max-pause",
        type=float,
        default=0.2,
        help="kill at a random moment up to this many seconds after readiness",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per run")
    p.add_argument("--transport", default="tcp", help="tcp (default) or auto")
    p.add_argument("--json", help="write every sample and the summary here")
    p.add_argument("--verbose", action="store_true", help="let the ranks log their failures")
    p.add_argument(
        "--strict",
        action="store_true",
        help="also fail runs where a survivor learnt of the kill from its next "
        "call (GroupBrokenError caused by PeerDisconnected)",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
