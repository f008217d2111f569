"""Elastic data-parallel training: lose a worker, keep training, take a replacement in.

The script is its own launcher: it starts a standalone store (`aiocollect store`, which
outlives every worker), spawns ``--world-size`` workers in an elastic group
(``open_group(..., elastic=True)``), and then:

1. at step ``--kill-at`` one worker dies (SIGKILL, as a crash would);
2. the survivors' allreduce fails; they ``regroup()`` and redo the failed step on their
   shards (the data is re-split over the new world size);
3. the launcher starts a replacement, which waits in ``join_group``; rank 0 sees it with
   ``group.joiners()`` (checked every ``CHECK_EVERY`` steps, agreed on through
   ``broadcast_object``), everyone regroups at that step, and rank 0 hands the model and the
   step number to the newcomer with ``broadcast_object``;
4. at the end every live rank compares its weights (``allgather_object``) and the launcher
   prints whether they are identical.

The model: least squares on a synthetic linear problem (numpy), so the weights every rank
holds are reproducible bit for bit.

Usage::

    python examples/elastic_trainer.py                  # 4 workers, 60 steps
    python examples/elastic_trainer.py --world-size 3 --steps 40 --kill-at 10
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from typing import Any

import numpy as np

import aiocollect as ac

FEATURES = 16
SAMPLES = 4096
LR = 0.1
CHECK_EVERY = 5
SECRET = "elastic-trainer-example"


def batch(step: int, rank: int, world: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """This rank's shard of step ``step``'s batch (the same data whatever the world size:
    the batch is split by rank)."""
    rng = np.random.default_rng(step)
    x = rng.standard_normal((SAMPLES, FEATURES))
    y = x @ np.arange(1.0, FEATURES + 1) + 0.01 * rng.standard_normal(SAMPLES)
    lo, hi = rank * SAMPLES // world, (rank + 1) * SAMPLES // world
    return x[lo:hi], y[lo:hi]


async def train(
    url: str,
    rank: int | None,
    world: int,
    steps: int,
    kill_at: int,
    victim: int,
    step_seconds: float,
) -> None:
    if rank is None:  # a replacement: wait for admission, then take the model from rank 0
        group = await ac.join_group(url, secret=SECRET, timeout=60.0)
        w, step = await group.broadcast_object(None)
        print(
            f"[joiner] admitted as rank {group.rank} of {group.world_size} (generation "
            f"{group.generation}) at step {step}",
            flush=True,
        )
    else:
        group = await ac.open_group(
            rank, world, store=url, secret=SECRET, elastic=True, timeout=30.0
        )
        w, step = np.zeros(FEATURES), 0
    while step < steps:
        try:
            if step % CHECK_EVERY == 0:
                waiting = await group.joiners() if group.rank == 0 else 0
                if await group.broadcast_object(waiting) > 0:  # everyone agrees: regroup
                    group = await group.regroup(timeout=10.0)
                    w, step = await group.broadcast_object((w, step))  # to the joiner(s)
                    print(
                        f"[rank {group.rank}] generation {group.generation}: admitted "
                        f"{group.world_size} ranks now, at step {step}",
                        flush=True,
                    )
                    continue  # the joiner starts at the top of the loop too
            if rank == victim and step == kill_at and group.generation == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash in the middle of training
            x, y = batch(step, group.rank, group.world_size)
            grad = np.array(x.T @ (x @ w - y) * (2.0 / SAMPLES))
            await group.allreduce(grad)
            await asyncio.sleep(step_seconds)  # stands for the forward/backward pass
        except (ac.PeerError, ac.GroupBrokenError) as exc:
            print(f"[rank {group.rank}] step {step}: {type(exc).__name__}; regrouping", flush=True)
            group = await group.regroup(timeout=10.0)
            # The failed step is redone; survivors hold the same w already, the broadcast
            # covers a joiner admitted at this regroup.
            w, step = await group.broadcast_object((w, step))
            print(
                f"[rank {group.rank}] generation {group.generation}: "
                f"{group.world_size} ranks, redoing step {step}",
                flush=True,
            )
            continue
        w = w - LR * grad  # the update after the allreduce succeeded: a failed step leaves w
        step += 1
    digests = await group.allgather_object(hashlib.sha256(w.tobytes()).hexdigest())
    if group.rank == 0:
        loss = float(np.mean((batch(0, 0, 1)[0] @ w - batch(0, 0, 1)[1]) ** 2))
        same = len(set(digests)) == 1
        print(
            f"done: {group.world_size} live ranks, generation {group.generation}, loss "
            f"{loss:.5f}, weights {'identical' if same else 'DIFFERENT'} on every rank",
            flush=True,
        )
    await group.aclose()


def worker(
    url: str,
    rank: int | None,
    world: int,
    steps: int,
    kill_at: int,
    victim: int,
    step_seconds: float,
) -> None:
    asyncio.run(train(url, rank, world, steps, kill_at, victim, step_seconds))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.05,
        help="simulated compute per step (the replacement must arrive before training ends)",
    )
    args = parser.parse_args()
    victim = args.world_size - 2 if args.world_size > 1 else -1
    env = dict(os.environ, AIOCOLLECT_SECRET=SECRET)
    store = subprocess.Popen(
        [sys.executable, "-m", "aiocollect", "store", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert store.stdout is not None
    url = "tcp://" + store.stdout.readline().split("listening on ", 1)[1].split()[0]
    ctx = mp.get_context("spawn")
    common = (args.world_size, args.steps, args.kill_at, victim, args.step_seconds)
    procs = [ctx.Process(target=worker, args=(url, r, *common)) for r in range(args.world_size)]
    try:
        for p in procs:
            p.start()
        if victim >= 0:
            procs[victim].join()  # the crash
            print(
                f"[launcher] worker {victim} died (exit {procs[victim].exitcode}); "
                "starting a replacement",
                flush=True,
            )
            joiner = ctx.Process(target=worker, args=(url, None, *common))
            joiner.start()
            procs.append(joiner)
        for p in procs:
            p.join(120)
        bad = [p.exitcode for i, p in enumerate(procs) if i != victim and p.exitcode != 0]
        return 1 if bad else 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        store.terminate()
        store.wait(10)


if __name__ == "__main__":
    sys.exit(main())
