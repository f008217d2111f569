"""One rank of the namespace tests, run as ``ip netns exec NS python -m
tests.support.targets.netns_rank``. Configuration comes from the environment (AIOCOLLECT_RANK,
AIOCOLLECT_WORLD_SIZE, AIOCOLLECT_STORE, AIOCOLLECT_IFNAME as usual, plus NETNS_MODE,
NETNS_HOST, NETNS_TIMEOUT, NETNS_COUNT). Every event is one JSON line on stdout:

- ``{"event": "open", "address": ...}`` once the group formed (the address this rank
  published in the store, and every rank's; ``links``: per peer, its link's socket
  family and whether the link is in shared memory);
- mode ``check``: ``{"event": "checked", ...}`` after allreduce and broadcast from every
  root were verified (an assertion error fails the process);
- mode ``loop``: allreduce forever; ``{"event": "ready"}`` after 3 of them, then
  ``{"event": "error", ...}`` with the first exception and when it was raised.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from typing import Any

import msgpack
import numpy as np

import aiocollect as ac

NAME = "netns"


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def addresses(g: ac.Group) -> list[str]:
    out = []
    for r in range(g.world_size):
        rec = msgpack.unpackb(await g.store.get(f"aiocollect/{NAME}/rank/{r}"), raw=False)
        out.append(str(rec["address"]))
    return out


def links(g: ac.Group) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for peer, link in sorted(g._fabric.links.items()):
        transport = getattr(link, "transport", None)
        sock = None if transport is None else transport.get_extra_info("socket")
        family = "none" if sock is None else socket.AddressFamily(sock.family).name
        out[str(peer)] = [family, bool(getattr(link, "shm", False))]
    return out


async def check(g: ac.Group, count: int) -> dict[str, Any]:
    n, r = g.world_size, g.rank
    for size in (1, 1000, count):
        a = np.arange(size, dtype=np.float64) * (r + 1)
        await g.allreduce(a)
        np.testing.assert_array_equal(a, np.arange(size) * (n * (n + 1) // 2))
        for root in range(n):
            b = np.full(size, r, np.int32)
            await g.broadcast(b, root=root)
            assert (b == root).all(), (root, b[:4])
    return {"sizes": [1, 1000, count]}


async def loop(g: ac.Group, count: int) -> dict[str, Any]:
    buf = np.ones(count, np.float32)
    done = 0
    try:
        while True:
            await g.allreduce(buf, algorithm="ring")
            buf[:] = 1
            done += 1
            if done == 3:
                emit("ready", rank=g.rank)
    except ac.AiocollectError as exc:
        cause = exc.__cause__ if isinstance(exc, ac.GroupBrokenError) else None
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "at": time.time(),
            "rank_attr": getattr(exc, "rank", None),
            "ranks": getattr(exc, "ranks", None),
            "cause": type(cause).__name__ if cause else None,
            "done": done,
        }


async def main() -> None:
    mode = os.environ.get("NETNS_MODE", "check")
    timeout = float(os.environ.get("NETNS_TIMEOUT", "20"))
    count = int(os.environ.get("NETNS_COUNT", str(1 << 18)))
    g = await ac.open_group(host=os.environ.get("NETNS_HOST") or None, timeout=timeout, name=NAME)
    everyone = await addresses(g)
    emit("open", rank=g.rank, address=everyone[g.rank], addresses=everyone, links=links(g))
    if mode == "check":
        emit("checked", rank=g.rank, **await check(g, count))
        await g.aclose()
        emit("closed", rank=g.rank)
    else:
        emit("error", rank=g.rank, **await loop(g, count))
        g.abort()
        # Nothing left to learn; do not wait on a store host that may be unreachable.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    asyncio.run(main())
