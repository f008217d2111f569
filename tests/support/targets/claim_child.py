"""A process that claims a rank of a group and then waits to be killed (for the stale-claim
tests): ``python -m tests.support.targets.claim_child SPEC NAME RANK WORLD``.

SPEC is a store URL (``file://``, ``tcp://``, ``redis://``) or ``torch:PORT`` (a c10d
TCPStore client behind :class:`~aiocollect.torch.store.TorchStore`). With RANK 0 it also
publishes a rendezvous record, like a rank killed in the middle of rendezvous. It prints
``claimed <job nonce hex> <pid>`` once its claim is in the store.
"""

from __future__ import annotations

import asyncio
import os
import sys

from aiocollect._deadline import Deadline
from aiocollect.rendezvous import claims
from aiocollect.store import Store, open_store


async def _store(spec: str) -> Store:
    if spec.startswith("torch:"):
        import torch.distributed as dist

        from aiocollect.torch.store import TorchStore

        return TorchStore(
            dist.TCPStore("127.0.0.1", int(spec[6:]), is_master=False, wait_for_workers=False),  # type: ignore[attr-defined]
            timeout=30,
        )
    store, _ = await open_store(spec, rank=1, timeout=30)
    return store


async def main(spec: str, name: str, rank: int, world: int) -> None:
    store = await _store(spec)
    claim = await claims.claim(store, name, rank, world, Deadline.after(30))
    await claim.publish(
        {"rank": rank, "address": "127.0.0.1", "port": 9, "pid": os.getpid(), "hostname": "stale"}
    )
    print("claimed", claim.job.hex(), os.getpid(), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
