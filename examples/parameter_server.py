"""An async parameter server on aiocollect: rank 0 serves, the other ranks are workers.

Workers push gradients with ``send`` and pull fresh weights with ``recv``, each on its own
schedule; the server handles requests from any worker as they arrive (``recv(src=None)``),
applies every gradient at once, and keeps serving while a periodic task on the *same event
loop* broadcasts a checkpoint of the weights to everyone. That is the point: point-to-point
traffic, collectives and unrelated coroutines all interleave on one loop.

Run: ``aiocollect run -n 4 examples/parameter_server.py``. A server fronted by TCP that
answers pulls while every rank runs bulk allreduces, and times them:
``examples/parameter_server_load.py``.
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

import aiocollect as ac

PUSH, PULL, WEIGHTS, DONE = 1, 2, 3, 4
DIM = 64


def target() -> np.ndarray:
    return np.linspace(-1.0, 1.0, DIM)


async def server(group: ac.Group, steps: int, rounds: int) -> None:
    weights = np.zeros(DIM)
    grad = np.empty(DIM)
    workers = group.world_size - 1
    active, served, applied = workers, 0, 0

    async def checkpoints() -> None:
        for _ in range(rounds):
            await group.broadcast(weights.copy(), root=0)

    ckpt = asyncio.create_task(checkpoints())
    while active:
        kind = np.empty(1, np.int64)
        src = await group.recv(kind, tag=PULL)  # every request starts with a header
        if kind[0] == PUSH:
            await group.recv(grad, src, tag=PUSH)
            weights -= 0.2 * grad
            applied += 1
        elif kind[0] == PULL:
            await group.send(weights, src, tag=WEIGHTS)
            served += 1
        else:
            active -= 1
    await ckpt
    err = float(np.abs(weights - target()).max())
    print(
        f"server: applied {applied} gradients, served {served} pulls, max error {err:.2e}",
        flush=True,
    )
    if err > 1e-2:
        raise SystemExit(f"parameter server did not converge (max error {err:.3f})")


async def worker(group: ac.Group, steps: int, rounds: int) -> None:
    rng = np.random.default_rng(group.rank)
    weights = np.empty(DIM)

    async def follow_checkpoints() -> None:
        buf = np.empty(DIM)
        for _ in range(rounds):
            await group.broadcast(buf, root=0)

    follower = asyncio.create_task(follow_checkpoints())
    for _ in range(steps):
        await group.send(np.array([PULL]), 0, tag=PULL)
        await group.recv(weights, 0, tag=WEIGHTS)
        noise = rng.normal(0, 0.01, DIM)
        grad = (weights - target()) / (group.world_size - 1) + noise / steps
        await group.send(np.array([PUSH]), 0, tag=PULL)
        await group.send(grad, 0, tag=PUSH)
    await group.send(np.array([DONE]), 0, tag=PULL)
    await follower
    print(f"worker {group.rank}: {steps} steps done", flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5, help="checkpoint broadcasts")
    args = parser.parse_args()
    async with ac.open_group() as group:
        if group.world_size < 2:
            raise SystemExit("run with at least 2 ranks")
        role = server if group.rank == 0 else worker
        await role(group, args.steps, args.rounds)


if __name__ == "__main__":
    asyncio.run(main())
