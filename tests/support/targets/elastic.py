"""Process targets of the elastic tests (importable: they run in spawned processes).

Every target reports to the test through a multiprocessing queue as tuples whose first
item names the event. Members loop allreduces (checking every sum) until a peer fails or
the test's plan says regroup, then regroup and report the new generation.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import numpy as np

import aiocollect as ac

COUNT = 1 << 16


class Reporter:
    """The write end of this process's own pipe to the test (``put`` a tuple)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def put(self, msg: tuple[Any, ...]) -> None:
        self.conn.send(msg)


TRANSPORT = os.environ.get("ELASTIC_TEST_TRANSPORT", "auto")


def _check(group: ac.Group, buf: np.ndarray[Any, Any]) -> bool:
    n = group.world_size
    return bool(np.all(buf == n * (n + 1) / 2))


async def _sums(group: ac.Group, q: Any, me: int, count: int) -> bool:
    """``count`` allreduces; reports any wrong sum. False if the group failed."""
    for _ in range(count):
        buf = np.full(COUNT, group.rank + 1.0)
        try:
            await group.allreduce(buf)
        except (ac.PeerError, ac.GroupBrokenError):
            return False
        if not _check(group, buf):
            q.put(("wrong", me, group.generation))
    return True


async def _report_regroup(group: ac.Group, q: Any, me: int, t0: float) -> None:
    q.put(
        (
            "regrouped",
            me,
            group.generation,
            group.rank,
            group.world_size,
            time.time(),
            time.time() - t0,
            os.getpid(),
        )
    )


async def _member(
    url: str,
    rank: int,
    world: int,
    secret: str | None,
    q: Any,
    rounds: int,
    min_size: int,
    regroup_timeout: float,
    group_timeout: float,
) -> None:
    """Kill scenario: loop allreduces until a peer dies, regroup, repeat ``rounds`` times,
    then a few checked sums and a clean close."""
    group = await ac.open_group(
        rank,
        world,
        store=url,
        secret=secret,
        elastic=True,
        transport=TRANSPORT,
        timeout=group_timeout,
    )
    q.put(("up", rank, os.getpid()))
    for _ in range(rounds):
        q.put(("looping", rank, group.generation))
        while await _sums(group, q, rank, 1):
            pass
        t0 = time.time()
        try:
            group = await group.regroup(min_size=min_size, timeout=regroup_timeout)
        except ac.RendezvousError as exc:
            q.put(("refused", rank, type(exc).__name__, str(exc)))
            return
        await _report_regroup(group, q, rank, t0)
        if not await _sums(group, q, rank, 3):
            q.put(("failed", rank, group.generation))
            return
        q.put(("summed", rank, group.generation, group.world_size))
    await group.aclose()
    q.put(("closed", rank))


def member(
    url: str,
    rank: int,
    world: int,
    secret: str | None,
    q: Any,
    rounds: int = 1,
    min_size: int = 1,
    regroup_timeout: float = 10.0,
    group_timeout: float = 30.0,
) -> None:
    asyncio.run(
        _member(url, rank, world, secret, q, rounds, min_size, regroup_timeout, group_timeout)
    )


async def _admitting(
    url: str,
    rank: int,
    world: int,
    secret: str | None,
    q: Any,
    want: int,
    die: bool,
    regroup_timeout: float,
) -> None:
    """Admission scenario: rank 0 waits until ``want`` joiners wait, tells the others
    (broadcast_object), everyone regroups; ``die``: this rank SIGKILLs itself inside
    regroup() right after registering (a kill during regroup)."""
    group = await ac.open_group(
        rank, world, store=url, secret=secret, elastic=True, transport=TRANSPORT, timeout=30.0
    )
    q.put(("up", rank, os.getpid()))
    assert await _sums(group, q, rank, 2)
    if want:
        if rank == 0:
            # joiners register in the store from other processes; nothing notifies this one
            while await group.joiners() < want:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        await group.broadcast_object(True)
    if die:
        store = group.store
        real = store.set

        async def set_then_die(key: str, value: bytes) -> None:
            await real(key, value)
            if "/member/" in key:  # registered: die once the others are in regroup() too
                base = key.rsplit("/", 1)[0]
                await store.wait([f"{base}/m{r}" for r in range(world)], timeout=30)
                os.kill(os.getpid(), signal.SIGKILL)

        store.set = set_then_die
    t0 = time.time()
    group = await group.regroup(timeout=regroup_timeout)
    await _report_regroup(group, q, rank, t0)
    ok = await _sums(group, q, rank, 3)
    weights = await group.broadcast_object([group.generation, group.world_size])
    q.put(("summed" if ok else "failed", rank, group.generation, group.world_size, weights))
    await group.aclose()


def admitting(
    url: str,
    rank: int,
    world: int,
    secret: str | None,
    q: Any,
    want: int = 0,
    die: bool = False,
    regroup_timeout: float = 10.0,
) -> None:
    asyncio.run(_admitting(url, rank, world, secret, q, want, die, regroup_timeout))


async def _joiner(url: str, ident: str, secret: str | None, q: Any, timeout: float) -> None:
    q.put(("joining", ident, os.getpid()))
    try:
        group = await ac.join_group(url, secret=secret, timeout=timeout)
    except ac.AiocollectError as exc:
        q.put(("refused", ident, type(exc).__name__, str(exc)))
        return
    await _report_regroup(group, q, -1, time.time())
    ok = await _sums(group, q, -1, 3)
    weights = await group.broadcast_object(None)
    q.put(("summed" if ok else "failed", ident, group.generation, group.world_size, weights))
    await group.aclose()


def joiner(url: str, ident: str, secret: str | None, q: Any, timeout: float = 30.0) -> None:
    asyncio.run(_joiner(url, ident, secret, q, timeout))
