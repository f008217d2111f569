"""A rank script for launcher tests: everything from the environment, one allreduce."""

import asyncio

import numpy as np

import aiocollect as ac


async def main() -> None:
    async with ac.open_group(timeout=60) as group:
        buf = np.array([group.rank + 1.0])
        await group.allreduce(buf)
        print(f"rank={group.rank} size={group.world_size} sum={buf[0]:g}", flush=True)


asyncio.run(main())
