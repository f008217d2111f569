"""Rank processes of the rendezvous tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def reap(procs: Iterable[asyncio.subprocess.Process]) -> None:
    """Kill and wait for every process still running (test cleanup)."""
    for p in procs:
        if p.returncode is None:
            p.kill()
            await p.wait()
