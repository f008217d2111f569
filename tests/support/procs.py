"""Rank processes: reaping the rendezvous tests' subprocesses, running a script in a fresh
interpreter, and waiting for and checking the spawned ranks of the process-killing failure
tests."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable
from typing import Any

from aiocollect.store import open_store


async def reap(procs: Iterable[asyncio.subprocess.Process]) -> None:
    """Kill and wait for every process still running (test cleanup)."""
    for p in procs:
        if p.returncode is None:
            p.kill()
            await p.wait()


async def run_script(script: str, timeout: float) -> str:
    """Run ``python -c script`` and return its standard output and error, together, once it
    exited (killed and reaped after ``timeout`` seconds: TimeoutError then)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        await reap([proc])
    return out.decode()


async def wait_ready(store_url: str, n: int, key: str) -> None:
    """Wait (30 s at most) until every one of ``n`` spawned ranks has set ``key/<rank>``
    in the store at ``store_url`` (the targets of tests/support/targets/failure.py do once
    they are in their loop)."""
    store, _ = await open_store(store_url, rank=1, timeout=30)
    try:
        await store.wait([f"{key}/{r}" for r in range(n)], timeout=30)
    finally:
        await store.close()


def check_killed(outcomes: list[Any], victim: int, killed_at: float) -> None:
    """``victim`` died; every survivor reported PeerDisconnected naming it within a second,
    and its later calls failed from that cause (GroupBrokenError caused by it)."""
    assert outcomes[victim][0] == "died"
    for rank, out in enumerate(outcomes):
        if rank == victim:
            continue
        assert out[0] == "ok", out
        res = out[1]
        assert res["error"] == "PeerDisconnected", res
        assert res["rank_attr"] == victim, res
        assert f"rank {victim}" in res["message"]
        assert res["at"] - killed_at < 1.0, f"rank {rank} took {res['at'] - killed_at:.2f}s"
        assert res["later"] == "PeerDisconnected"
