"""Elastic groups with real processes over real sockets and a standalone store: SIGKILL a
member mid-allreduce and the survivors regroup and sum exactly; joiners are admitted; kills
down to min_size; kills inside regroup(); a joiner that dies while waiting; secrets."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from tests.support.elastic import SECRET, Procs
from tests.support.targets import elastic as targets

pytestmark = pytest.mark.timeout(60)

#: From the kill to the survivors' regroup() returning (the issue's bound; ~35 ms measured).
REGROUP_BOUND = 2.0


def _members(
    procs: Procs, url: str, world: int, target: Callable[..., Any] = targets.member, **kw: object
) -> None:
    for r in range(world):
        procs.start(r, target, url, r, world, SECRET, **kw)
    procs.wait("up", world)


def test_kill_mid_allreduce_survivors_regroup_and_sum(procs: Procs, store_url: str) -> None:
    _members(procs, store_url, 4)
    procs.wait("looping", 4)
    killed_at = procs.kill(2)
    got = procs.wait("regrouped", 3)
    assert sorted((m[1], m[3]) for m in got) == [(0, 0), (1, 1), (3, 2)]  # order kept
    assert {(m[2], m[4]) for m in got} == {(1, 3)}  # generation 1, world size 3
    assert max(m[5] for m in got) - killed_at < REGROUP_BOUND
    assert {m[3] for m in procs.wait("summed", 3)} == {3}
    procs.wait("closed", 3)


def test_silent_member_dropped_at_the_timeout(procs: Procs, store_url: str) -> None:
    """A frozen member (SIGSTOP) is not known dead: the others wait for it until regroup's
    timeout, then form without it; resumed, it learns it was left out."""
    _members(procs, store_url, 3, group_timeout=2.0, regroup_timeout=1.5)
    procs.wait("looping", 3)
    os.kill(procs.procs[2].pid, signal.SIGSTOP)
    try:
        got = procs.wait("regrouped", 2)
    finally:
        os.kill(procs.procs[2].pid, signal.SIGCONT)
    assert sorted((m[1], m[3], m[4]) for m in got) == [(0, 0, 2), (1, 1, 2)]
    assert min(m[6] for m in got) >= 1.4  # waited for the silent one until the timeout
    (refused,) = procs.wait("refused", 1)
    assert refused[1] == 2
    assert "left out of generation 1" in refused[3]
    assert {m[3] for m in procs.wait("summed", 2)} == {2}


def test_repeated_kills_down_to_min_size(procs: Procs, store_url: str) -> None:
    _members(procs, store_url, 4, rounds=3, min_size=2)
    alive = [0, 1, 2, 3]
    for victim, size in ((1, 3), (3, 2)):
        procs.wait("looping", len(alive))
        procs.kill(victim)
        alive.remove(victim)
        got = procs.wait("regrouped", len(alive))
        assert sorted(m[1] for m in got) == alive
        assert {m[4] for m in got} == {size}
        assert [m[3] for m in sorted(got)] == list(range(size))
    procs.wait("looping", 2)
    procs.kill(0)  # one left: fewer than min_size
    (refused,) = procs.wait("refused", 1)
    assert refused[1] == 2
    assert refused[2] == "RendezvousError"
    assert "min_size=2" in refused[3]


def test_joiner_admitted_at_scheduled_regroup(procs: Procs, store_url: str) -> None:
    _members(procs, store_url, 3, target=targets.admitting, want=1)
    procs.start("j", targets.joiner, store_url, "j", SECRET)
    got = procs.wait("regrouped", 4)
    assert sorted((m[1], m[3]) for m in got) == [(-1, 3), (0, 0), (1, 1), (2, 2)]
    assert {(m[2], m[4]) for m in got} == {(1, 4)}
    summed = procs.wait("summed", 4)
    assert {m[4][1] for m in summed} == {4}
    assert {m[3] for m in summed} == {4}


def test_kill_during_regroup(procs: Procs, store_url: str) -> None:
    """Rank 0 dies inside regroup() after registering, once every other member has
    registered too: it is in the first decision (it would be the new rank 0), the others
    see it dead while forming and try again."""
    for r in range(4):
        procs.start(r, targets.admitting, store_url, r, 4, SECRET, die=r == 0)
    procs.wait("up", 4)
    got = procs.wait("regrouped", 3)
    assert sorted((m[1], m[3]) for m in got) == [(1, 0), (2, 1), (3, 2)]
    assert {(m[2], m[4]) for m in got} == {(1, 3)}
    # Seen dead while forming (an unreaped zombie counts), not at regroup's 10 s timeout.
    assert max(m[6] for m in got) < 5.0
    assert {m[3] for m in procs.wait("summed", 3)} == {3}


async def _tickets(url: str) -> int:
    store, _ = await ac.store.open_store(url, rank=1, secret=SECRET)
    try:
        key = "aiocollect/default/elastic/tickets"
        return int(await store.get(key, timeout=0)) if (await store.check([key]))[0] else 0
    finally:
        await store.close()


def _wait_tickets(url: str, n: int) -> None:
    end = time.monotonic() + 20
    while asyncio.run(_tickets(url)) < n:
        assert time.monotonic() < end, "the joiner never took its ticket"


def test_joiner_that_dies_while_waiting_is_skipped(procs: Procs, store_url: str) -> None:
    _members(procs, store_url, 2, target=targets.admitting, want=2)
    procs.start("dead", targets.joiner, store_url, "dead", SECRET)
    _wait_tickets(store_url, 1)
    procs.kill("dead")
    procs.start("live", targets.joiner, store_url, "live", SECRET)
    got = procs.wait("regrouped", 3)
    assert sorted((m[1], m[3], m[4]) for m in got) == [(-1, 2, 3), (0, 0, 3), (1, 1, 3)]
    summed = procs.wait("summed", 3)
    assert {m[1] for m in summed} == {0, 1, "live"}


def test_secrets_on_every_generation(procs: Procs, store_url: str) -> None:
    """A joiner with a wrong secret is refused by the store; the members' next generation
    still forms with the secret (its handshakes prove it) and admits a proper joiner."""
    _members(procs, store_url, 2, target=targets.admitting, want=1)
    procs.start("bad", targets.joiner, store_url, "bad", "wrong-secret")
    (refused,) = procs.wait("refused", 1)
    assert refused[2] == "AuthenticationError"
    procs.start("good", targets.joiner, store_url, "good", SECRET)
    got = procs.wait("regrouped", 3)
    assert {(m[2], m[4]) for m in got} == {(1, 3)}
    procs.wait("summed", 3)


async def test_embedded_store_refused() -> None:
    with pytest.raises(ac.UsageError, match=r"aiocollect store.*redis.*file"):
        await ac.open_group(0, 1, store="tcp://127.0.0.1:1", elastic=True, timeout=1)
    server = await ac.store.connect_tcp_store("127.0.0.1", 0, is_host=True)
    try:
        with pytest.raises(ac.UsageError, match="embedded"):
            await ac.open_group(0, 1, store=server, elastic=True, timeout=5)
    finally:
        await server.close()


async def test_regroup_needs_an_elastic_group() -> None:
    group = await ac.open_group(0, 1, store="memory://elastic-usage", timeout=5)
    try:
        with pytest.raises(ac.UsageError, match="elastic=True"):
            await group.regroup()
        assert group.generation == 0
    finally:
        await group.aclose()


@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_in_process_regroup(kind: str, tmp_path: Path) -> None:
    """Healthy regroup of in-process ranks (memory store, file store): the same members,
    generation 1; the old generation's in-flight handles end with GroupBrokenError, its
    sub-groups are closed."""
    url = "memory://elastic-inproc" if kind == "memory" else f"file://{tmp_path}"

    async def rank(r: int) -> tuple[int, int, int, bool]:
        g = await ac.open_group(r, 3, store=url, elastic=True, timeout=10)
        sub = await g.split(0)
        assert sub is not None
        pending = sub.recv(np.zeros(1), 0) if r else None  # rank 0 never sends
        await g.barrier()  # every rank's recv is posted before anyone regroups
        g2 = await g.regroup(timeout=5)
        assert sub.generation == 0
        assert g2.generation == 1
        sub2 = await g2.split(0)
        assert sub2 is not None
        assert sub2.generation == 1
        if pending is not None:
            with pytest.raises(ac.GroupBrokenError):
                await pending
        with pytest.raises(ac.UsageError, match="closed"):
            sub.barrier()
        with pytest.raises(ac.UsageError, match="already been regrouped"):
            await g.regroup()
        buf = np.full(4, g2.rank + 1.0)
        await g2.allreduce(buf)
        await g2.aclose()
        return g2.generation, g2.rank, g2.world_size, bool((buf == 6).all())

    got = await asyncio.gather(*(rank(r) for r in range(3)))
    assert got == [(1, 0, 3, True), (1, 1, 3, True), (1, 2, 3, True)]


async def test_joiner_without_the_secret_is_never_admitted(tmp_path: Path) -> None:
    """On a store that checks no secret (file), a joiner's ticket carries an HMAC of it: a
    joiner with another secret is skipped at the regroup and times out waiting; one with
    the group's secret is admitted."""
    url = f"file://{tmp_path}"

    async def member(r: int) -> tuple[int, int]:
        g = await ac.open_group(r, 2, store=url, secret=SECRET, elastic=True, timeout=10)
        # both joiners run in this loop but register through the file store, which
        # notifies nobody: joiners() reads it
        while await g.joiners() < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        g2 = await g.regroup(timeout=5)
        result = (g2.generation, g2.world_size)
        await g2.barrier()
        await g2.aclose()
        return result

    async def joiner(secret: str) -> tuple[int, int]:
        g = await ac.join_group(url, secret=secret, timeout=3)
        result = (g.generation, g.world_size)
        await g.barrier()
        await g.aclose()
        return result

    bad = asyncio.ensure_future(joiner("another-secret"))
    good = asyncio.ensure_future(joiner(SECRET))
    got = await asyncio.gather(member(0), member(1), good)
    assert got == [(1, 3), (1, 3), (1, 3)]
    with pytest.raises(ac.RendezvousTimeout, match="admitted"):
        await bad
