"""Watchdog: one group's operations in flight, their deadlines, progress and culprits.

A group (``aiocollect.group``) starts operations; its :class:`Watchdog` keeps what the
engine needs of them while they run: the handles in flight (:attr:`Watchdog.tasks`, with
the record of each: its :class:`~aiocollect.engine.op.Op` or
:class:`~aiocollect.engine.small.Quick`, kind, start time and timeout), the operations
completed per kind (:attr:`Watchdog.done`), the deadline heap with its one timer
(:meth:`Watchdog.watch`), the progress ticker (every ``TICK`` s while operations are in
flight: far deadlines go on the heap, peers are asked what they called, the links to
other hosts are looked at, stalls are logged) and the search for the ranks to blame
once a deadline passes (:meth:`Watchdog.timeout_error`). One-frame operations
(engine/small.py) report to it directly, so the engine never reaches into the group.

The group's per-operation path writes :attr:`Watchdog.tasks` and tests
:attr:`Watchdog.ticking` itself (attribute accesses, no call per operation), and calls
:meth:`Watchdog.watch` only for a deadline nearer than ``WATCH_AT_TICK``.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import weakref
from collections import Counter
from typing import Any, Protocol

from aiocollect.engine.fabric import Fabric
from aiocollect.engine.liveness import few
from aiocollect.engine.op import Op
from aiocollect.engine.small import Quick
from aiocollect.errors import MismatchError, PeerTimeout
from aiocollect.transport.wire import DATA

log = logging.getLogger("aiocollect")

#: Seconds a timed-out operation waits for peers to answer a liveness probe.
PROBE_SECONDS = 0.5
#: An operation still waiting after this many seconds asks its peers which operation they
#: called at its sequence number (a PING, answered by their event loops): ranks that
#: disagree then raise MismatchError instead of waiting for the deadline. Asked again at
#: 2, 4, 8 ... seconds (at most every ``CHECK_MAX`` s) while peers have not called it yet.
CHECK_SECONDS = 1.0
#: A deadline at least this far off is put on the deadline heap by the progress ticker,
#: which sees every operation still in flight within ``CHECK_SECONDS`` of its start, not
#: by the call: most operations end long before and never touch the heap
#: (docs/design.md, *Deadlines*). Nearer ones are put there at once.
WATCH_AT_TICK = 2 * CHECK_SECONDS
CHECK_MAX = 30.0
#: An operation with no byte received or sent on its links for this long logs a WARNING
#: naming it and the ranks not heard from (at most 8 of them, and how many more), again
#: after 2x, 4x ... that interval (at most every 5 minutes); at most a quarter of its
#: timeout.
PROGRESS_SECONDS = 30.0
#: Seconds between two looks of the progress ticker at the operations in flight.
TICK = 0.5
#: The most peers a waiting operation asks what they called (:func:`asked`).
SURVEY_MOST = 32

#: What :attr:`Watchdog.tasks` keeps of an operation: (its Op or Quick, kind, start loop
#: time, timeout in seconds or None); None for a helper task.
Watched = tuple["Op | Quick", str, float, "float | None"]


class Waiting(Protocol):
    """What :func:`asked` reads of an operation (an ``Op`` or a ``Quick``)."""

    @property
    def ranks(self) -> list[int]: ...

    def silent_peers(self) -> list[int]: ...


def asked(op: Waiting, me: int) -> list[int]:
    """The world ranks a waiting ``op`` of world rank ``me`` asks what they called: the
    peers it waits for, then the others, each in group order from ``me`` on, at most
    ``SURVEY_MOST``. The rank that called something else is found by the ranks that wait
    for it, or finds itself through the peers it waits for, so the bound loses no
    mismatch; it keeps a slow operation's PINGs at a few per rank however large the group
    (every rank of a fully linked 256-rank group asking every peer is 65,280 PINGs per
    slow operation, CPU enough to keep every operation slow)."""
    ranks = op.ranks
    n, at = len(ranks), ranks.index(me)
    waited = sorted({(q - at) % n for q in op.silent_peers()} - {0})[:SURVEY_MOST]
    order = [(at + d) % n for d in waited]
    d, taken = 1, set(waited)
    while len(order) < SURVEY_MOST and d < n:  # (the others: no pass over a large group)
        if d not in taken:
            order.append((at + d) % n)
        d += 1
    return [ranks[q] for q in order]


class Watchdog:
    """The operations in flight of one group (world ranks ``ranks``, id ``gid``, this
    rank's index ``rank``, called ``name`` in messages) on ``fabric``: their deadlines,
    progress checks and stall warnings. Registers its nearest deadline with the fabric
    until :meth:`stop`."""

    def __init__(self, fabric: Fabric, gid: int, ranks: list[int], name: str) -> None:
        self.fabric = fabric
        #: The fabric's registry of operations (a one-frame operation unregisters there).
        self.registry = fabric.registry
        self.gid = gid
        self.ranks = ranks
        self.rank = ranks.index(fabric.rank)
        self.name = name
        #: Handles (and helper tasks: None) in flight, with what the ticker needs.
        self.tasks: dict[asyncio.Future[Any], Watched | None] = {}
        #: Operations completed, per kind.
        self.done: Counter[str] = Counter()
        #: The ticker's next call while it runs (the group starts it: ``start_ticking``).
        self.ticking: asyncio.TimerHandle | None = None
        #: What the ticker (weakly) holds: a group dropped with operations in flight is
        #: collected (its pending handles then warn), not kept by the loop.
        self.ref = weakref.ref(self)
        self._stopped = False
        self._progress: dict[asyncio.Future[Any], _Progress] = {}
        self._deadlines: list[tuple[float, int, asyncio.Future[Any], Op | Quick]] = []
        self._watch_count = 0
        self._watch_at: float | None = None
        self._watch_handle: asyncio.TimerHandle | None = None
        #: operations in flight whose far deadline the ticker has put on the heap
        self._watched: set[asyncio.Future[Any]] = set()
        fabric.deadlines.append(self.nearest_deadline)  # (until stop)

    def __del__(self) -> None:
        # As asyncio does for a pending Task: a one-frame operation still pending when its
        # group is collected was never awaited (each is in ``tasks`` until it ends, and
        # its Quick holds this watchdog: they go together). Here, once per group, rather
        # than in a finalizer run for every operation. A warning only: it never raises (at
        # interpreter exit some of what it uses may be gone already).
        try:
            for handle, info in getattr(self, "tasks", {}).items():
                if info is not None and isinstance(info[0], Quick) and not handle.done():
                    log.warning(
                        "%s (op #%d) was garbage-collected while pending: its handle was "
                        "never awaited and its group was dropped",
                        info[1],
                        info[0].seq,
                    )
        except Exception:  # (nothing to report to at that point)
            pass

    def nearest_deadline(self) -> float | None:
        """The loop time of the nearest deadline among the operations in flight, or None
        (the fabric asks when a peer's relayed timeout blames this rank).

        Returns:
            The deadline in loop time, or None when no operation in flight has one.
        """
        soonest: float | None = None
        for fut, info in self.tasks.items():
            if info is None or fut.done() or info[3] is None:
                continue
            deadline = info[2] + info[3]
            if soonest is None or deadline < soonest:
                soonest = deadline
        return soonest

    def start_ticking(self, loop: asyncio.AbstractEventLoop) -> asyncio.TimerHandle:
        """The ticker's first call, ``CHECK_SECONDS`` from now (the caller keeps the
        handle in :attr:`ticking`, having seen it None).

        Args:
            loop: the running loop.

        Returns:
            The timer handle.
        """
        return loop.call_later(CHECK_SECONDS, _tick, self.ref, loop)

    def track(self, fut: asyncio.Future[Any]) -> None:
        """Count ``fut`` (a helper task) as in flight until it is done (the group's close
        waits for it).

        Args:
            fut: the task or future.
        """
        self.tasks[fut] = None
        fut.add_done_callback(self.untrack)

    def untrack(self, fut: asyncio.Future[Any]) -> None:
        """Forget ``fut`` (a done callback of the handles in :attr:`tasks`).

        Args:
            fut: the task or future that ended.
        """
        self.tasks.pop(fut, None)

    # -- deadlines -------------------------------------------------------------------------

    def watch(
        self,
        loop: asyncio.AbstractEventLoop,
        deadline: float,
        task: asyncio.Future[Any],
        op: Op | Quick,
    ) -> None:
        """Expire ``task`` at ``deadline``. One timer per group (a loop timer costs several
        microseconds, a heap push well under one): entries of finished tasks are dropped
        when they reach the top or when the heap outgrows the operations in flight.

        Args:
            loop: the running loop.
            deadline: loop time at which the operation times out.
            task: its handle.
            op: its record: an Op's ``expired`` is set and ``task`` cancelled; a Quick
                is told to ``expire``.
        """
        heap = self._deadlines
        self._watch_count += 1
        heapq.heappush(heap, (deadline, self._watch_count, task, op))
        if len(heap) > 2 * len(self.tasks) + 64:
            heap[:] = [entry for entry in heap if not entry[2].done()]
            heapq.heapify(heap)
        if self._watch_at is None or deadline < self._watch_at:
            self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        heap = self._deadlines
        while heap and heap[0][2].done():
            heapq.heappop(heap)
        if self._watch_handle is not None:
            self._watch_handle.cancel()
            self._watch_handle = None
        self._watch_at = heap[0][0] if heap else None
        if self._watch_at is not None:
            self._watch_handle = loop.call_at(self._watch_at, self._on_deadline, loop)

    def stop(self) -> None:
        """Drop the deadline timer and its entries, and stop the ticker (the group is
        closed: no new operations)."""
        self._stopped = True
        if self._watch_handle is not None:
            self._watch_handle.cancel()
            self._watch_handle = None
        self._watch_at = None
        self._deadlines.clear()
        self._watched.clear()
        if self.nearest_deadline in self.fabric.deadlines:
            self.fabric.deadlines.remove(self.nearest_deadline)

    @property
    def heap_size(self) -> int:
        """Entries on the deadline heap (finished operations' included until dropped)."""
        return len(self._deadlines)

    def _on_deadline(self, loop: asyncio.AbstractEventLoop) -> None:
        self._watch_handle = None
        heap = self._deadlines
        now = loop.time()
        while heap and (heap[0][0] <= now or heap[0][2].done()):
            _, _, task, target = heapq.heappop(heap)
            if task.done():
                continue
            if isinstance(target, Quick):
                target.expire()
            else:
                target.expired = True  # the group's run turns the cancellation into a PeerTimeout
                task.cancel()
        self._arm(loop)

    async def timeout_error(
        self, kind: str, op: Op | Quick, timeout: float | None
    ) -> PeerTimeout | MismatchError:
        """Name the ranks to blame for ``op``'s timeout: those that do not answer a
        liveness probe, else those that have not called this operation, else those it was
        still waiting for. A peer that called another operation at this sequence number
        makes it a MismatchError.

        Args:
            kind: the operation's name ("allreduce", ...).
            op: its record.
            timeout: its timeout in seconds (for the message).

        Returns:
            The error to break the group with (not raised).
        """
        fabric = self.fabric
        waited = op.silent_peers()
        others = [r for r in self.ranks if r != fabric.rank]
        absent: list[int] = []
        with fabric.diagnosing():  # a bystander's blame of this rank waits for it
            if op.kind == DATA:
                dead, absent, fps = await fabric.liveness.survey(
                    others, PROBE_SECONDS, self.gid, op.seq
                )
                mismatch = self.registry.check_fingerprints(self.gid, op.seq, fps, self.ranks)
                if mismatch is not None:
                    return mismatch
            else:  # point to point: no operation number to ask about
                dead = await fabric.liveness.probe(others, PROBE_SECONDS)
        if dead:
            silent, how = [self.ranks.index(r) for r in dead], "do not respond"
        elif absent:
            silent, how = [self.ranks.index(r) for r in absent], "have not called it"
        else:
            silent, how = waited, "sent nothing"
        return PeerTimeout(
            f"{kind} (op #{op.seq} of group {self.name!r}) on rank {self.rank} timed out "
            f"after {timeout:g} s: ranks {few(silent)} {how}",
            silent,
        )

    # -- seeing progress (and mismatches) while an operation waits ------------------------

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every ``TICK`` s while operations are in flight: far deadlines
        (``WATCH_AT_TICK``) of operations seen for the first time go on the deadline
        heap; operations older than ``CHECK_SECONDS`` ask their peers what they called
        (:meth:`_check`); operations without progress for their interval log a WARNING.
        Once the group is broken it only puts those deadlines on the heap, and stops: an
        operation the failure did not end still ends by its deadline."""
        self.ticking = None
        if self._stopped:
            self._progress.clear()
            return
        broken = self.fabric.failure is not None
        now = loop.time()
        live = waiting = False
        for fut, info in list(self.tasks.items()):
            if info is None or fut.done():
                continue
            live = True
            op, kind, started, timeout = info
            if timeout is not None and timeout >= WATCH_AT_TICK and fut not in self._watched:
                self._watched.add(fut)  # (a deadline already passed fires at once)
                self.watch(loop, started + timeout, fut, op)
            if broken:  # its deadline holds; nothing more to ask of the peers
                continue
            age = now - started
            if age < CHECK_SECONDS:
                continue
            waiting = True
            st = self._progress.get(fut)
            if st is None:
                st = self._progress[fut] = _Progress(op.progress(), age, timeout)
            if op.kind == DATA and not st.checking and age >= st.next_check:
                st.checking = True
                self.track(loop.create_task(self._check(op, st)))
            if age >= st.next_warn:
                token = op.progress()
                if token == st.token:
                    self._warn_stalled(kind, op, st, now - st.since, timeout, age)
                    st.warn_every = min(st.warn_every * 2, 300.0)
                else:
                    st.token, st.since = token, now
                st.next_warn = age + st.warn_every
        if waiting:  # a host that vanished is found while an operation waits for it
            self.fabric.liveness.look(now)
        if broken:
            self._progress.clear()
            return
        for fut in [f for f in self._progress if f.done()]:
            del self._progress[fut]
        self._watched = {fut for fut in self._watched if not fut.done()}
        if live:
            self.ticking = loop.call_later(TICK, _tick, self.ref, loop)

    async def _check(self, op: Op | Quick, st: _Progress) -> None:
        """Ask ``op``'s peers (:func:`asked`) which operation they called at its sequence
        number; one that called another breaks the group with MismatchError (on every
        rank, by the ABORT)."""
        fabric = self.fabric
        try:
            others = asked(op, fabric.rank)
            dead, absent, fps = await fabric.liveness.survey(
                others, PROBE_SECONDS, self.gid, op.seq
            )
            if fabric.failure is not None:
                return
            err = self.registry.check_fingerprints(self.gid, op.seq, fps, self.ranks)
            if err is not None:
                fabric.fail(err)
                return
            st.absent = [self.ranks.index(r) for r in absent]
            st.dead = [self.ranks.index(r) for r in dead]
            if dead or absent or len(fps) < len(others):
                st.check_every = min(st.check_every * 2, CHECK_MAX)
                st.next_check += st.check_every
            else:  # every peer called this very operation: nothing to disagree about
                st.next_check = float("inf")
        finally:
            st.checking = False

    def _warn_stalled(
        self,
        kind: str,
        op: Op | Quick,
        st: _Progress,
        stalled: float,
        timeout: float | None,
        age: float,
    ) -> None:
        what = (
            f"op #{op.seq} of group {self.name!r}"
            if op.kind == DATA
            else f"point to point, group {self.name!r}"
        )
        parts = [f"waiting for ranks {few(op.silent_peers())}"]
        if st.dead:
            parts.append(f"ranks {few(st.dead)} did not answer a ping")
        if st.absent:
            parts.append(f"ranks {few(st.absent)} have not called it")
        end = (
            "no timeout"
            if timeout is None
            else f"it times out in {max(timeout - age, 0):.0f} s (timeout={timeout:g})"
        )
        log.warning(
            "%s (%s) on rank %d: no progress for %.0f s; %s; %s",
            kind,
            what,
            self.rank,
            stalled,
            "; ".join(parts),
            end,
        )


def _tick(ref: weakref.ref[Watchdog], loop: asyncio.AbstractEventLoop) -> None:
    """The ticker holds its watchdog weakly: a group dropped with operations in flight is
    collected (its pending handles then warn), not kept by the loop."""
    watchdog = ref()
    if watchdog is not None:
        watchdog._tick(loop)


class _Progress:
    """What the ticker knows of one operation in flight for more than CHECK_SECONDS."""

    __slots__ = (
        "absent",
        "check_every",
        "checking",
        "dead",
        "next_check",
        "next_warn",
        "since",
        "token",
        "warn_every",
    )

    def __init__(self, token: tuple[int, int], age: float, timeout: float | None) -> None:
        self.token = token
        self.since = asyncio.get_running_loop().time() - age
        self.checking = False
        self.check_every = CHECK_SECONDS
        self.next_check = CHECK_SECONDS
        every = PROGRESS_SECONDS if timeout is None else min(PROGRESS_SECONDS, timeout / 4)
        self.warn_every = max(every, TICK)
        self.next_warn = self.warn_every
        self.absent: list[int] = []
        self.dead: list[int] = []
