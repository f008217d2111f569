"""GroupCore: sequence numbers, handles, close and abort (the methods live in group.py).

Every collective method checks its arguments (raising UsageError before anything is sent),
takes the next sequence number at call time, registers its fingerprint and returns an
``asyncio.Task`` running the algorithm (:meth:`GroupCore._start`), or a plain Future run by
a :class:`~aiocollect.engine.small.Schedule` for one-frame operations
(:meth:`GroupCore._schedule`). Several may run at once; ranks must call a group's
collectives in the same order.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from aiocollect.engine.fabric import Fabric
from aiocollect.engine.op import Op
from aiocollect.engine.small import Schedule, Step
from aiocollect.errors import (
    AiocollectError,
    GroupBrokenError,
    PeerTimeout,
    UsageError,
)
from aiocollect.transport.wire import DATA, P2P

log = logging.getLogger("aiocollect")

T = TypeVar("T")

DEFAULT_CHUNK_BYTES = 1 << 20
#: Seconds a timed-out operation waits for peers to answer a liveness probe.
PROBE_SECONDS = 0.5


class GroupCore:
    """State and plumbing shared by the collective methods (see :class:`Group`)."""

    def __init__(self, fabric: Fabric, gid: int, ranks: list[int], *, timeout: float | None,
                 chunk_bytes: int, name: str, parent: GroupCore | None = None) -> None:
        self._fabric = fabric
        self._gid = gid
        self._ranks = ranks
        self.rank = ranks.index(fabric.rank)
        self.world_size = len(ranks)
        self.name = name
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._seq = 0
        self._tasks: set[asyncio.Future[Any]] = set()  # handles (and helper tasks) in flight
        self._children: list[GroupCore] = []
        self._parent = parent
        self._closed = False
        self.store: Any = None
        self._send_counters: Counter[tuple[int, int]] = Counter()
        self._recv_counters: Counter[tuple[int, int]] = Counter()
        self._stats: Counter[str] = Counter()  # operations started, per kind
        self._done: Counter[str] = Counter()  # and completed
        self._deadlines: list[tuple[float, int, asyncio.Future[Any], Op | Schedule]] = []
        self._watch_count = 0
        self._watch_at: float | None = None
        self._watch_handle: asyncio.TimerHandle | None = None
        self._closers: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._sync_closers: list[Callable[[], None]] = []

    # -- state -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after ``aclose()``/``abort()`` (or the parent group's close)."""
        return self._closed or (self._parent is not None and self._parent.closed)

    @property
    def broken(self) -> bool:
        return self._fabric.failure is not None

    def _check_usable(self) -> None:
        if self.closed:
            raise UsageError(f"group {self.name!r} is closed")
        self._fabric.check()

    def statistics(self) -> dict[str, Any]:
        """Counters: operations started and completed per kind, bytes and frames moved per
        link, seconds spent with at least one operation in flight."""
        links = {
            peer: {"bytes_sent": link.bytes_sent, "bytes_received": link.bytes_received,
                   "frames_sent": link.frames_sent, "frames_received": link.frames_received}
            for peer, link in sorted(self._fabric.links.items())
        }
        ops = {f"{kind}_started": n for kind, n in self._stats.items()}
        ops.update((f"{kind}_completed", n) for kind, n in self._done.items())
        return {"rank": self.rank, "world_size": self.world_size, "ops": ops,
                "in_flight": len(self._tasks), "links": links,
                "broken": self.broken, "closed": self.closed}

    # -- running operations ----------------------------------------------------------------

    def _timeout_arg(self, timeout: float | None) -> float | None:
        if timeout is None:
            return self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise UsageError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)

    def _new_op(self, kind: str, fp: tuple[int, int, int, int, int], timeout: float | None,
                p2p: tuple[int, int] | None = None) -> tuple[Op, float | None]:
        """Check the group can start an operation, take its sequence number (a collective)
        or use ``p2p``'s (counter, tag), and count it. Returns the Op and its deadline in
        seconds (or None)."""
        self._check_usable()
        fabric = self._fabric
        timeout = self._timeout_arg(timeout)
        if p2p is None:
            seq = self._seq
            self._seq = seq + 1
            fabric.register(self._gid, seq, fp, self._ranks)
            op = Op(fabric, self._gid, seq, fp, self._ranks, self.rank, self.chunk_bytes, DATA)
        else:
            op = Op(fabric, self._gid, p2p[0], fp, self._ranks, self.rank,
                    self.chunk_bytes, P2P)
        self._stats[kind] += 1
        return op, timeout

    def _start(self, kind: str, fp: tuple[int, int, int, int, int],
               body: Callable[[Op], Awaitable[T]], timeout: float | None, *,
               p2p: tuple[int, int] | None = None) -> asyncio.Task[T]:
        """Take a sequence number and start ``body`` as a task (the handle).

        This is the per-operation hot path: one Task and a heap entry for the deadline (no
        ``asyncio.timeout`` context, no timer per operation), no other allocation beyond
        the Op.
        """
        op, timeout = self._new_op(kind, fp, timeout, p2p)
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._run(kind, op, body, timeout, p2p is None))
        self._track(task)
        if timeout is not None:
            self._watch(loop, loop.time() + timeout, task, op)
        return task

    def _track(self, fut: asyncio.Future[Any]) -> None:
        """Count ``fut`` as in flight (aclose waits for it) until it is done."""
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)

    def _schedule(self, kind: str, fp: tuple[int, int, int, int, int],
                  build: Callable[[Op], list[Step]], result: Any,
                  timeout: float | None) -> asyncio.Future[Any]:
        """Like :meth:`_start` for an operation of one-frame steps: ``build(op)`` lists
        them and a :class:`Schedule` runs them from callbacks; the handle is a Future."""
        op, timeout = self._new_op(kind, fp, timeout)
        loop = asyncio.get_running_loop()
        handle: asyncio.Future[Any] = loop.create_future()
        sched = Schedule(self, kind, op, build(op), handle, result, timeout)
        handle.add_done_callback(sched.on_done)  # also drops it from _tasks
        self._tasks.add(handle)
        loop.call_soon(sched.start)
        if timeout is not None:
            self._watch(loop, loop.time() + timeout, handle, sched)
        return handle

    def _watch(self, loop: asyncio.AbstractEventLoop, deadline: float,
               task: asyncio.Future[Any], op: Op | Schedule) -> None:
        """Expire ``task`` at ``deadline``. One timer per group (a loop timer costs several
        microseconds, a heap push well under one): entries of finished tasks are dropped
        when they reach the top or when the heap outgrows the operations in flight."""
        heap = self._deadlines
        self._watch_count += 1
        heapq.heappush(heap, (deadline, self._watch_count, task, op))
        if len(heap) > 2 * len(self._tasks) + 64:
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

    def _unwatch(self) -> None:
        """Drop the deadline timer and its entries (the group is closed: no new ones)."""
        if self._watch_handle is not None:
            self._watch_handle.cancel()
            self._watch_handle = None
        self._watch_at = None
        self._deadlines.clear()

    def _on_deadline(self, loop: asyncio.AbstractEventLoop) -> None:
        self._watch_handle = None
        heap = self._deadlines
        now = loop.time()
        while heap and (heap[0][0] <= now or heap[0][2].done()):
            _, _, task, target = heapq.heappop(heap)
            if task.done():
                continue
            if isinstance(target, Schedule):
                target.expire()
            else:
                target.expired = True  # _run turns the cancellation into a PeerTimeout
                task.cancel()
        self._arm(loop)

    async def _run(self, kind: str, op: Op, body: Callable[[Op], Awaitable[T]],
                   timeout: float | None, registered: bool) -> T:
        fabric = self._fabric
        try:
            if fabric.failure is not None:  # broke after this op was called: its cause
                raise fabric.failure
            result = await body(op)
            await op.finish()
            self._done[kind] += 1
            return result
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if op.expired and task is not None and task.uncancel() == 0:
                # The deadline passed (not a cancellation by the caller): name the culprits.
                if fabric.failure is None:
                    err = await self._timeout_error(kind, op, timeout)
                    fabric.fail(err)  # no-op if a peer's ABORT arrived while probing
                assert fabric.failure is not None
                raise fabric.failure from None
            if op.moved_data():
                fabric.fail(GroupBrokenError(
                    f"{kind} (op #{op.seq}) was cancelled on rank {self.rank} with data "
                    "in flight"))
            raise
        except AiocollectError as exc:
            cause = fabric.cause(exc)
            if cause is not exc:  # the group broke first: report the cause, as every rank does
                raise cause from None
            raise
        finally:
            op.abandon()
            if registered:
                fabric.unregister(self._gid, op.seq)

    async def _timeout_error(self, kind: str, op: Op, timeout: float | None) -> PeerTimeout:
        """Name the ranks to blame: those that do not answer a liveness probe, else those
        that have not called this operation, else those it was still waiting for."""
        waited = op.silent_peers()
        others = [r for r in self._ranks if r != self._fabric.rank]
        absent: list[int] = []
        if op.kind == DATA:
            dead, absent = await self._fabric.survey(others, PROBE_SECONDS, self._gid, op.seq)
        else:  # point to point: no operation number to ask about
            dead = await self._fabric.probe(others, PROBE_SECONDS)
        if dead:
            silent, how = [self._ranks.index(r) for r in dead], "do not respond"
        elif absent:
            silent, how = [self._ranks.index(r) for r in absent], "have not called it"
        else:
            silent, how = waited, "sent nothing"
        return PeerTimeout(
            f"{kind} (op #{op.seq} of group {self.name!r}) on rank {self.rank} timed out "
            f"after {timeout:g} s: ranks {silent} {how}", silent)

    def _next_send(self, dst: int, tag: int) -> int:
        n = self._send_counters[(dst, tag)]
        self._send_counters[(dst, tag)] = n + 1
        return n

    def _next_recv(self, src: int, tag: int) -> int:
        n = self._recv_counters[(src, tag)]
        self._recv_counters[(src, tag)] = n + 1
        return n

    # -- closing ---------------------------------------------------------------------------

    async def aclose(self, timeout: float | None = 30.0) -> None:
        """Wait for in-flight operations (up to ``timeout``), say goodbye to every peer and
        release links, listener and owned store. Idempotent; never raises for a clean close.
        Closing the world group closes its sub-groups."""
        if self._closed:
            return
        if self._tasks and self._fabric.failure is None:
            _done, pending = await asyncio.wait(list(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        self._closed = True
        self._unwatch()
        for child in self._children:
            child._closed = True
            child._unwatch()
        if self._parent is not None:
            return
        if self._fabric.failure is None:
            self._fabric.goodbye()
        for fn in self._sync_closers:
            fn()
        for closer in self._closers:
            try:
                await closer()
            except Exception as exc:
                log.debug("error while closing group %r: %s", self.name, exc)

    def abort(self) -> None:
        """Break the group now on every rank (peers get GroupBrokenError promptly) and
        release its links. Never blocks; pending handles fail with GroupBrokenError."""
        root = self
        while root._parent is not None:
            root = root._parent
        if root._closed and self._closed:
            return
        self._fabric.fail(GroupBrokenError(f"group {self.name!r} aborted on rank {self.rank}"))
        root._closed = True
        root._unwatch()
        for child in root._children:
            child._closed = True
            child._unwatch()
        for fn in root._sync_closers:
            fn()
        loop = asyncio.get_running_loop()
        for closer in root._closers:
            task = loop.create_task(closer())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        root._closers.clear()
