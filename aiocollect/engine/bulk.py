"""Bulk work off the event loop's thread: one worker thread per group, at a lowered
scheduling priority, that runs the large copies and reductions of the pull collectives
while the loop's thread stays free for small frames.

Where the ranks on a host outnumber its cores, a rank woken by a small frame waits for a
core while other ranks' loop threads copy and reduce bulk data; moving that work to a
thread whose nice value is raised (:data:`NICE`) lets the kernel run every rank's loop
thread first, so a small request waits for no one's bulk piece (docs/design.md, *Bulk work
at low priority*). The loop's thread awaits each hop (:meth:`Bulk.run`) and serves other
frames meanwhile; the work itself releases the GIL (numpy's loops on large arrays,
``process_vm_readv`` through ctypes).

``AIOCOLLECT_BULK_THREAD`` (:data:`ENV`): ``0`` (the default: the loop's thread does the
work in pieces, giving the loop way between them), ``auto`` (a worker where the host's rank
processes outnumber the cores this process may run on), ``1`` (always). Off by default: it
costs up to 23 % of the bulk bandwidth where it is on (docs/design.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

#: Environment setting: ``auto``, ``1`` or ``0`` (module docstring).
ENV = "AIOCOLLECT_BULK_THREAD"
#: The worker thread's nice value (0 is the loop's; 19 the lowest priority).
NICE = 10
#: Bytes of work per hop to the worker (a hop's end wakes the loop's thread, which hands
#: the worker the next): 4 MiB served 2,155-3,367 pulls/s in
#: examples/parameter_server_load.py at 4 ranks during 64 MiB allreduces, whole blocks per
#: hop 2,085-2,153 (docs/design.md, *Bulk work at low priority*).
HOP = 4 << 20
#: Work smaller than this stays on the loop's thread (the hops would cost more than the
#: work holds the loop).
MIN_BYTES = 4 << 20

T = TypeVar("T")


def wanted(shared_cores: bool, env: Mapping[str, str] | None = None) -> bool:
    """Whether a group should run its bulk work in a worker thread: the environment's
    :data:`ENV` (``env``, default ``os.environ``): ``1`` yes, ``auto`` where ranks share
    cores (``shared_cores``), unset, ``0`` or anything else no."""
    raw = (os.environ if env is None else env).get(ENV, "").strip().lower()
    if raw in ("1", "on", "yes", "true"):
        return True
    if raw == "auto":
        return shared_cores
    return False


def _lower_priority() -> None:
    """Raise the calling thread's nice value to :data:`NICE` (only ever raised: an
    unprivileged process may not lower it back, hence a thread of its own). Where the
    platform refuses, the thread keeps its priority and still takes the work off the
    loop."""
    with contextlib.suppress(OSError, AttributeError):  # (once per group)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


class Bulk:
    """One group's bulk worker: a thread started at the first :meth:`run`, ended by
    :meth:`close`."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(halt, *args)`` in the worker thread, the calling task awaiting it without
        holding the event loop; ``fn`` works in pieces and returns early once ``halt`` (a
        ``threading.Event``) is set. Returns what ``fn`` returns and raises what it raises.
        Cancelled, it sets ``halt`` and returns (raising CancelledError) only once ``fn``
        has ended, since ``fn`` may be writing into the caller's buffers: it blocks the
        loop's thread for what is left of ``fn``'s current piece.

        Raises:
            RuntimeError: the worker was closed (the group closed).
        """
        pool = self._pool
        if pool is None:
            if self._closed:
                raise RuntimeError("the group's bulk worker is closed")
            pool = self._pool = concurrent.futures.ThreadPoolExecutor(
                1, "aiocollect-bulk", initializer=_lower_priority
            )
        halt = threading.Event()
        cf = pool.submit(fn, halt, *args)
        try:
            return await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            halt.set()
            if not cf.cancel():  # running: let it end before the caller's buffers are freed
                concurrent.futures.wait([cf])
            raise

    def close(self) -> None:
        """End the worker thread (waiting for a hop still running, which the operation
        that submitted it already waited for unless it was abandoned)."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
