"""In-process ranks of the torch backend: one AiocollectProcessGroup per rank, each driven
by its own thread (as torch drives a process group), over real sockets on one c10d store."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from aiocollect.torch import create_process_group
from aiocollect.torch.process_group import AiocollectProcessGroup

T = TypeVar("T")


def _in_threads(world: int, fn: Callable[[int], T], timeout: float) -> list[T]:
    results: list[Any] = [None] * world
    errors: list[BaseException] = []  # in the order they happened

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise TimeoutError(f"ranks {stuck} did not finish within {timeout} s")
    if errors:
        raise errors[0]
    return results


def make_groups(
    world: int, *, store: Any = None, timeout: float = 30.0, prefix: str | None = None
) -> list[AiocollectProcessGroup]:
    """``world`` process groups of one group, formed concurrently."""
    store = dist.HashStore() if store is None else store  # type: ignore[attr-defined]
    prefix = prefix or f"local-{uuid.uuid4().hex[:8]}"
    return _in_threads(
        world,
        lambda r: create_process_group(
            dist.PrefixStore(prefix, store),  # type: ignore[attr-defined]
            r,
            world,
            timedelta(seconds=timeout),
        ),
        timeout + 10,
    )


def run_ranks(
    world: int, fn: Callable[[AiocollectProcessGroup, int], T], *, timeout: float = 30.0
) -> list[T]:
    """Form a group of ``world`` ranks, run ``fn(pg, rank)`` on every rank's own thread,
    return the results by rank (the first exception is raised), close the groups."""
    pgs = make_groups(world, timeout=timeout)

    def body(rank: int) -> T:
        try:
            return fn(pgs[rank], rank)
        except BaseException:
            pgs[rank].abort()  # the other ranks fail at once rather than time out
            raise

    try:
        return _in_threads(world, body, timeout)
    finally:
        close(pgs, timeout)


def close(pgs: list[AiocollectProcessGroup], timeout: float = 30.0) -> None:
    """Close every rank's group at once (a graceful close waits for all of them)."""
    for pg in pgs:
        if pg.failure is not None:
            pg.abort()
    _in_threads(len(pgs), lambda r: pgs[r].shutdown(), timeout)
