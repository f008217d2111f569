"""Busy-waiting for a peer's frame before the event loop sleeps: whether, and how long.

An operation that waits for a frame normally lets the event loop sleep in ``epoll_wait``
until the frame arrives. For a small operation that sleep is the largest cost: the kernel
must wake the process (on a virtual machine an inter-processor interrupt, and a sync
wake-up often placed on the *sender's* core, which then has two runnable processes while
the other core idles), 30-150 µs on the development machine against 15 µs for the whole
exchange when the receiver is already running (docs/benchmarks.md, *Small operations*).

So while one of its receives is outstanding a rank keeps its loop polling for at most
``budget`` seconds: a callback that re-schedules itself with ``call_soon`` makes the loop
poll its sockets without blocking between two runs of it (about 1.2 µs a turn on uvloop),
and other callbacks, timers and I/O go on as usual in between. The spin ends when the
awaited receive completes or the budget is spent; then the loop sleeps as before.

Policy (:func:`spin_budget`), decided once per group from real numbers:

- ``AIOCOLLECT_SPIN_US`` set: that many microseconds (``0`` turns spinning off), whatever
  the host; a value that is not a number is ignored with a warning.
- otherwise ``SPIN_SECONDS`` (50 µs), but only while the rank processes on this host (this
  one and every peer whose link reports it local, ``LinkCaps.local``) are no more than the
  cores this process may run on (``os.sched_getaffinity``): with more ranks than cores a
  spinning rank takes the very core its peer needs to produce the awaited frame, so
  spinning is off (0) and ranks sleep as before. Other processes' load does not turn it
  off: the back-off below stops spins that keep missing, and the load average that used
  would (at least the cores when the group formed: off) counts the job's own ranks, so a
  job busy on every core would turn spinning off for every group it formed later, and
  each benchmark round for the next.
- a group whose links are all in-process (the memory transport) never spins: its peers
  run on this thread and cannot make progress while it spins.

Links that poll for their frames themselves (``LinkCaps.polls``: shared memory spins on its
ring, ``AIOCOLLECT_SHM_SPIN_US``, docs/shm.md) are left alone: this spinner skips frames
awaited on them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Protocol

from aiocollect.transport.base import Link

log = logging.getLogger("aiocollect")

#: Longest busy-wait for an awaited frame before the loop sleeps (when the host has a core
#: per local rank); ``AIOCOLLECT_SPIN_US`` overrides it.
SPIN_SECONDS = 50e-6
SPIN_ENV = "AIOCOLLECT_SPIN_US"
#: After this many spins in a row without their frame, the next ``2**MAX_MISSES - 1``
#: waits sleep at once (see :class:`Spinner`).
MAX_MISSES = 6


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; the CPU count where that is not
    available)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def spin_budget(
    local_ranks: int, cores: int | None = None, env: Mapping[str, str] | None = None
) -> float:
    """Seconds a rank busy-waits for an awaited frame: ``AIOCOLLECT_SPIN_US`` (in ``env``,
    default ``os.environ``) if set, else ``SPIN_SECONDS`` while ``local_ranks`` (rank
    processes on this host, this one included) are at most ``cores`` (default: this
    process's usable cores), else 0."""
    raw = (os.environ if env is None else env).get(SPIN_ENV, "").strip()
    if raw:
        try:
            return max(0.0, float(raw)) * 1e-6
        except ValueError:
            log.warning("ignoring %s=%r: not a number", SPIN_ENV, raw)
    if cores is None:
        cores = usable_cores()
    return SPIN_SECONDS if local_ranks <= cores else 0.0


def budget_for(
    links: Iterable[Link], cores: int | None = None, env: Mapping[str, str] | None = None
) -> float:
    """:func:`spin_budget` for a rank with these links: the local rank processes are this
    one and every peer whose link says it is local (``caps.local``); 0 when no link knows
    (none is a network socket: nothing to poll)."""
    hosts = [link.caps.local for link in links]
    if not any(h is not None for h in hosts):
        return 0.0
    return spin_budget(_local_ranks(hosts), cores, env)


def core_each(links: Iterable[Link], cores: int | None = None) -> bool:
    """Whether this host has a core (of those this process may run on, or ``cores``) for
    each of its rank processes: this one and every peer whose link says it is local."""
    local = _local_ranks(link.caps.local for link in links)
    return local <= (usable_cores() if cores is None else cores)


def _local_ranks(hosts: Iterable[bool | None]) -> int:
    """Rank processes on this host: this one and every peer whose link says it is local
    (``hosts``: the links' ``caps.local``)."""
    return 1 + sum(1 for local in hosts if local)


class Awaited(Protocol):
    """What the spinner polls: a posted receive's future, or a one-frame operation
    (engine/small.py), done once its frame landed."""

    def done(self) -> bool: ...


class Spinner:
    """Keeps one event loop polling while a receive is awaited, for at most ``budget``
    seconds from the latest :meth:`wait`.

    A spin that ends without its frame (the peer was slow: busy computing, or descheduled
    by other load) makes the next waits skip spinning, 1, 3, 7 ... up to ``MAX_SKIP`` of
    them while spins keep failing; a spin that sees its frame resets that. So a rank whose
    peers are seldom there in time stops burning its core for nothing.
    """

    __slots__ = ("_fut", "_loop", "_misses", "_skip", "_ticking", "_until", "budget")

    def __init__(self, budget: float, loop: asyncio.AbstractEventLoop) -> None:
        self.budget = budget
        self._loop = loop
        self._fut: Awaited | None = None
        self._until = 0.0
        self._ticking = False
        self._misses = 0
        self._skip = 0

    @property
    def spinning(self) -> bool:
        """Whether the loop is being kept polling now."""
        return self._ticking

    def wait(self, fut: Awaited) -> None:
        """``fut`` (a posted receive) is awaited: poll until it is done, at most
        ``budget`` seconds from now."""
        if self._skip:
            self._skip -= 1
            return
        self._fut = fut
        self._until = time.perf_counter() + self.budget
        if not self._ticking:
            self._ticking = True
            self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        fut = self._fut
        if fut is None or fut.done():
            self._misses = 0
        elif time.perf_counter() >= self._until:
            self._misses = misses = min(self._misses + 1, MAX_MISSES)
            self._skip = (1 << misses) - 1
        else:
            self._loop.call_soon(self._tick)
            return
        self._ticking = False
        self._fut = None
