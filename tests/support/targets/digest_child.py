"""Rank 0 of a group that exits the moment it would publish the group's digest (for the
digest tests): ``python -m tests.support.targets.digest_child SPEC NAME WORLD``.

SPEC is a store URL (``file://``, ``tcp://``). It prints ``ready <pid>`` once its store is
open, then opens rank 0 of group NAME (WORLD ranks, TCP links) and calls ``os._exit(9)``
where it would set the group's digest key.
"""

from __future__ import annotations

import asyncio
import os
import sys

import aiocollect as ac
from aiocollect.store import open_store
from aiocollect.testing.many import CountedStore


class DiesAtDigest(CountedStore):
    """A view of ``inner`` whose process exits at the ``set`` of a digest key (every other
    request passes through, counted)."""

    async def set(self, key: str, value: bytes) -> None:
        if key.endswith("/digest"):
            os._exit(9)
        await super().set(key, value)


async def main(spec: str, name: str, world: int) -> None:
    store, _ = await open_store(spec, rank=0, timeout=30)
    print("ready", os.getpid(), flush=True)
    await ac.open_group(0, world, store=DiesAtDigest(store), name=name, transport="tcp", timeout=30)
    print("formed: the digest was never set", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
