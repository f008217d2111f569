"""Collectives through a userspace fault proxy on every rank-to-rank link (no root needed):
correct results under delay, jitter and emulated loss; a stalled link gives PeerTimeout at
the deadline on every rank, naming the stalled peer; a cut link gives every rank a PeerError
well before the deadline."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.store import MemoryStore
from aiocollect.testing.faultproxy import LinkFaults
from aiocollect.testing.proxynet import ProxyNetwork

pytestmark = pytest.mark.timeout(60)

WAN = LinkFaults(delay=0.020, jitter=0.005, loss=0.05, rto=0.2)
_names = itertools.count()


@pytest.fixture
async def network() -> AsyncIterator[ProxyNetwork]:
    store = MemoryStore(f"network-faults-{next(_names)}", timeout=30)
    net = ProxyNetwork(store, seed=1234)
    try:
        yield net
    finally:
        await net.close()
        await store.close()


class Arrival:
    """Every rank arrives; the last one runs ``action`` before anyone goes on (in-loop, so
    the fault is armed before any rank starts the next collective)."""

    def __init__(self, n: int, action: Callable[[], None]) -> None:
        self.n = n
        self.action = action
        self.count = 0
        self.go = asyncio.Event()

    async def arrive(self) -> None:
        self.count += 1
        if self.count == self.n:
            self.action()
            self.go.set()
        await self.go.wait()


def _root_cause(exc: BaseException) -> BaseException:
    if isinstance(exc, ac.GroupBrokenError) and exc.__cause__ is not None:
        return exc.__cause__
    return exc


# -- correctness under delay and loss -----------------------------------------------------


async def _check_collectives(g: ac.Group, counts: list[int]) -> float:
    n, r = g.world_size, g.rank
    start = time.monotonic()
    for count in counts:
        a = np.arange(count, dtype=np.float32) + r
        await g.allreduce(a)
        np.testing.assert_array_equal(a, n * np.arange(count, dtype=np.float32) + n * (n - 1) // 2)
        b = np.full(count, r * 10 + 1, np.int32)
        await g.broadcast(b, root=n - 1)
        assert (b == (n - 1) * 10 + 1).all()
        out = await g.allgather(np.full(count, r, np.int16))
        for peer in range(n):
            assert (out[peer] == peer).all()
        # several collectives in flight at once interleave on the delayed links
        x = np.full(count, 1.0 + r, np.float64)
        y = np.full(count, r, np.int64)
        z = np.full(max(count // 4, 1), r, np.float32)
        await asyncio.gather(g.allreduce(x, op=ac.MAX), g.broadcast(y, root=1), g.allreduce(z))
        assert (x == n).all()
        assert (y == 1).all()
        assert (z == n * (n - 1) // 2).all()
    return time.monotonic() - start


@pytest.mark.parametrize(
    ("world_size", "counts"),
    [
        (3, [1, 1000, 100_000, 1 << 20]),  # 1 MiB float32 = 4 MiB
        (4, [3, 5000, 3 << 19]),  # 6 MiB
    ],
)
async def test_collectives_correct_with_delay_and_loss(
    network: ProxyNetwork, world_size: int, counts: list[int]
) -> None:
    network.set_faults(WAN)
    name = f"wan-{world_size}"
    await network.run_ranks(world_size, _check_collectives, counts, name=name, timeout=30)
    links = list(itertools.combinations(range(world_size), 2))
    stats = [network.link(a, b, name).statistics() for a, b in links]
    assert sum(sum(s["lost"].values()) for s in stats) > 0, stats  # loss really happened
    assert all(sum(s["forwarded"].values()) > 0 for s in stats), stats


async def test_delay_is_really_applied(network: ProxyNetwork) -> None:
    network.set_faults(LinkFaults(delay=0.050))

    async def barriers_time(g: ac.Group) -> float:
        await g.barrier()
        start = time.monotonic()
        for _ in range(10):
            await g.barrier()
        return time.monotonic() - start

    # Barrier i needs the peer's message sent after the peer left barrier i-1: one one-way
    # delay per barrier, give or take the first one.
    times = await network.run_ranks(2, barriers_time, name="delay", timeout=30)
    assert min(times) >= 9 * 0.050, times
    assert max(times) < 10 * 0.050 + 1.0, times


# -- stalled link: PeerTimeout at the deadline --------------------------------------------

DEADLINE = 2.0
#: the library probes liveness for 0.5 s after a deadline; then ABORTs travel; the
#: machine may be busy
SLACK = 4.0


def _fault_run(
    arm: Callable[[], None], call: Callable[[ac.Group], Any], world_size: int, deadline: float
) -> Callable[[ac.Group], Any]:
    """A rank body: warm every link, arm the fault (last rank to arrive), run ``call``
    and a barrier, and return the exception raised (if any) with when it was raised."""
    arrival = Arrival(world_size, arm)

    async def body(g: ac.Group) -> dict[str, Any]:
        await g.allreduce(np.ones(1024, np.float32))  # every link carries traffic
        await arrival.arrive()
        start = time.monotonic()
        try:
            await call(g)
            # A rank may finish legitimately (its sends sit in socket buffers, what it
            # needs came another way): the next collective then needs the broken link.
            await g.barrier(timeout=deadline)
        except ac.AiocollectError as exc:
            return {"exc": exc, "start": start, "at": time.monotonic()}
        return {"exc": None, "start": start, "at": time.monotonic()}

    return body


COLLECTIVES: dict[str, Callable[[ac.Group], Any]] = {
    "allreduce-ring": lambda g: g.allreduce(
        np.ones(1 << 20, np.float32), algorithm="ring", timeout=DEADLINE
    ),
    "allreduce-halving": lambda g: g.allreduce(
        np.ones(1 << 16, np.float32), algorithm="halving_doubling", timeout=DEADLINE
    ),
    "broadcast-pipeline": lambda g: g.broadcast(
        np.ones(1 << 20, np.float32), root=0, algorithm="pipeline", timeout=DEADLINE
    ),
    "allgather-ring": lambda g: g.allgather(
        np.ones(1 << 18, np.float32), algorithm="ring", timeout=DEADLINE
    ),
}


_stall_results: dict[tuple[str, int, int, int], list[dict[str, Any]]] = {}


async def _stall_run(
    network: ProxyNetwork, which: str, n: int, a: int, b: int
) -> list[dict[str, Any]]:
    """Stall link a-b mid-collective; every rank's outcome. Cached: the contract test and
    the blame-precision test look at the same run (each such run costs the deadline)."""
    key = (which, n, a, b)
    if key not in _stall_results:
        _stall_results[key] = await _stall_once(network, which, n, a, b)
    return _stall_results[key]


async def _stall_once(
    network: ProxyNetwork, which: str, n: int, a: int, b: int
) -> list[dict[str, Any]]:
    def arm() -> None:  # stall once 64 KiB of the next collective crossed link a-b
        network.link(a, b).stall("both", after_bytes=64 << 10)

    body = _fault_run(arm, COLLECTIVES[which], n, DEADLINE)
    try:
        results: list[dict[str, Any]] = await network.run_ranks(
            n, body, name=f"stall-{which}", timeout=30
        )
    finally:
        network.link(a, b).resume()
    assert [what for _, what in network.link(a, b).fired][:1] == ["stall both"]
    return results


@pytest.mark.parametrize("which", ["allreduce-ring", "allgather-ring"])
async def test_stalled_link_gives_peer_timeout_at_the_deadline(
    network: ProxyNetwork, which: str
) -> None:
    n, a, b = 3, 0, 1
    results = await _stall_run(network, which, n, a, b)
    for rank, res in enumerate(results):
        exc = _root_cause(res["exc"])
        took = res["at"] - res["start"]
        assert isinstance(exc, ac.PeerTimeout), (rank, repr(res["exc"]))
        assert DEADLINE * 0.9 <= took <= DEADLINE + SLACK, (rank, took, exc)
        # Blame, if any, lands on the stalled link's ends.
        assert set(exc.ranks) <= {a, b}, (rank, exc)


@pytest.mark.parametrize("which", ["allreduce-ring", "allgather-ring"])
async def test_stalled_link_blame_is_precise(network: ProxyNetwork, which: str) -> None:
    """Each end of the stalled link names the other; the bystander names an end, never
    itself (docs/network-faults.md, findings 1 and 2: a bystander's relayed blame of an
    end waits for that end's own probe)."""
    n, a, b = 3, 0, 1
    results = await _stall_run(network, which, n, a, b)
    for rank, res in enumerate(results):
        exc = _root_cause(res["exc"])
        assert isinstance(exc, ac.PeerTimeout)
        assert exc.ranks, (rank, exc)
        assert rank not in exc.ranks, (rank, exc)
        if rank in (a, b):
            assert exc.ranks == [b if rank == a else a], (rank, exc)


# -- cut link: PeerError well before the deadline -----------------------------------------


@pytest.mark.parametrize(
    ("which", "a", "b", "reset"),
    [
        ("allreduce-ring", 0, 2, True),
        ("allreduce-halving", 0, 1, False),  # 3 ranks: 0 and 1 fold, so link 0-1 carries data
        ("allgather-ring", 1, 2, True),
        ("broadcast-pipeline", 0, 1, True),  # the root's own link: even the root must fail
    ],
)
async def test_cut_link_gives_peer_error_on_every_rank(
    network: ProxyNetwork, which: str, a: int, b: int, reset: bool
) -> None:
    n = 3
    long_deadline = 20.0

    def arm() -> None:
        network.link(a, b).cut(reset=reset, after_bytes=32 << 10)

    def call(g: ac.Group) -> Any:
        return COLLECTIVES[which](g)

    body = _fault_run(arm, call, n, long_deadline)
    results = await network.run_ranks(n, body, name=f"cut-{which}", timeout=long_deadline)
    fired = network.link(a, b).fired
    assert fired, fired
    assert fired[0][1] == ("reset" if reset else "close"), fired
    cut_at = fired[0][0]
    for rank, res in enumerate(results):
        exc = _root_cause(res["exc"])
        assert isinstance(exc, ac.PeerError), (rank, repr(res["exc"]))
        assert not isinstance(exc, ac.PeerTimeout), (rank, exc)
        # detected from the socket, not by the (20 s) deadline
        assert res["at"] - cut_at < 5.0, (rank, res["at"] - cut_at, exc)
        if rank in (a, b):
            assert isinstance(exc, ac.PeerDisconnected), (rank, exc)
            assert exc.rank == (b if rank == a else a), (rank, exc)
