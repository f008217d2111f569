"""Ranks on separate network stacks: one Linux network namespace per rank, joined by veth
pairs to a bridge in a hub namespace. Each rank listens on its own address (chosen with
AIOCOLLECT_IFNAME, or an explicit IPv6 host=); collectives are checked across namespaces,
and a rank's interface is taken down mid-collective. Needs root and ``ip netns``; the
rank processes are started with ``ip netns exec`` and report through JSON lines on stdout."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.network import netns

ROOT = Path(__file__).resolve().parents[2]
STORE_PORT = 29577  # each namespace has its own port space: no clash possible
JOB_SECRET = "netns-job-secret"

_why_not = netns.unavailable()
pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture(scope="module", autouse=True)
def _netns_available() -> None:
    if _why_not is not None:
        pytest.skip(f"needs root and ip netns: {_why_not}")
    netns.remove_leftovers()


@pytest.fixture
def topology() -> Iterator[netns.Topology]:
    with netns.Topology(3) as topo:
        yield topo


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


@pytest.fixture
async def launch(topology: netns.Topology) -> AsyncIterator[Any]:
    started: list[Rank] = []

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
            "tests.network.netns_rank",
            cwd=ROOT,
            env=full,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        started.append(Rank(proc, rank))
        return started[-1]

    yield start
    for r in started:
        await r.stop()


async def _check_run(
    topology: netns.Topology,
    launch: Any,
    env_for: Any,
    want_address: Any,
    want_links: Any = None,
) -> None:
    """Every rank opens the group at its address (``want_links(rank)``: and with these
    links, see netns_rank), checks its collectives, closes and exits 0."""
    ranks = [await launch(r, env_for(r)) for r in range(len(topology.ns))]
    opened = await _all(ranks, "open", 30)  # the first rank to fail fails the test
    for rank, ev in enumerate(opened):
        assert ev["address"] == want_address(rank), ev
        assert ev["addresses"] == [want_address(r) for r in range(len(ranks))], ev
        if want_links is not None:
            assert ev["links"] == want_links(rank), ev
    await _all(ranks, "checked", 30)
    await _all(ranks, "closed", 30)
    for r in ranks:
        assert await r.proc.wait() == 0, r.stderr.decode(errors="replace")


def _v4_env(topology: netns.Topology, **extra: str) -> dict[str, str]:
    """A rank's environment over the namespaces' IPv4 network (the store on namespace 0,
    addresses from ``netns.IFNAME``), plus ``extra``."""
    return {
        "AIOCOLLECT_STORE": f"tcp://{topology.v4(0)}:{STORE_PORT}",
        "AIOCOLLECT_IFNAME": netns.IFNAME,
        **extra,
    }


async def _all(ranks: list[Rank], event: str, timeout: float) -> list[dict[str, Any]]:
    """The next event of every rank, awaited together: the first failure is raised at once."""
    return list(await asyncio.gather(*(r.expect(event, timeout) for r in ranks)))


async def test_allreduce_broadcast_across_namespaces_ipv4_ifname(
    topology: netns.Topology, launch: Any
) -> None:
    def env(rank: int) -> dict[str, str]:
        return _v4_env(topology, NETNS_MODE="check")

    await _check_run(topology, launch, env, topology.v4)


async def test_allreduce_broadcast_across_namespaces_ipv6(
    topology: netns.Topology, launch: Any
) -> None:
    store = f"tcp://[{topology.v6(0)}]:{STORE_PORT}"

    def env(rank: int) -> dict[str, str]:
        return {"AIOCOLLECT_STORE": store, "NETNS_HOST": topology.v6(rank), "NETNS_MODE": "check"}

    await _check_run(topology, launch, env, topology.v6)


async def test_auto_across_namespaces_links_over_tcp_and_shared_memory(
    topology: netns.Topology, launch: Any
) -> None:
    """``auto`` between namespaces of one kernel: the records say one host (same hostname
    and boot id), but each namespace has its own abstract Unix socket names, so dialling
    a peer's Unix socket fails and the link connects over TCP (its veth address), then
    moves to shared memory as on one host (one pid namespace)."""

    def env(rank: int) -> dict[str, str]:
        return _v4_env(topology, AIOCOLLECT_TRANSPORT="auto", NETNS_MODE="check")

    def links(rank: int) -> dict[str, list[Any]]:
        return {str(p): ["AF_INET", True] for p in range(len(topology.ns)) if p != rank}

    await _check_run(topology, launch, env, topology.v4, links)


async def test_ipv6_store_without_host_publishes_a_routable_address(
    topology: netns.Topology, launch: Any
) -> None:
    store = f"tcp://[{topology.v6(0)}]:{STORE_PORT}"

    def env(rank: int) -> dict[str, str]:
        return {"AIOCOLLECT_STORE": store, "NETNS_MODE": "check", "NETNS_TIMEOUT": "5"}

    await _check_run(topology, launch, env, topology.v6)


DEADLINE = 3.0
SLACK = 4.0  # liveness probe (0.5 s), ABORT relay, a loaded 2-core machine


async def test_interface_down_mid_collective_fails_every_rank(
    topology: netns.Topology, launch: Any
) -> None:
    victim = 2

    def env(rank: int) -> dict[str, str]:
        return _v4_env(
            topology, NETNS_MODE="loop", NETNS_TIMEOUT=str(DEADLINE), NETNS_COUNT=str(1 << 18)
        )

    ranks = [await launch(r, env(r)) for r in range(len(topology.ns))]
    await _all(ranks, "open", 30)
    await _all(ranks, "ready", 30)
    down_at = time.time()
    topology.link_down(victim)
    errors = await _all(ranks, "error", DEADLINE + SLACK + 5)
    for err in errors:  # shown with -s or on failure
        print(f"rank {err['rank']}: +{err['at'] - down_at:.2f} s {err['type']}: {err['message']}")
    for rank, err in enumerate(errors):
        took = err["at"] - down_at
        kind = err["cause"] if err["type"] == "GroupBrokenError" else err["type"]
        assert kind in ("PeerTimeout", "PeerDisconnected"), (rank, err)
        assert took <= DEADLINE + SLACK, (rank, took, err)
        if rank == victim:  # it hears nothing either: it times out, blaming the others
            assert kind == "PeerTimeout", err
            assert took >= DEADLINE * 0.5, (took, err)
        else:
            assert err["rank_attr"] == victim, (rank, err)
