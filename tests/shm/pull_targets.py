"""Bodies for tests/shm/test_pull_allreduce.py that run in spawned rank processes."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.collectives import pull, select
from tests.collectives.star_targets import star_mix


def counts() -> tuple[int, ...]:
    """float32 element counts around the automatic choice's switch (``select.PULL_MIN``):
    one below it (the ring), at it, and odd ones above it (blocks of unequal sizes)."""
    at = select.PULL_MIN // 4
    return (at - 1, at, 3 * at + 7)


async def pull_mix(g: ac.Group, in_flight: int) -> dict[str, Any]:
    """For every count of :func:`counts`, ``in_flight`` SUM and AVG allreduces at once
    with the default algorithm, each checked against numpy (``star_mix``). Returns what
    the automatic choice took at each count and a digest of every result (the same on
    every rank)."""
    chosen = [g.chosen_algorithm("allreduce", count * 4) for count in counts()]
    digest = await star_mix(g, in_flight, counts())
    return {"pulls": g._fabric.pulls, "chosen": chosen, "digest": digest}


async def bad_record(g: ac.Group, fault: str) -> str:
    """Rank 1 announces a buffer its memory does not back (``address``) or of the wrong
    length (``length``) in the pull allreduce's address frame; every rank reports what it
    got (the process goes on)."""
    if g.rank == 1:
        real = pull._record

        def record(base: int, nbytes: int, push: bool) -> np.ndarray[Any, Any]:
            if fault == "address":
                return real(4096, nbytes, push)  # the first page: never mapped
            return real(base, nbytes + 8, push)

        pull._record = record  # type: ignore[assignment]
    buf = np.ones(select.PULL_MIN // 4, np.float32)
    try:
        await asyncio.wait_for(g.allreduce(buf, algorithm="pull", timeout=20), 30)
    except ac.AiocollectError as exc:
        return f"{type(exc).__name__}: {exc} / {exc.__cause__!r}"
    return "no error"
