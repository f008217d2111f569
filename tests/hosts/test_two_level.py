"""Two-level allreduce across hosts built from network namespaces: every rank a real
process, ranks of one namespace on one host (shared memory), hosts joined over TCP by
veths to a bridge; what crosses between hosts is counted on the host interfaces.

Each test is one job of ``aiocollect.testing.hosts_rank check``: allreduces of 4 B,
64 KiB and 4 MiB (int64 exact, float32 within rounding), alone and several in flight; the
digests of every result agree on every rank; a broadcast from every root and barriers;
then one 16 MiB allreduce whose
between-host bytes are within 10 % of 2(H-1)/H x H x size.
"""

from __future__ import annotations

from typing import Any

import pytest

from aiocollect.testing import hosts

pytestmark = [pytest.mark.timeout(120)]

MODULE = "aiocollect.testing.hosts_rank"
MiB16 = 16 * 1024 * 1024


async def _check(host_of: list[int], loop: str = "asyncio") -> list[dict[str, Any]]:
    with hosts.Hosts(host_of) as hs:
        results = await hs.run(MODULE, ["check", loop], timeout=100)
    digests = results[0]["digests"]
    for res in results:
        assert res["digests"] == digests, res["rank"]
        assert res["topology"] == {**results[0]["topology"], **_mine(res)}
    return results


def _mine(res: dict[str, Any]) -> dict[str, Any]:
    return {k: res["topology"][k] for k in ("host", "local_rank")}


def _between_hosts(results: list[dict[str, Any]]) -> float:
    """Bytes that left every host during the 16 MiB allreduce, in multiples of it."""
    return float(sum(res["tx_bytes"] for res in results)) / MiB16


@pytest.mark.parametrize(("placement", "loop"), [("blocked", "asyncio"), ("cyclic", "uvloop")])
async def test_four_hosts_of_two(placement: str, loop: str) -> None:
    host_of = hosts.placement(4, 2, placement)
    results = await _check(host_of, loop)
    topo = results[0]["topology"]
    want_hosts = [[r for r in range(8) if host_of[r] == h] for h in range(4)]
    assert topo["hosts"] == want_hosts
    assert topo["leaders"] == [h[0] for h in want_hosts]
    assert topo["two_level"]
    assert set(results[0]["chosen"].values()) == {"two_level"}
    # 2(H-1)/H x H x size = 6 x 16 MiB (a flat ring: 7x blocked, 14x cyclic)
    assert 6 * 0.9 <= _between_hosts(results) <= 6 * 1.1
    for res in results:
        assert res["same_host_bytes"] > 0
        assert res["cross_host_bytes"] > 0


async def test_uneven_hosts() -> None:
    """Two hosts of three ranks and one of one, interleaved: the lone rank holds a piece of
    every inter-host ring."""
    host_of = [0, 1, 2, 0, 1, 0, 1]
    results = await _check(host_of)
    assert results[0]["topology"]["hosts"] == [[0, 3, 5], [1, 4, 6], [2]]
    assert set(results[0]["chosen"].values()) == {"two_level"}
    assert 4 / 3 * 0.9 * 3 <= _between_hosts(results) <= 4 / 3 * 1.1 * 3


@pytest.mark.parametrize("host_of", [[0, 0, 0], [0, 1, 2]], ids=["one-host", "one-per-host"])
async def test_flat_where_two_levels_do_not_pay(host_of: list[int]) -> None:
    results = await _check(host_of)
    assert not results[0]["topology"]["two_level"]
    assert "two_level" not in results[0]["chosen"].values()
