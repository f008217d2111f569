"""Reduction kernels: numpy ufuncs with ``out=``; large ones run in a worker thread so the
event loop stays responsive (numpy releases the GIL inside its loops). And large local
copies, in steps with a turn of the event loop between them; and the end every reducing
algorithm shares (:func:`settle`).

Every reduction follows IEEE 754 whatever numpy's error state: a sum that overflows is inf
(a division or product likewise), on every rank, never an error. numpy raises from a ufunc
whose result overflowed, underflowed, divided by zero or was invalid when the calling
context's ``np.errstate`` says "raise" (FloatingPointError), or when a warnings filter
turns numpy's RuntimeWarning into an error; it does so after its loop has written the
whole result, so a reduction catches :data:`FP_SIGNALS` and keeps that result. Otherwise
an overflow would fail the operation on the ranks that happened to compute it (whose
contexts, event-loop callbacks and worker threads differ) while the others had their
result. With numpy's default error state its RuntimeWarning still shows, once per place,
on the ranks whose arithmetic overflowed, as any numpy arithmetic would."""

from __future__ import annotations

import asyncio

import numpy as np

from aiocollect._buffers import Array
from aiocollect.engine.turns import give_way

#: What numpy raises from a ufunc, after writing its whole result, where the error state or
#: a warnings filter asks it to (module docstring): a reduction keeps the result.
FP_SIGNALS = (FloatingPointError, RuntimeWarning)
#: Reductions larger than this many bytes are offloaded to a thread.
THREAD_THRESHOLD = 4 * 1024 * 1024
#: Bytes a local copy moves per turn of the event loop (about a millisecond here).
COPY_STEP = 4 * 1024 * 1024


async def reduce_into(ufunc: np.ufunc, dst: Array, src: Array, base: Array | None = None) -> None:
    """``dst = ufunc(dst, src)`` elementwise, in place; with ``base``,
    ``dst = ufunc(base, src)`` (``dst`` is only written: no copy of ``base`` into it first).

    Runs on the calling (loop) thread below ``THREAD_THRESHOLD`` bytes, in a worker thread
    from there on. The ring reduce-scatter calls it once per ``chunk_bytes`` frame (1 or 2 MiB
    by default), never for a whole block, so it holds the loop for one chunk at most."""
    first = dst if base is None else base
    if dst.nbytes >= THREAD_THRESHOLD:
        await asyncio.to_thread(apply, ufunc, first, src, dst)
    else:
        apply(ufunc, first, src, dst)


def apply(ufunc: np.ufunc, a: Array, b: Array, out: Array) -> None:
    """``out = ufunc(a, b)`` with IEEE results whatever numpy's error state (module
    docstring; the one-frame programs' folds in engine/small.py do the same inline)."""
    try:  # noqa: SIM105 (a try costs nothing, contextlib.suppress a call and a context)
        ufunc(a, b, out=out)
    except FP_SIGNALS:
        pass  # (the IEEE result is written)


def divide(arr: Array, divisor: int) -> None:
    """``arr /= divisor`` in place (an AVG's end), IEEE whatever numpy's error state."""
    try:  # noqa: SIM105 (once per small AVG: a try costs nothing, suppress a call)
        np.divide(arr, divisor, out=arr)
    except FP_SIGNALS:
        pass


async def copy_into(dst: Array, src: Array, step_bytes: int = COPY_STEP) -> None:
    """``dst[...] = src`` for flat arrays of one size, ``step_bytes`` at a time, giving
    the event loop way between pieces (:func:`~aiocollect.engine.turns.give_way`; a 64 MiB
    block copied at once held the loop for 5-10 ms)."""
    step = max(1, step_bytes // max(1, dst.itemsize))
    n = dst.size
    if n <= step:
        dst[...] = src
        return
    for i in range(0, n, step):
        dst[i : i + step] = src[i : i + step]
        await give_way()


def settle(result: Array, dest: Array, divisor: int) -> None:
    """The end of a reduction that leaves this rank's result in ``result``: divide it by
    ``divisor`` in place (an AVG; 1: nothing to do), then copy it into ``dest`` unless it
    is ``dest``."""
    if divisor != 1:
        divide(result, divisor)
    if result is not dest:
        dest[...] = result
