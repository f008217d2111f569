"""Rank processes inside network namespaces (tests/network): started with ``ip netns exec``
running tests/support/targets/netns_rank.py, reporting through JSON lines on stdout."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tests.support import netns

ROOT = Path(__file__).resolve().parents[2]
#: The secret every rank gets unless a test passes its own ``AIOCOLLECT_SECRET``.
JOB_SECRET = "netns-job-secret"
#: ``launch(rank, env)``: start rank ``rank`` in its namespace with ``env`` added.
Launch = Callable[[int, dict[str, str]], Awaitable["Rank"]]


class Rank:
    """A rank process inside a namespace; its stdout is a stream of JSON events."""

    def __init__(self, proc: asyncio.subprocess.Process, rank: int) -> None:
        self.proc = proc
        self.rank = rank
        self.stderr = bytearray()
        self.events: list[dict[str, Any]] = []
        self._drain = asyncio.ensure_future(self._read_stderr())

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(65536):
            self.stderr += chunk

    async def next_event(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                line = await self.proc.stdout.readline()
        except TimeoutError:
            raise AssertionError(
                f"rank {self.rank}: no event within {timeout} s; "
                f"stderr:\n{self.stderr.decode(errors='replace')}"
            ) from None
        if not line:
            await self.proc.wait()
            raise AssertionError(
                f"rank {self.rank} exited ({self.proc.returncode}) without the next event; "
                f"stderr:\n{self.stderr.decode(errors='replace')}"
            )
        event: dict[str, Any] = json.loads(line)
        self.events.append(event)
        return event

    async def expect(self, name: str, timeout: float) -> dict[str, Any]:
        event = await self.next_event(timeout)
        assert event["event"] == name, (self.rank, event, self.stderr.decode(errors="replace"))
        return event

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        self._drain.cancel()


def launcher(topology: netns.Topology, started: list[Rank]) -> Launch:
    """``launch(rank, env)`` for ``topology``'s namespaces; every rank started is appended to
    ``started`` (the caller stops them)."""

    async def start(rank: int, env: dict[str, str]) -> Rank:
        # transport tcp: "auto" would move links between ranks of one host (namespaces
        # share /dev/shm and the boot id) to shared memory, off the network under test.
        # A job across hosts needs a secret (protected mode): every rank gets the same one
        # unless the test passes its own AIOCOLLECT_SECRET ("" for none).
        base = {
            k: v
            for k, v in os.environ.items()
            if k not in ("AIOCOLLECT_SECRET", "AIOCOLLECT_INSECURE")
        }
        full = {
            **base,
            "AIOCOLLECT_RANK": str(rank),
            "AIOCOLLECT_TRANSPORT": "tcp",
            "AIOCOLLECT_WORLD_SIZE": str(len(topology.ns)),
            "AIOCOLLECT_SECRET": JOB_SECRET,
            **env,
        }
        proc = await asyncio.create_subprocess_exec(
            "ip",
            "netns",
            "exec",
            topology.ns[rank],
            sys.executable,
            "-m",
            "tests.support.targets.netns_rank",
            cwd=ROOT,
            env=full,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        started.append(Rank(proc, rank))
        return started[-1]

    return start


async def check_run(
    topology: netns.Topology,
    launch: Any,
    env_for: Any,
    want_address: Any,
    want_links: Any = None,
) -> None:
    """Every rank opens the group at its address (``want_links(rank)``: and with these
    links, see netns_rank), checks its collectives, closes and exits 0."""
    ranks = [await launch(r, env_for(r)) for r in range(len(topology.ns))]
    opened = await events_of_all(ranks, "open", 30)  # the first rank to fail fails the test
    for rank, ev in enumerate(opened):
        assert ev["address"] == want_address(rank), ev
        assert ev["addresses"] == [want_address(r) for r in range(len(ranks))], ev
        if want_links is not None:
            assert ev["links"] == want_links(rank), ev
    await events_of_all(ranks, "checked", 30)
    await events_of_all(ranks, "closed", 30)
    for r in ranks:
        assert await r.proc.wait() == 0, r.stderr.decode(errors="replace")


async def events_of_all(ranks: list[Rank], event: str, timeout: float) -> list[dict[str, Any]]:
    """The next event of every rank, awaited together: the first failure is raised at once."""
    return list(await asyncio.gather(*(r.expect(event, timeout) for r in ranks)))
