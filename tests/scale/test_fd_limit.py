"""Rank processes under a low descriptor limit (``ulimit -n``, set in each process with
``resource.setrlimit``): with links on demand the group forms and works; with the full
mesh every rank fails at once with an error naming the limit, the links and what to do,
and the log holds a line or two, not one per failed accept."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from tests.support.procs import reap, run_script

pytestmark = pytest.mark.timeout(90)

N = 12
#: Descriptors the limit leaves beyond the neighbours' links and ``_fdlimit.SPARE``: the
#: listener and the store's connection, with room to spare, and fewer than the full mesh
#: needs (11 links, against at most 7 neighbours at 12 ranks).
EXTRA = 4

SCRIPT = """
import asyncio, logging, resource, sys, time
import numpy as np
import aiocollect as ac
from aiocollect import _fdlimit
from aiocollect.collectives.neighbours import neighbours

rank, n, store, links, low = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
rank, n = int(rank), int(n)
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")

async def main() -> None:
    if low == "1" or (low == "3" and rank == 3):
        per_link = 1  # (a lane only where a descriptor is to spare)
        limit = _fdlimit.open_count() + _fdlimit.SPARE + per_link * len(neighbours(n, rank)) + EXTRA
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    start = time.monotonic()
    try:
        g = await ac.open_group(rank, n, store=store, transport="tcp", links=links,
                                timeout=40, name="fd")
        x = np.full(4, rank + 1.0)
        await g.allreduce(x)
        await g.barrier()
        await g.broadcast(x, root=n - 1)
        print("ok", x[0], len(g.statistics().links), flush=True)
        await g.aclose()
    except Exception as exc:
        print("error", round(time.monotonic() - start, 1), type(exc).__name__, exc, flush=True)

asyncio.run(main())
""".replace("EXTRA", str(EXTRA))


async def _run(tmp_path: Path, links: str, low: str) -> list[str]:
    store = f"file://{tmp_path}/store"
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            SCRIPT,
            str(r),
            str(N),
            store,
            links,
            low,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        for r in range(N)
    ]
    try:
        outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 80)
    finally:
        await reap(procs)
    return [out.decode() for out, _ in outs]


async def test_links_on_demand_fit_under_the_limit(tmp_path: Path) -> None:
    outs = await _run(tmp_path, "lazy", "1")
    for rank, out in enumerate(outs):
        lines = out.strip().splitlines()
        assert lines[-1].startswith("ok"), (rank, out)
        assert float(lines[-1].split()[1]) == N * (N + 1) / 2


async def test_the_full_mesh_fails_fast_naming_the_limit(tmp_path: Path) -> None:
    """Only rank 3's limit is low: every rank fails within seconds, naming it."""
    start = time.monotonic()
    outs = await _run(tmp_path, "eager", "3")
    assert time.monotonic() - start < 30  # not the 40 s deadline
    for rank, out in enumerate(outs):
        result = out.strip().splitlines()[-1]
        assert result.startswith("error"), (rank, out)
        assert "RendezvousError" in result, (rank, out)
        assert "rank 3 ran out of file descriptors" in result, (rank, out)
        assert "RLIMIT_NOFILE" in result, (rank, out)
        assert "ulimit -n" in result, (rank, out)
        assert "links='lazy'" in result, (rank, out)
        assert len([line for line in out.splitlines() if line.startswith("LOG")]) <= 3, out


AFTER_FORMING = """
import asyncio, logging, os, resource, time
import numpy as np
from aiocollect.testing.many import open_ranks

logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
N = 16

async def main() -> None:
    groups = await open_ranks(range(N), N, store="memory://fd-after", transport="tcp",
                              timeout=30)
    limit = len(os.listdir("/proc/self/fd")) + 40  # far fewer than the full mesh needs
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(
        resource.RLIMIT_NOFILE)[1]))
    start = time.monotonic()

    async def one(g):
        try:
            await g.alltoall(np.arange(N, dtype=np.int64))
            return "ok"
        except Exception as exc:
            return f"error {time.monotonic() - start:.1f} {type(exc).__name__} {exc}"

    for line in await asyncio.gather(*(one(g) for g in groups)):
        print(line, flush=True)
    for g in groups:
        g.abort()

asyncio.run(main())
"""


async def test_links_on_demand_beyond_the_limit_fail_fast() -> None:
    """16 ranks on one event loop, their limit lowered after the group formed: the
    alltoall that would link every pair fails on every rank at once naming the limit
    (not accept failures logged in a loop until the deadline)."""
    text = await run_script(AFTER_FORMING, 60)
    results = [line for line in text.splitlines() if line.startswith(("ok", "error"))]
    assert len(results) == 16, text
    for line in results:
        assert line.startswith("error"), text
        assert float(line.split()[1]) < 10, line
        assert "ran out of file descriptors" in line, line
        assert "RLIMIT_NOFILE" in line, line
    assert len([line for line in text.splitlines() if line.startswith("LOG")]) <= 20, text


IN_PROCESS = """
import asyncio, resource, sys
import numpy as np
import aiocollect as ac
from aiocollect.testing import run_ranks

resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

async def body(g):
    x = np.ones(1, np.int64)
    await g.allreduce(x)
    return int(x[0])

print(asyncio.run(run_ranks(64, body, transport="memory", timeout=60)) == [64] * 64)
"""


def test_in_process_links_need_no_descriptors() -> None:
    """64 ranks on one loop over in-process links (64 x 63 of them, which hold no
    descriptor) form under a limit of 256 descriptors: the descriptor check counts
    only links that hold one."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", IN_PROCESS], capture_output=True, text=True, timeout=80
    )
    assert out.stdout.strip() == "True", out.stdout + out.stderr[-3000:]
