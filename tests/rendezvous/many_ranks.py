"""Form one group of PROCS processes x RANKS ranks each (TCP links between every pair:
``links="eager"``) through a standalone ``aiocollect store``, pass a barrier, close; print
the time (docs/multinode.md, "Forming large groups")::

    PYTHONPATH=. python tests/rendezvous/many_ranks.py 4 32
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import aiocollect as ac


async def _ranks(url: str, first: int, count: int, world_size: int) -> None:
    groups = await asyncio.gather(
        *(
            ac.open_group(r, world_size, store=url, transport="tcp", timeout=600, links="eager")
            for r in range(first, first + count)
        )
    )
    await asyncio.gather(*(g.barrier() for g in groups))
    await asyncio.gather(*(g.aclose() for g in groups))


def main(argv: list[str]) -> int:
    if argv[0] == "child":
        url, first, count, world_size = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        asyncio.run(_ranks(url, first, count, world_size))
        return 0
    procs, per = int(argv[0]), int(argv[1])
    store = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aiocollect.store",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--insecure",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    kids: list[subprocess.Popen[bytes]] = []
    try:
        assert store.stdout is not None
        found = re.search(r":(\d+) ", store.stdout.readline())
        assert found is not None
        url = f"tcp://127.0.0.1:{found.group(1)}"
        start = time.monotonic()
        kids = [
            subprocess.Popen(
                [sys.executable, __file__, "child", url, str(p * per), str(per), str(procs * per)]
            )
            for p in range(procs)
        ]
        codes = [k.wait(timeout=900) for k in kids]
        print(f"{procs} x {per} ranks: exit codes {codes}, {time.monotonic() - start:.1f} s")
        return max(codes)
    finally:
        procs_left: list[subprocess.Popen[bytes] | subprocess.Popen[str]] = [*kids, store]
        for proc in procs_left:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
