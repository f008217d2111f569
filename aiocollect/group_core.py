"""GroupCore: sequence numbers, handles, close and abort (the methods live in group.py).

Every collective method checks its arguments (raising UsageError before anything is sent),
takes the next sequence number at call time, registers its fingerprint and returns an
``asyncio.Task`` running the algorithm (:meth:`GroupCore._start`), or a Future resolved by
a :class:`~aiocollect.engine.small.Quick` for one-frame operations
(:meth:`GroupCore._quick`). Several may run at once; ranks must call a group's
collectives in the same order.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from aiocollect._buffers import Array
from aiocollect.engine.fabric import Fabric
from aiocollect.engine.op import Op
from aiocollect.engine.small import Handle, Program, Quick, Small
from aiocollect.errors import (
    GroupBrokenError,
    MismatchError,
    PeerTimeout,
    UsageError,
)
from aiocollect.stats import LinkStatistics, Statistics
from aiocollect.transport.wire import DATA, P2P

log = logging.getLogger("aiocollect")

T = TypeVar("T")

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
#: naming it and the ranks not heard from, again after 2x, 4x ... that interval (at most
#: every 5 minutes); at most a quarter of its timeout.
PROGRESS_SECONDS = 30.0
#: Seconds ``aclose`` waits for the peers' GOODBYE (to compare what every rank called).
CLOSE_WAIT = 5.0
#: Seconds ``aclose`` then waits for the links to end where every peer said goodbye (as
#: long as a closing link lingers for its peer, transport/tcp.py LINGER), and where one did
#: not or the group failed (``Fabric.links_gone``); what is left then is reset.
CLOSE_END_WAIT = 5.0
CLOSE_END_GRACE = 0.5


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
        self._gid = gid
        self._ranks = ranks
        self.rank = ranks.index(fabric.rank)
        self.world_size = len(ranks)
        self.name = name
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._seq = 0
        # handles (and helper tasks: None) in flight, with what the progress ticker needs
        self._tasks: dict[asyncio.Future[Any], _Watched | None] = {}
        self._tick_handle: asyncio.TimerHandle | None = None
        self._progress: dict[asyncio.Future[Any], _Progress] = {}
        self._children: list[GroupCore] = []
        self._parent = parent
        self._closed = False
        self.store: Any = store
        self._send_counters: Counter[tuple[int, int]] = Counter()
        self._recv_counters: Counter[tuple[int, int]] = Counter()
        self._stats: Counter[str] = Counter()  # operations started, per kind
        self._done: Counter[str] = Counter()  # and completed
        self._deadlines: list[tuple[float, int, asyncio.Future[Any], Op | Quick]] = []
        self._watch_count = 0
        self._watch_at: float | None = None
        self._watch_handle: asyncio.TimerHandle | None = None
        #: operations in flight whose far deadline the ticker has put on the heap
        self._watched: set[asyncio.Future[Any]] = set()
        self._closers: list[Callable[[], Coroutine[Any, Any, None]]] = list(closers)
        #: The loop the group runs on, from its first one-frame operation (links are bound
        #: to one loop: a group is used on one).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sync_closers: list[Callable[[], None]] = list(sync_closers)
        #: What a collective's argument checks concluded, per (collective, dtype, size,
        #: op or root, algorithm) (group.py: a repeated call is one dict lookup).
        self._plans: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        fabric.deadlines.append(self._nearest_deadline)  # (until _unwatch)

    def __del__(self) -> None:
        # As asyncio does for a pending Task: a one-frame operation still pending when its
        # group is collected was never awaited (each is in ``_tasks`` until it ends, and
        # its Quick holds the group: both go together). Here, once per group, rather than
        # in a finalizer run for every operation. A warning only: it never raises (at
        # interpreter exit some of what it uses may be gone already).
        try:
            for handle, info in getattr(self, "_tasks", {}).items():
                if info is not None and isinstance(info[0], Quick) and not handle.done():
                    log.warning(
                        "%s (op #%d) was garbage-collected while pending: its handle was "
                        "never awaited and its group was dropped",
                        info[1],
                        info[0].seq,
                    )
        except Exception:  # (nothing to report to at that point)
            pass

    def _nearest_deadline(self) -> float | None:
        """The loop time of the nearest deadline among this group's operations in flight,
        or None (the fabric asks when a peer's relayed timeout blames this rank)."""
        soonest: float | None = None
        for fut, info in self._tasks.items():
            if info is None or fut.done() or info[3] is None:
                continue
            deadline = info[2] + info[3]
            if soonest is None or deadline < soonest:
                soonest = deadline
        return soonest

    def add_closer(self, closer: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Await ``closer`` when the group closes or aborts, after those already given
        (errors it raises are logged, not raised)."""
        self._closers.append(closer)

    # -- state -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after ``aclose()``/``abort()`` (or the parent group's close)."""
        return self._closed or (self._parent is not None and self._parent.closed)

    @property
    def broken(self) -> bool:
        return self._fabric.failure is not None

    def _check_usable(self) -> None:
        """Raise UsageError if closed, GroupBrokenError if broken."""
        if self._closed or (self._parent is not None and self._parent.closed):
            raise UsageError(f"group {self.name!r} is closed")
        if self._fabric.failure is not None:
            self._fabric.check()

    def statistics(self) -> Statistics:
        """Counters: operations started and completed per kind, bytes and frames moved per
        link, operations in flight, broken/closed (a :class:`~aiocollect.stats.Statistics`,
        which also reads like the dict it once was: ``stats["links"][1]["bytes_sent"]``)."""
        links = {
            peer: LinkStatistics(
                link.bytes_sent, link.bytes_received, link.frames_sent, link.frames_received
            )
            for peer, link in sorted(self._fabric.links.items())
        }
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
            fabric.register(self._gid, seq, fp, self._ranks)
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
        task.add_done_callback(self._untrack)
        if self._tick_handle is None:
            self._tick_handle = loop.call_later(CHECK_SECONDS, _tick, weakref.ref(self), loop)
        if timeout is not None and timeout < WATCH_AT_TICK:
            self._watch(loop, loop.time() + timeout, task, op)
        return task

    def _track(self, fut: asyncio.Future[Any]) -> None:
        """Count ``fut`` as in flight (aclose waits for it) until it is done."""
        self._tasks[fut] = None
        fut.add_done_callback(self._untrack)

    def _untrack(self, fut: asyncio.Future[Any]) -> None:
        self._tasks.pop(fut, None)

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
            self._fabric.register(self._gid, seq, small.fp, self._ranks)
        else:
            seq = counter
        loop = self._loop
        if loop is None:  # (asyncio.get_running_loop costs a getpid() system call)
            loop = self._loop = asyncio.get_running_loop()
        handle = Handle(loop=loop)
        quick = handle._quick = Quick(self, small, seq, buf, ufunc, handle, result, timeout)
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
        if self._tick_handle is None:
            self._tick_handle = loop.call_later(CHECK_SECONDS, _tick, weakref.ref(self), loop)
        if timeout is not None and timeout < WATCH_AT_TICK:
            self._watch(loop, now + timeout, handle, quick)
        return handle

    def _small(
        self,
        kind: str,
        program: Program,
        fp: tuple[int, int, int, int, int],
        nbytes: int,
        dtype: Any = None,
        frame_kind: int = DATA,
    ) -> Small:
        """``program`` bound to this group's links and frame headers, for buffers of
        ``dtype`` and frames of ``frame_kind`` (DATA, or P2P for send/recv): a plan's
        part."""
        fabric = self._fabric
        return Small(
            kind,
            program,
            self._gid,
            fp,
            self._ranks,
            fabric.links,
            nbytes,
            dtype,
            frame_kind,
            fabric.spins,
        )

    def _watch(
        self,
        loop: asyncio.AbstractEventLoop,
        deadline: float,
        task: asyncio.Future[Any],
        op: Op | Quick,
    ) -> None:
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
        self._watched.clear()
        if self._nearest_deadline in self._fabric.deadlines:
            self._fabric.deadlines.remove(self._nearest_deadline)

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
                target.expired = True  # _run turns the cancellation into a PeerTimeout
                task.cancel()
        self._arm(loop)

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
                fabric.unregister(self._gid, op.seq)

    async def _timeout_error(
        self, kind: str, op: Op | Quick, timeout: float | None
    ) -> PeerTimeout | MismatchError:
        """Name the ranks to blame: those that do not answer a liveness probe, else those
        that have not called this operation, else those it was still waiting for. A peer
        that called another operation at this sequence number makes it a MismatchError."""
        waited = op.silent_peers()
        others = [r for r in self._ranks if r != self._fabric.rank]
        absent: list[int] = []
        with self._fabric.diagnosing():  # a bystander's blame of this rank waits for it
            if op.kind == DATA:
                dead, absent, fps = await self._fabric.survey(
                    others, PROBE_SECONDS, self._gid, op.seq
                )
                mismatch = self._fabric.check_fingerprints(self._gid, op.seq, fps, self._ranks)
                if mismatch is not None:
                    return mismatch
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
            f"after {timeout:g} s: ranks {silent} {how}",
            silent,
        )

    # -- seeing progress (and mismatches) while an operation waits ------------------------

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every ``TICK`` s while operations are in flight: far deadlines
        (``WATCH_AT_TICK``) of operations seen for the first time go on the deadline
        heap; operations older than ``CHECK_SECONDS`` ask their peers what they called
        (:meth:`_check`); operations without progress for their interval log a WARNING."""
        self._tick_handle = None
        if self.closed or self._fabric.failure is not None:
            self._progress.clear()
            return
        now = loop.time()
        live = False
        for fut, info in list(self._tasks.items()):
            if info is None or fut.done():
                continue
            live = True
            op, kind, started, timeout = info
            if timeout is not None and timeout >= WATCH_AT_TICK and fut not in self._watched:
                self._watched.add(fut)  # (a deadline already passed fires at once)
                self._watch(loop, started + timeout, fut, op)
            age = now - started
            if age < CHECK_SECONDS:
                continue
            st = self._progress.get(fut)
            if st is None:
                st = self._progress[fut] = _Progress(op.progress(), age, timeout)
            if op.kind == DATA and not st.checking and age >= st.next_check:
                st.checking = True
                self._track(loop.create_task(self._check(op, st, loop)))
            if age >= st.next_warn:
                token = op.progress()
                if token == st.token:
                    self._warn_stalled(kind, op, st, now - st.since, timeout, age)
                    st.warn_every = min(st.warn_every * 2, 300.0)
                else:
                    st.token, st.since = token, now
                st.next_warn = age + st.warn_every
        for fut in [f for f in self._progress if f.done()]:
            del self._progress[fut]
        self._watched = {fut for fut in self._watched if not fut.done()}
        if live:
            self._tick_handle = loop.call_later(TICK, _tick, weakref.ref(self), loop)

    async def _check(self, op: Op | Quick, st: _Progress, loop: asyncio.AbstractEventLoop) -> None:
        """Ask the peers which operation they called at ``op``'s sequence number; one that
        called another breaks the group with MismatchError (on every rank, by the ABORT)."""
        fabric = self._fabric
        try:
            others = [r for r in op.ranks if r != fabric.rank]
            dead, absent, fps = await fabric.survey(others, PROBE_SECONDS, self._gid, op.seq)
            if fabric.failure is not None:
                return
            err = fabric.check_fingerprints(self._gid, op.seq, fps, self._ranks)
            if err is not None:
                fabric.fail(err)
                return
            st.absent = [self._ranks.index(r) for r in absent]
            st.dead = [self._ranks.index(r) for r in dead]
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
        parts = [f"waiting for ranks {op.silent_peers()}"]
        if st.dead:
            parts.append(f"ranks {st.dead} did not answer a ping")
        if st.absent:
            parts.append(f"ranks {st.absent} have not called it")
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
        self._unwatch()
        for child in self._children:
            child._closed = True
            child._unwatch()
        if self._parent is not None:
            return
        fabric = self._fabric
        if fabric.failure is None:
            # Close handshake: every rank's GOODBYE carries a digest of the operations it
            # called; a difference is a mismatch no frame revealed (e.g. a root mixed up
            # on a rank that only sends).
            fabric.goodbye()
            wait = CLOSE_WAIT if timeout is None else min(CLOSE_WAIT, timeout)
            mismatch = await fabric.farewell(wait)
            if mismatch is not None:
                fabric.fail(mismatch)
        fabric.close_links()
        # nothing outlives the close: the links end (or are reset) before it returns
        end_wait = CLOSE_END_WAIT if timeout is None else min(CLOSE_END_WAIT, timeout)
        await fabric.links_gone(end_wait, CLOSE_END_GRACE)
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
                message go to the peers ("rank 2 raised KeyError: 'missing'")."""
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
            self._fabric.abort_links()
        self._fabric.fail(exc)
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


#: Seconds between two looks of the progress ticker at the operations in flight.
TICK = 0.5

_Watched = tuple["Op | Quick", str, float, "float | None"]


def _tick(ref: weakref.ref[GroupCore], loop: asyncio.AbstractEventLoop) -> None:
    """The ticker holds its group weakly: a group dropped with operations in flight is
    collected (its pending handles then warn, see engine.small), not kept by the loop."""
    core = ref()
    if core is not None:
        core._tick(loop)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
