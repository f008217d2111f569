"""Helpers for testing distributed code: every rank on one loop, or one process per rank.

- ``await run_ranks(n, fn, *args)`` runs ``fn(group, *args)`` for each rank on the current
  event loop (memory transport by default) and returns the results in rank order.
- ``await spawn_ranks(n, target, *args)`` does the same with one process per rank over TCP;
  the returned :class:`SpawnedRanks` can also kill or stop a rank for fault tests.
- ``abort_payload(rank, exc)``: the payload of the ABORT frame a failing rank sends, for
  tests that write frames on a link by hand.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiocollect._net import free_port
from aiocollect.api import open_group
from aiocollect.engine import closing
from aiocollect.errors import AiocollectError
from aiocollect.group import Group
from aiocollect.testing.spawn import RankFailed, SpawnedRanks, headline, spawn_ranks
from aiocollect.transport.tcp import LINGER, StreamLink

_names = itertools.count()


async def run_ranks(
    world_size: int,
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
    transport: str = "memory",
    timeout: float | None = 60.0,
    chunk_bytes: int | None = None,
    store: Any = None,
    name: str | None = None,
    **options: Any,
) -> list[Any]:
    """Run ``fn(group, *args)`` for every rank of a new group on the current event loop.

    Args:
        world_size: how many ranks.
        fn: the coroutine function each rank runs, as ``fn(group, *args)``.
        *args: the positional arguments after the group.
        transport: the group's transport (``"memory"``, or ``"tcp"`` for real loopback
            sockets, ...).
        timeout: the group's default timeout in seconds (``open_group``'s ``timeout``).
        chunk_bytes: the group's chunk size (small values push small inputs through the
            multi-chunk paths); None for the default.
        store: a Store or URL shared by all ranks, or a callable giving each rank's
            (``store(rank)``); by default a fresh ``memory://`` store.
        name: the group's name (by default a new one for each call).
        **options: other keyword arguments for ``open_group`` (``secret=``, ``ssl=``, ...).

    Returns:
        The results in rank order.

    Raises:
        ExceptionGroup: one or more ranks failed; each exception is annotated with its rank
            (``RankFailed`` wrapping the original as ``__cause__``). Its message names the
            rank that failed first and what it raised (usually the root cause: the others
            fail because of it).
    """
    name = name or f"run-ranks-{os.getpid()}-{next(_names)}"
    spec = store if store is not None else f"memory://{name}"
    failed_at: dict[int, float] = {}
    groups: list[Group] = []

    async def one(rank: int) -> Any:
        try:
            mine = spec(rank) if callable(spec) else spec
            group = await open_group(
                rank,
                world_size,
                store=mine,
                transport=transport,
                timeout=timeout,
                name=name,
                chunk_bytes=chunk_bytes,
                **options,
            )
            groups.append(group)
            try:
                result = await fn(group, *args)
            except BaseException as exc:
                failed_at[rank] = time.monotonic()
                group.abort(exc)
                raise
            await group.aclose()
            return result
        except BaseException:
            failed_at.setdefault(rank, time.monotonic())
            raise

    tasks = [asyncio.ensure_future(one(r)) for r in range(world_size)]
    await asyncio.wait(tasks)
    await links_settled(groups)
    failures = []
    for rank, task in enumerate(tasks):
        exc = task.exception()
        if exc is not None:
            err = RankFailed(rank, f"rank {rank} failed: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            failures.append(err)
    if failures:
        first = min(failures, key=lambda f: failed_at.get(f.rank, float("inf")))
        cause = first.__cause__
        assert cause is not None
        raise ExceptionGroup(
            headline(
                first.rank,
                f"{type(cause).__name__}: {cause}",
                [f.rank for f in failures],
                world_size,
            ),
            failures,
        )
    return [t.result() for t in tasks]


def abort_payload(rank: int, exc: BaseException) -> bytes:
    """The payload of the ABORT frame that rank ``rank`` sends when it fails with ``exc``,
    exactly as the engine encodes it (its peers rebuild ``exc`` from it, naming ``rank``),
    for tests that write an ABORT frame on a link by hand.

    Args:
        rank: the failing rank.
        exc: what it failed with.

    Returns:
        The frame's payload.
    """
    return closing.encode_abort(rank, exc)


async def links_settled(groups: list[Group], timeout: float = LINGER + 1.0) -> None:
    """Wait (at most ``timeout`` s) until every link of ``groups`` has seen its connection
    end. A broken group's links flush their ABORT before closing, for up to the transport's
    linger time; a test whose loop ends before that leaves sockets open. Only this
    process's own loop is waited on, never a peer.

    Args:
        groups: the groups (of this process) whose links to wait for.
        timeout: seconds to wait at most; links still open then are left as they are.
    """
    waits = [
        asyncio.ensure_future(link.gone.wait())
        for g in groups
        for link in g._fabric.links.values()
        if isinstance(link, StreamLink) and link.transport is not None
    ]
    if not waits:
        return
    _, pending = await asyncio.wait(waits, timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


__all__ = [
    "AiocollectError",
    "Group",
    "RankFailed",
    "SpawnedRanks",
    "abort_payload",
    "free_port",
    "links_settled",
    "run_ranks",
    "spawn_ranks",
]
