"""GroupCore: a group's lifecycle and its operations' bookkeeping.

Sequence numbers, starting operations (:meth:`GroupCore._start`: a Task running the
algorithm; :meth:`GroupCore._quick`: a one-frame operation, engine/small.py), the plans
remembered per call shape, statistics, ``aclose`` and ``abort``. The operations in flight
are the group's :class:`~aiocollect.engine.watchdog.Watchdog`'s (deadlines, progress,
stall warnings); the methods users call live in the package's other modules. Several
operations may run at once; ranks must call a group's collectives in the same order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from aiocollect._buffers import Array
from aiocollect.collectives import hierarchical
from aiocollect.collectives.neighbours import NEIGHBOUR_CODES, TWO_LEVEL_CODES, neighbours
from aiocollect.collectives.plan import Plan, Planner
from aiocollect.engine.fabric import Fabric
from aiocollect.engine.handle import Handle
from aiocollect.engine.op import Op
from aiocollect.engine.small import Quick, Small
from aiocollect.engine.watchdog import WATCH_AT_TICK, Watchdog
from aiocollect.errors import GroupBrokenError, MismatchError, UsageError
from aiocollect.stats import LinkStatistics, Statistics
from aiocollect.transport.wire import DATA, P2P

log = logging.getLogger("aiocollect")

T = TypeVar("T")

#: Seconds ``aclose`` waits for the peers' GOODBYE (to compare what every rank called).
CLOSE_WAIT = 5.0
#: Seconds ``aclose`` then waits for the links to end where every peer said goodbye (as
#: long as a closing link lingers for its peer, transport/tcp.py LINGER), and where one did
#: not or the group failed (``Fabric.links_gone``); what is left then is reset.
CLOSE_END_WAIT = 5.0
CLOSE_END_GRACE = 0.5
#: Plans (argument checks' conclusions) a group keeps, see ``GroupCore._remember``.
PLANS = 256


class GroupCore:
    """State and plumbing shared by the collective methods (see :class:`Group`)."""

    def __init__(
        self,
        fabric: Fabric,
        gid: int,
        ranks: list[int],
        *,
        timeout: float | None,
        chunk_bytes: int,
        name: str,
        parent: GroupCore | None = None,
        store: Any = None,
        closers: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
        sync_closers: Sequence[Callable[[], None]] = (),
    ) -> None:
        """``store``: the store the group was formed through (kept as :attr:`store`).
        ``sync_closers`` run first and ``closers`` (awaited) next, each in order, when the
        group closes or aborts: what the opener holds for it (its endpoint, an owned
        store). More can be added later with :meth:`add_closer`."""
        self._fabric = fabric
        self._registry = fabric.registry  # (operations register per call)
        self._gid = gid
        self._ranks = ranks
        self.rank = ranks.index(fabric.rank)
        self.world_size = len(ranks)
        self.name = name
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._seq = 0
        #: The operations in flight: deadlines, progress checks, stall warnings
        #: (engine/watchdog.py); its ``tasks`` are the handles in flight.
        self._watchdog = watchdog = Watchdog(fabric, gid, ranks, name)
        self._tasks = watchdog.tasks
        self._children: list[GroupCore] = []
        self._parent = parent
        self._closed = False
        self.store: Any = store
        self._send_counters: Counter[tuple[int, int]] = Counter()
        self._recv_counters: Counter[tuple[int, int]] = Counter()
        self._stats: Counter[str] = Counter()  # operations started, per kind
        self._done = watchdog.done  # and completed
        self._closers: list[Callable[[], Coroutine[Any, Any, None]]] = list(closers)
        #: The loop the group runs on, from its first one-frame operation (links are bound
        #: to one loop: a group is used on one).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sync_closers: list[Callable[[], None]] = list(sync_closers)
        #: A call's checks and choices (collectives/plan.py).
        self._planner = Planner(fabric, gid, ranks, chunk_bytes)
        #: What a call's checks concluded, per call shape (collective, dtype, size or
        #: shape, op or root, algorithm; peer and tag for send/recv): a repeated call is
        #: one dict lookup.
        self._plans: dict[tuple[Any, ...], Plan] = {}
        #: Whether this group's every link is made (else operations make the links they
        #: need first: :meth:`_link`), and the world ranks of its algorithms' neighbours.
        links = fabric.links
        self._linked = all(r in links for r in ranks if r != fabric.rank)
        self._near = [ranks[g] for g in sorted(neighbours(len(ranks), self.rank))]

    async def link_neighbours(self, timeout: float | None) -> None:
        """Make the links to this group's neighbours (``collectives/neighbours.py``) that
        do not exist yet (a sub-group's, which its parent's links need not include).

        Raises:
            PeerTimeout: not linked within ``timeout`` seconds.
            PeerDisconnected: a neighbour could not be reached.
        """
        if not self._linked:
            await self._fabric.ensure(self._near, timeout)

    async def _link(self, op: Op, timeout: float | None) -> None:
        """Make the links ``op`` needs that do not exist yet: its group's neighbours for an
        algorithm of ``NEIGHBOUR_CODES``, the two-level peers for a two-level one
        (``Topology.two_level_peers``), else every rank of its group."""
        code = op.fp[0]
        if code in NEIGHBOUR_CODES:
            await self._fabric.ensure(self._near, timeout)
            return
        if code in TWO_LEVEL_CODES:
            peers = hierarchical.topology(op).two_level_peers(op.fp[4])
            await self._fabric.ensure([self._ranks[g] for g in peers], timeout)
            return
        await self._fabric.ensure(self._ranks, timeout)
        self._linked = True
        self._plans.clear()  # (plans made without a link run as Tasks: made again, bound)

    def add_closer(self, closer: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Await ``closer`` when the group closes or aborts, after those already given.

        Args:
            closer: a coroutine function of no arguments; errors it raises are logged, not
                raised.
        """
        self._closers.append(closer)

    # -- state -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after ``aclose()``/``abort()`` (or the parent group's close)."""
        return self._closed or (self._parent is not None and self._parent.closed)

    @property
    def broken(self) -> bool:
        """True once the group failed (an operation's failure, a peer's ABORT, ``abort()``):
        every later call raises GroupBrokenError."""
        return self._fabric.failure is not None

    def _plan(self, key: tuple[Any, ...]) -> Plan | None:
        """The plan remembered for ``key``, or None (also for an unhashable key: not valid
        arguments, whose checks then say why)."""
        try:
            return self._plans.get(key)
        except TypeError:
            return None

    def _remember(self, key: tuple[Any, ...], plan: Plan) -> Plan:
        """Keep ``plan`` for ``key`` (unhashable keys are not kept; at most ``PLANS``: a
        program calling with ever new sizes starts over rather than grow)."""
        plans = self._plans
        if len(plans) >= PLANS:
            plans.clear()
        with contextlib.suppress(TypeError):
            plans[key] = plan
        return plan

    def _check_usable(self) -> None:
        """Raise UsageError if closed, GroupBrokenError if broken."""
        if self._closed or (self._parent is not None and self._parent.closed):
            raise UsageError(f"group {self.name!r} is closed")
        if self._fabric.failure is not None:
            self._fabric.check()

    def statistics(self) -> Statistics:
        """Counters: operations started and completed per kind, bytes and frames moved per
        link, operations in flight, broken/closed (a :class:`~aiocollect.stats.Statistics`,
        which also reads like a dict: ``stats["links"][1]["bytes_sent"]``).

        Returns:
            A snapshot of the counters (later operations do not change it).
        """
        links = {
            peer: LinkStatistics(
                link.bytes_sent, link.bytes_received, link.frames_sent, link.frames_received
            )
            for peer, link in sorted(self._fabric.links.items())
        }
        hosts, me = self._fabric.hosts, self._fabric.rank
        here = hosts[me] if me < len(hosts) else None
        same = [s for p, s in links.items() if here is not None and hosts[p] == here]
        cross = [s for p, s in links.items() if here is None or hosts[p] != here]
        ops = {f"{kind}_started": n for kind, n in self._stats.items()}
        ops.update((f"{kind}_completed", n) for kind, n in self._done.items())
        return Statistics(
            rank=self.rank,
            world_size=self.world_size,
            ops=ops,
            in_flight=len(self._tasks),
            links=links,
            broken=self.broken,
            closed=self.closed,
            topology=self._planner.topology.describe(),
            same_host=_summed(same),
            cross_host=_summed(cross),
        )

    # -- running operations ----------------------------------------------------------------

    def _timeout_arg(self, timeout: float | None) -> float | None:
        if timeout is None:
            return self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise UsageError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)

    def _new_op(
        self,
        kind: str,
        fp: tuple[int, int, int, int, int],
        timeout: float | None,
        p2p: tuple[int, int] | None = None,
    ) -> tuple[Op, float | None]:
        """Check the group can start an operation, take its sequence number (a collective)
        or use ``p2p``'s (counter, tag), and count it. Returns the Op and its deadline in
        seconds (or None)."""
        fabric = self._fabric
        # One copy of each check: the two calls cost ~14 opcodes and 2 Python calls per
        # operation over inlined tests (tools/opcodes.py), about 1 % of a small one.
        self._check_usable()
        timeout = self._timeout_arg(timeout)
        if p2p is None:
            seq = self._seq
            self._seq = seq + 1
            self._registry.register(self._gid, seq, fp, self._ranks)
            op = Op(fabric, self._gid, seq, fp, self._ranks, self.rank, self.chunk_bytes, DATA)
        else:
            op = Op(fabric, self._gid, p2p[0], fp, self._ranks, self.rank, self.chunk_bytes, P2P)
        self._stats[kind] += 1
        return op, timeout

    def _start(
        self,
        kind: str,
        fp: tuple[int, int, int, int, int],
        body: Callable[[Op], Awaitable[T]],
        timeout: float | None,
        *,
        p2p: tuple[int, int] | None = None,
    ) -> asyncio.Task[T]:
        """Take a sequence number and start ``body`` as a task (the handle).

        This is the per-operation hot path: one Task (no ``asyncio.timeout`` context, no
        timer per operation: the deadline goes on the group's heap, by the ticker where it
        is ``WATCH_AT_TICK`` or more away), no other allocation beyond the Op.
        """
        op, timeout = self._new_op(kind, fp, timeout, p2p)
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._run(kind, op, body, timeout, p2p is None))
        self._tasks[task] = (op, kind, loop.time(), timeout)
        watchdog = self._watchdog
        task.add_done_callback(watchdog.untrack)
        if watchdog.ticking is None:
            watchdog.ticking = watchdog.start_ticking(loop)
        if timeout is not None and timeout < WATCH_AT_TICK:
            watchdog.watch(loop, loop.time() + timeout, task, op)
        return task

    def _quick(
        self,
        small: Small,
        buf: Array,
        ufunc: Any,
        result: Any,
        timeout: float | None,
        counter: int | None = None,
    ) -> Handle:
        """Like :meth:`_start` for a one-frame operation: ``small``'s program runs over
        ``buf`` as a :class:`Quick` (no Task, no Op) whose first step runs before this
        returns; the handle is a Future. A collective takes the next sequence number; send
        and recv (``small.frame_kind`` P2P) use their (peer, tag) message ``counter``."""
        if self._closed or self._parent is not None or self._fabric.failure is not None:
            self._check_usable()
        timeout = self.timeout if timeout is None else self._timeout_arg(timeout)
        if counter is None:
            seq = self._seq
            self._seq = seq + 1
            self._registry.register(self._gid, seq, small.fp, self._ranks)
        else:
            seq = counter
        loop = self._loop
        if loop is None:  # (asyncio.get_running_loop costs a getpid() system call)
            loop = self._loop = asyncio.get_running_loop()
        handle = Handle(loop=loop)
        watchdog = self._watchdog
        quick = handle._quick = Quick(watchdog, small, seq, buf, ufunc, handle, result, timeout)
        now = loop.time()
        # The first step runs here, in the call: it posts the first receive and sends the
        # first frame (one loop pass less per operation than a call_soon; docs/design.md,
        # "Sent in the call"), so cancelling the handle of an operation that sends first
        # breaks the group even right after the call. The bookkeeping that no step reads
        # comes after it, so the frame leaves sooner; an operation that completed or failed
        # in the call is neither in flight nor watched.
        quick._go()
        kind = small.kind
        self._stats[kind] += 1
        if handle.done():
            return handle
        self._tasks[handle] = (quick, kind, now, timeout)
        if watchdog.ticking is None:
            watchdog.ticking = watchdog.start_ticking(loop)
        if timeout is not None and timeout < WATCH_AT_TICK:
            watchdog.watch(loop, now + timeout, handle, quick)
        return handle

    async def _run(
        self,
        kind: str,
        op: Op,
        body: Callable[[Op], Awaitable[T]],
        timeout: float | None,
        registered: bool,
    ) -> T:
        fabric = self._fabric
        try:
            if fabric.failure is not None:  # broke after this op was called: its cause
                raise fabric.failure
            if not self._linked and registered:  # (send and recv link their peer)
                await self._link(op, timeout)
            result = await body(op)
            await op.finish()
            self._done[kind] += 1
            return result
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if op.expired and task is not None and task.uncancel() == 0:
                # The deadline passed (not a cancellation by the caller): name the culprits.
                if fabric.failure is None:
                    err = await self._watchdog.timeout_error(kind, op, timeout)
                    fabric.fail(err)  # no-op if a peer's ABORT arrived while probing
                assert fabric.failure is not None
                raise fabric.failure from fabric.failure.__cause__
            if op.moved_data():
                fabric.fail(
                    GroupBrokenError(
                        f"{kind} (op #{op.seq}) was cancelled on rank {self.rank} with data "
                        "in flight"
                    )
                )
            raise
        except Exception as exc:
            # Not an aiocollect error: a bug, wrapped (InternalError) and breaking the group
            # on every rank all the same.
            cause = fabric.cause(op.wrap(kind, exc))
            if cause is not exc:  # the group broke first (or it was wrapped): report that
                raise cause from cause.__cause__  # keep the cause's own __cause__
            raise
        finally:
            op.abandon()
            if registered:
                self._registry.unregister(self._gid, op.seq)

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
        """Wait for in-flight operations (up to ``timeout``), say goodbye to every peer,
        wait (up to ``CLOSE_WAIT`` s, at most ``timeout``) for theirs, close every link and
        wait for it to end (up to ``CLOSE_END_WAIT`` s where every peer said goodbye, else
        ``CLOSE_END_GRACE``; then it is reset: no connection outlives the call), and
        release listener and owned store. Idempotent; never raises for a clean close.
        Closing the world group closes its sub-groups.

        Args:
            timeout: seconds to wait for operations in flight (then they are cancelled)
                and at most for the peers' goodbyes and the links' end; None: no limit for
                the operations.

        Raises:
            MismatchError: the ranks called different operations and no operation of this
                rank has reported it yet (its operations all succeeded): found by the close
                handshake, or relayed by a peer while this rank waited.
        """
        if self._closed:
            return
        if self._tasks and self._fabric.failure is None:
            _done, pending = await asyncio.wait(list(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        self._closed = True
        self._watchdog.stop()
        for child in self._children:
            child._closed = True
            child._watchdog.stop()
        if self._parent is not None:
            return
        fabric = self._fabric
        if fabric.failure is None:
            # Close handshake: every rank's GOODBYE carries a digest of the operations it
            # called; a difference is a mismatch no frame revealed (e.g. a root mixed up
            # on a rank that only sends).
            fabric.closer.goodbye()
            wait = CLOSE_WAIT if timeout is None else min(CLOSE_WAIT, timeout)
            mismatch = await fabric.closer.farewell(wait)
            if mismatch is not None:
                fabric.fail(mismatch)
        fabric.closer.close_links()
        # nothing outlives the close: the links end (or are reset) before it returns
        end_wait = CLOSE_END_WAIT if timeout is None else min(CLOSE_END_WAIT, timeout)
        await fabric.closer.links_gone(end_wait, CLOSE_END_GRACE)
        for fn in self._sync_closers:
            fn()
        for closer in self._closers:
            try:
                await closer()
            except Exception as exc:
                log.debug("error while closing group %r: %s", self.name, exc)
        failure = fabric.failure
        if isinstance(failure, MismatchError) and not fabric.reported:
            # this rank's operations all succeeded, but the ranks disagreed about one
            fabric.reported = True
            raise failure

    def abort(self, reason: BaseException | None = None) -> None:
        """Break the group now on every rank (peers get GroupBrokenError promptly) and
        release its links. Never blocks; pending handles fail with GroupBrokenError. On a
        group that is already broken it resets every link still flushing (its ABORT was
        sent when the group broke), so no socket outlives the call.

        Args:
            reason: the exception that made this rank give up, if any: its type and
                message go to the peers ("rank 2 raised KeyError: 'missing'").

        Raises:
            RuntimeError: no running event loop (the closers run as tasks on it).
        """
        root = self
        while root._parent is not None:
            root = root._parent
        if root._closed and self._closed:
            return
        if reason is None:
            exc = GroupBrokenError(f"group {self.name!r} aborted on rank {self.rank}")
        else:
            exc = GroupBrokenError(
                f"rank {self.rank} raised {_describe(reason)} (group {self.name!r} aborted)"
            )
            exc.raised = True  # type: ignore[attr-defined]
            exc.__cause__ = reason
        if self._fabric.failure is not None:
            # Broken before: the ABORT went out then, and links still flushing to peers
            # that stopped reading would otherwise linger past the loop's end.
            self._fabric.closer.abort_links()
        self._fabric.fail(exc)
        root._closed = True
        root._watchdog.stop()
        for child in root._children:
            child._closed = True
            child._watchdog.stop()
        for fn in root._sync_closers:
            fn()
        loop = asyncio.get_running_loop()
        for closer in root._closers:
            task = loop.create_task(closer())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        root._closers.clear()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _summed(links: Sequence[LinkStatistics]) -> LinkStatistics:
    """The counters of ``links`` added up."""
    return LinkStatistics(
        sum(s.bytes_sent for s in links),
        sum(s.bytes_received for s in links),
        sum(s.frames_sent for s in links),
        sum(s.frames_received for s in links),
    )
