"""Bodies for tests/shm/test_segment_allreduce.py that run in spawned rank processes."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.collectives import segment, select

#: Element counts of float32 around the automatic choice's switches (``select.
#: SEGMENT_MIN``, ``SEGMENT_MAX``) and the segment's region (``segment.SLOT_BYTES``):
#: just below the lowest, at it, odd ones between (blocks of unequal sizes), the highest,
#: and one past it and past the region (the pull allreduce).
COUNTS = (
    select.SEGMENT_MIN // 4 - 1,
    select.SEGMENT_MIN // 4,
    (1 << 18) + 7,
    select.SEGMENT_MAX // 4,
    segment.SLOT_BYTES // 4 + 1,
)
#: Small counts a forced ``segment`` takes (and odd ones, fewer elements than ranks).
SMALL = (1, 3, 1001)


def _inputs(rank: int, count: int, i: int, dtype: Any) -> np.ndarray[Any, Any]:
    # integer values that every order of summation adds exactly, in every dtype here
    return ((np.arange(count) * (i + 1) + 7 * rank) % 113).astype(dtype)


async def exact_mix(g: ac.Group, in_flight: int, forced: bool) -> dict[str, Any]:
    """For every count (``COUNTS``, and ``SMALL`` when ``forced``), ``in_flight``
    allreduces at once of each of SUM (float32, int64, float64), MAX (int32), MIN
    (float32), PROD (int8, of small values) and AVG (float64) (past ``SEGMENT_MIN``
    bytes of float32, the float32 SUM and the AVG only), with ``algorithm=
    "segment"`` if ``forced`` else the default, each checked exactly against numpy.
    Returns what the automatic choice took per count, a digest of every result (the same
    on every rank) and the group's resources while open."""
    n = g.world_size
    algorithm = "segment" if forced else None
    counts = SMALL + COUNTS if forced else COUNTS
    digest = hashlib.sha256()
    chosen = [g.chosen_algorithm("allreduce", c * 4) for c in COUNTS]
    cases: list[tuple[Any, Any, Any]] = [
        (np.float32, ac.SUM, np.sum),
        (np.int64, ac.SUM, np.sum),
        (np.float64, ac.SUM, np.sum),
        (np.int32, ac.MAX, np.max),
        (np.float32, ac.MIN, np.min),
        (np.int8, ac.PROD, np.prod),
        (np.float64, ac.AVG, np.mean),
    ]
    for count in counts:
        bufs: list[tuple[np.ndarray[Any, Any], Any, int]] = []
        handles = []
        # (past 256 KiB one SUM and the AVG: the ops differ only in the ufunc)
        here = cases if count <= select.SEGMENT_MIN // 4 else [cases[0], cases[-1]]
        for dtype, op, _ in here:
            for i in range(in_flight):
                buf = _inputs(g.rank, count, i, dtype)
                if op is ac.PROD:
                    buf = (buf % 2 + 1).astype(dtype)  # 1 or 2: no overflow at 4 ranks
                bufs.append((buf, dtype, i))
                handles.append(g.allreduce(buf, op=op, algorithm=algorithm))
        await asyncio.gather(*handles)
        for k, (got, dtype, i) in enumerate(bufs):
            _, op, fold = here[k // in_flight]
            ins = [_inputs(r, count, i, dtype) for r in range(n)]
            if op is ac.PROD:
                ins = [(x % 2 + 1).astype(dtype) for x in ins]
            want = fold(ins, axis=0).astype(dtype)
            np.testing.assert_array_equal(got, want, f"{op} {np.dtype(dtype)} count={count}")
            digest.update(got.tobytes())
    return {
        "chosen": chosen,
        "digest": digest.hexdigest(),
        "resources": sorted(str(k) for k in g._fabric.resources),
    }


async def dies_in_the_fold(g: ac.Group, count: int) -> dict[str, Any]:
    """A warm-up allreduce, then rank 1 is SIGKILLed in the next one's reduce-scatter
    (after its written frames went out); every survivor returns its error's type and
    how long it took from the call."""
    buf = np.ones(count, np.float32)
    await g.allreduce(buf, algorithm="segment")
    if g.rank == 1:
        real = segment._fold

        async def die(*args: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)
            await real(*args)

        segment._fold = die  # type: ignore[assignment]
    start = time.monotonic()
    try:
        await g.allreduce(buf, algorithm="segment")
    except ac.AiocollectError as exc:
        return {"error": type(exc).__name__, "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


async def bad_record(g: ac.Group, fault: str) -> str:
    """Rank 1 lies in its first written frame: another length than the operation's
    (``length``), a descriptor its process does not hold (``descriptor``), another token
    than its segment's (``token``) or a region past its segment (``region``); every rank
    returns what it got (the process goes on)."""
    if g.rank == 1:
        real = segment._record

        def record(*args: Any) -> np.ndarray[Any, Any]:
            out = real(*args)
            if fault == "length":
                out[4] += 8
            elif fault == "descriptor":
                out[1] = 1 << 20
            elif fault == "token":
                out[5] ^= 1
            else:
                out[3] = 7
            return out

        segment._record = record  # type: ignore[assignment]
    return await _outcome(g)


async def breaks_after_writing(g: ac.Group) -> str:
    """Rank 1 releases its segment and breaks its group right after its written frames
    went out (as a rank whose group broke for another reason does): its peers read the
    frame, cannot map the segment, and must report rank 1's abort, not a lie."""
    if g.rank == 1:
        real = segment._record

        def record(own: Any, *args: Any) -> np.ndarray[Any, Any]:
            out = real(own, *args)
            own.handed_over()  # (the descriptor the frame names is closed)
            fabric = g._fabric
            asyncio.get_running_loop().call_soon(
                fabric.fail, ac.errors.GroupBrokenError("rank 1 gave up")
            )
            return out

        segment._record = record  # type: ignore[assignment]
    return await _outcome(g)


async def _outcome(g: ac.Group) -> str:
    """A segment allreduce's error on this rank (its type and message), or "no error"."""
    try:
        await g.allreduce(np.ones(1000, np.float32), algorithm="segment", timeout=20)
    except ac.AiocollectError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
