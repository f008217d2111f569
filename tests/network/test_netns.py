"""Ranks on separate network stacks: one Linux network namespace per rank, joined by veth
pairs to a bridge in a hub namespace. Each rank listens on its own address (chosen with
AIOCOLLECT_IFNAME, or an explicit IPv6 host=); collectives are checked across namespaces,
and a rank's interface is taken down mid-collective. Needs root and ``ip netns``; the
rank processes are started with ``ip netns exec`` and report through JSON lines on stdout."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import netns
from tests.support.netns_ranks import check_run, events_of_all

STORE_PORT = 29577  # each namespace has its own port space: no clash possible

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


def _v4_env(topology: netns.Topology, **extra: str) -> dict[str, str]:
    """A rank's environment over the namespaces' IPv4 network (the store on namespace 0,
    addresses from ``netns.IFNAME``), plus ``extra``."""
    return {
        "AIOCOLLECT_STORE": f"tcp://{topology.v4(0)}:{STORE_PORT}",
        "AIOCOLLECT_IFNAME": netns.IFNAME,
        **extra,
    }


async def test_allreduce_broadcast_across_namespaces_ipv4_ifname(
    topology: netns.Topology, launch: Any
) -> None:
    def env(rank: int) -> dict[str, str]:
        return _v4_env(topology, NETNS_MODE="check")

    await check_run(topology, launch, env, topology.v4)


async def test_allreduce_broadcast_across_namespaces_ipv6(
    topology: netns.Topology, launch: Any
) -> None:
    store = f"tcp://[{topology.v6(0)}]:{STORE_PORT}"

    def env(rank: int) -> dict[str, str]:
        return {"AIOCOLLECT_STORE": store, "NETNS_HOST": topology.v6(rank), "NETNS_MODE": "check"}

    await check_run(topology, launch, env, topology.v6)


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

    await check_run(topology, launch, env, topology.v4, links)


async def test_ipv6_store_without_host_publishes_a_routable_address(
    topology: netns.Topology, launch: Any
) -> None:
    store = f"tcp://[{topology.v6(0)}]:{STORE_PORT}"

    def env(rank: int) -> dict[str, str]:
        return {"AIOCOLLECT_STORE": store, "NETNS_MODE": "check", "NETNS_TIMEOUT": "5"}

    await check_run(topology, launch, env, topology.v6)


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
    await events_of_all(ranks, "open", 30)
    await events_of_all(ranks, "ready", 30)
    down_at = time.time()
    topology.link_down(victim)
    errors = await events_of_all(ranks, "error", DEADLINE + SLACK + 5)
    for err in errors:  # shown with -s or on failure
        print(f"rank {err['rank']}: +{err['at'] - down_at:.2f} s {err['type']}: {err['message']}")
    for rank, err in enumerate(errors):
        took = err["at"] - down_at
        kind = err["cause"] if err["type"] == "GroupBrokenError" else err["type"]
        assert kind in ("PeerTimeout", "PeerDisconnected"), (rank, err)
        assert took <= DEADLINE + SLACK, (rank, took, err)
        if rank == victim:  # it hears nothing either: it times out, blaming the others,
            # unless it finds them unreachable first (AIOCOLLECT_LINK_SILENCE, 3 s)
            if kind == "PeerTimeout":
                assert took >= DEADLINE * 0.5, (took, err)
            else:
                assert "unreachable" in err["message"], err
                assert err["rank_attr"] != victim, err
        else:
            assert err["rank_attr"] == victim, (rank, err)
