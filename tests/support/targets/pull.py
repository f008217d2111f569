"""Bodies for tests/shm/test_pull_allreduce.py that run in spawned rank processes."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.collectives import pull, select
from aiocollect.transport import cma
from tests.support.targets.star import star_mix


def counts() -> tuple[int, ...]:
    """float32 element counts around the automatic choice's switch from the segment
    allreduce to the pull (``select.SEGMENT_MAX``): at it (the segment), and an odd one
    past it (blocks of unequal sizes)."""
    at = select.SEGMENT_MAX // 4
    return (at, at + 1)


async def pull_mix(g: ac.Group, in_flight: int) -> dict[str, Any]:
    """For every count of :func:`counts`, ``in_flight`` SUM and AVG allreduces at once
    with the default algorithm, each checked against numpy (``star_mix``). Returns what
    the automatic choice took at each count and a digest of every result (the same on
    every rank)."""
    chosen = [g.chosen_algorithm("allreduce", count * 4) for count in counts()]
    digest = await star_mix(g, in_flight, counts())
    return {"pulls": g._fabric.pulls, "chosen": chosen, "digest": digest}


def _block(rank: int, count: int, i: int) -> np.ndarray[Any, Any]:
    return ((np.arange(count, dtype=np.float32) * (i + 2) + 3 * rank) % 997).astype(np.float32)


async def gather_scatter_mix(g: ac.Group, in_flight: int) -> dict[str, Any]:
    """allgather, reduce_scatter and broadcast (from a different root each) with the
    default algorithm, ``in_flight`` of each at
    once, on both sides of their switch to the pull algorithms (block counts: the
    gathered total or the input just under and at ``select.PULL_MIN``, then 16 MiB and
    past it), checked exactly. Returns what the automatic choice took per size."""
    n, chosen = g.world_size, {}
    for total in (select.PULL_MIN - 4 * n, select.PULL_MIN, 16 << 20, (16 << 20) + 4 * n):
        count = total // 4 // n  # float32 elements per block
        chosen[f"allgather {total}"] = g.chosen_algorithm("allgather", count * 4 * n)
        chosen[f"reduce_scatter {total}"] = g.chosen_algorithm("reduce_scatter", count * 4 * n)
        sends = [_block(g.rank, count, i) for i in range(in_flight)]
        outs = [np.empty((n, count), np.float32) for _ in range(in_flight)]
        inputs = [
            np.concatenate([_block(g.rank + b, count, i) for b in range(n)])
            for i in range(in_flight)
        ]
        dests = [np.empty(count, np.float32) for _ in range(in_flight)]
        handles = [g.allgather(s, o) for s, o in zip(sends, outs, strict=True)]
        handles += [g.reduce_scatter(x, d) for x, d in zip(inputs, dests, strict=True)]  # type: ignore[arg-type]
        chosen[f"broadcast {total}"] = g.chosen_algorithm("broadcast", count * 4 * n)
        casts = [_block(g.rank, count * n, i) for i in range(in_flight)]
        handles += [g.broadcast(b, root=i % n) for i, b in enumerate(casts)]  # type: ignore[misc]
        await asyncio.gather(*handles)
        for i in range(in_flight):
            for q in range(n):
                np.testing.assert_array_equal(outs[i][q], _block(q, count, i), f"allgather {total}")
            want = np.sum([_block(q + g.rank, count, i) for q in range(n)], axis=0)
            np.testing.assert_array_equal(dests[i], want, f"reduce_scatter {total}")
            np.testing.assert_array_equal(casts[i], _block(i % n, count * n, i), "broadcast")
    return chosen


async def bad_record(g: ac.Group, fault: str, count: int = select.PULL_MIN // 4) -> str:
    """Rank 1 lies in the pull allreduce's token frame (of ``count`` float32): its token
    names memory its process does not map (``address``), 8 bytes fewer than its buffer
    (``range``), or is cut short (``token``), or the frame gives the wrong buffer length
    (``length``); every rank reports what it got (the process goes on)."""
    if g.rank == 1:
        real = pull._record

        def record(token: bytes, nbytes: int, push: bool) -> np.ndarray[Any, Any]:
            if push:
                return real(token, nbytes, push)
            if fault == "address":
                return real(cma.TOKEN.pack(4096, nbytes), nbytes, push)  # never mapped
            if fault == "range":
                base, length = cma.TOKEN.unpack(token)
                return real(cma.TOKEN.pack(base, length - 8), nbytes, push)
            if fault == "token":
                return real(token[:-1], nbytes, push)
            return real(token, nbytes + 8, push)

        pull._record = record
    buf = np.ones(count, np.float32)
    try:
        await asyncio.wait_for(g.allreduce(buf, algorithm="pull", timeout=20), 30)
    except ac.AiocollectError as exc:
        return f"{type(exc).__name__}: {exc} / {exc.__cause__!r}"
    return "no error"


async def subgroups(g: ac.Group) -> list[int]:
    """A default allreduce of 1 MiB (the segment allreduce) in each half of a split, in
    flight together with one of the whole group, then a pull allgather in the half;
    returns the half's gathered ranks."""
    sub = await g.split(g.rank % 2)
    assert sub is not None
    assert sub.chosen_algorithm("allreduce", select.PULL_MIN) == "segment"
    x = np.full(select.PULL_MIN // 4, g.rank, np.float32)
    y = np.ones(select.PULL_MIN // 4, np.float32)
    await asyncio.gather(sub.allreduce(x), g.allreduce(y))
    assert (x == sum(r for r in range(g.world_size) if r % 2 == g.rank % 2)).all(), x[:3]
    assert (y == g.world_size).all(), y[:3]
    out = await sub.allgather(np.full(select.PULL_MIN // 4, g.rank, np.float32))
    return [int(row[0]) for row in out]


async def dies_after_its_tokens(g: ac.Group) -> dict[str, Any]:
    """Rank 2 of three is SIGKILLed once it has sent its pull allreduce's token frames and
    has both survivors' (both are in the operation); the survivors look at its token only
    once its link has closed (fault injection: the window in which the link knows of the
    loss and the group not yet). Each survivor returns its error's type and message and
    the type of the group's next error."""
    if g.rank == 2:

        async def die_once_everyone_announced(self: pull._Exchange, q: int) -> bytes | None:
            for futs in self._tokens.values():  # (both survivors are in the operation)
                for fut in futs:
                    await fut
            os.kill(os.getpid(), signal.SIGKILL)
            return None

        pull._Exchange.token = die_once_everyone_announced  # type: ignore[method-assign]
    else:
        real_token = pull._Exchange.token

        async def token_once_lost(self: pull._Exchange, q: int) -> bytes | None:
            link = self.op.link(q)
            if link.peer == 2:
                await link.gone.wait()  # type: ignore[attr-defined]
            return await real_token(self, q)

        pull._Exchange.token = token_once_lost  # type: ignore[method-assign]
    buf = np.ones(select.PULL_MIN // 4, np.float32)
    try:
        await asyncio.wait_for(g.allreduce(buf, algorithm="pull", timeout=20), 30)
    except ac.AiocollectError as exc:
        later = "none"
        try:
            await g.barrier(timeout=5)
        except ac.AiocollectError as err:
            later = type(err).__name__
        return {"error": type(exc).__name__, "message": str(exc), "later": later}
    return {"error": "none"}
