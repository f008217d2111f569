"""Two jobs without a job id on one standalone store and group name (the multi-node case:
no launcher gives both nodes' ranks one identity unless the user exports
``AIOCOLLECT_JOB_ID``). Claims alone let a rank of one job take a rank of the other job's
epoch; the group then holds ranks of both jobs and "succeeds" with a mixed result. The
rank that lost its claim now publishes a conflict marker, and every rank of a group with
no job id checks it at the end of rendezvous: the mixed group fails with RendezvousError.

Here the interleaving of a race is made deterministic with a world size of 3 (the group
cannot form before its third rank arrives).
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from aiocollect.store import TCPStore, TCPStoreServer
from tests.support.procs import reap

pytestmark = [pytest.mark.timeout(90), pytest.mark.one_loop]  # real processes

SCRIPT = """
import asyncio, sys
import numpy as np
import aiocollect

async def main() -> None:
    base = int(sys.argv[1])
    print("up", flush=True)
    try:
        async with aiocollect.open_group(name="shared", timeout=20) as group:
            data = np.full(4, base + group.rank, dtype=np.int64)
            await group.allreduce(data)
            print("result", int(data[0]), flush=True)
    except Exception as exc:
        print("error", type(exc).__name__, str(exc).replace("\\n", " "), flush=True)

asyncio.run(main())
"""

NAME = "shared"


async def _rank(port: int, base: int, rank: int) -> asyncio.subprocess.Process:
    env = {
        k: v for k, v in os.environ.items() if k not in ("AIOCOLLECT_JOB_ID", "TORCHELASTIC_RUN_ID")
    }
    env.update(
        AIOCOLLECT_STORE=f"tcp://127.0.0.1:{port}",
        AIOCOLLECT_RANK=str(rank),
        AIOCOLLECT_WORLD_SIZE="3",
        AIOCOLLECT_TRANSPORT="tcp",
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SCRIPT,
        str(base),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    assert await proc.stdout.readline() == b"up\n"
    return proc


async def _last_line(proc: asyncio.subprocess.Process) -> str:
    out, _ = await asyncio.wait_for(proc.communicate(), 40)
    lines = out.decode().strip().splitlines()
    return lines[-1] if lines else ""


async def test_a_group_another_jobs_rank_joined_fails_loudly() -> None:
    """Job A (base 100) has ranks 0 and 2 running when rank 1 of job B (base 200) takes
    rank 1 of A's epoch; A's own rank 1 then finds its rank taken. Before the marker, A's
    ranks 0 and 2 formed a group with B's rank 1 and returned 403 (a mixed sum; A's is
    303). Now all three get RendezvousError naming the conflict, and the next job on the
    same store and name (a later epoch) is not affected by the old marker."""
    procs: list[asyncio.subprocess.Process] = []
    async with TCPStoreServer("127.0.0.1", 0) as server:
        watcher = TCPStore("127.0.0.1", server.port, timeout=20)
        try:
            procs.append(await _rank(server.port, 100, 0))  # A0 claims epoch 0
            await watcher.wait([f"aiocollect/{NAME}/rank/0"])
            procs.append(await _rank(server.port, 200, 1))  # B1 takes rank 1 of it
            await watcher.wait([f"aiocollect/{NAME}/rank/1"])
            a1 = await _rank(server.port, 100, 1)  # A1: its rank is taken
            procs.append(a1)
            lost = await _last_line(a1)
            assert lost.startswith(
                "error RendezvousError rank 1 of group 'shared' is already claimed"
            ), lost
            procs.append(await _rank(server.port, 100, 2))  # A2 completes the group
            outs = [await _last_line(p) for p in (procs[0], procs[1], procs[3])]
            for out in outs:
                assert out.startswith(
                    "error RendezvousError another job is using group "
                    "'shared' on this store (rank 1, pid"
                ), outs
                assert "AIOCOLLECT_JOB_ID" in out, out
            assert await watcher.check([f"aiocollect/{NAME}/conflict/0"]) == [True]
            # A job of its own, later, under the same name on the same store: unaffected.
            procs[:] = [await _rank(server.port, 300, r) for r in range(3)]
            outs = [await _last_line(p) for p in procs]
            assert outs == ["result 903"] * 3, outs
        finally:
            await watcher.close()
            await reap(procs)
