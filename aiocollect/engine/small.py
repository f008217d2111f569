"""Small operations without a Task: a callback-driven exchange schedule.

An operation whose every message fits in one frame spends most of its time in Python
overhead, not in moving bytes. For those the group runs a :class:`Schedule` instead of a
coroutine in a Task: a list of steps, each "send this frame to that peer and/or receive that
frame from that peer, then run a callback", advanced from the receive's completion
callback. The handle is a plain ``asyncio.Future``. This saves the Task, the coroutine
frames and one event-loop pass per step, which is most of a 4-byte allreduce's cost.

Same contract as the Task path (group_core): the first step runs on the next loop pass, so
cancelling the handle before then moves no data and leaves the group usable; cancelling it
later, a failed receive, or an error breaks the group; the deadline names the ranks to blame
through the group's probe.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from aiocollect._buffers import Array
from aiocollect.engine.fabric import Fabric
from aiocollect.engine.op import Op
from aiocollect.errors import GroupBrokenError

log = logging.getLogger("aiocollect")


class GroupCore(Protocol):
    """What a schedule needs of the group running it (group_core.GroupCore): its fabric,
    its rank, its bookkeeping of live and done operations, and its deadline probe. A
    protocol, so that the engine never imports the group layer above it."""

    @property
    def rank(self) -> int: ...

    @property
    def _fabric(self) -> Fabric: ...

    @property
    def _done(self) -> Counter[str]: ...

    @property
    def _tasks(self) -> MutableMapping[asyncio.Future[Any], Any]: ...

    def _track(self, fut: asyncio.Future[Any]) -> None: ...

    def _timeout_error(
        self, kind: str, op: Op, timeout: float | None
    ) -> Awaitable[BaseException]: ...


@dataclass(slots=True)
class Step:
    """One exchange: send ``send`` to ``peer`` (if given), receive into ``recv`` from
    ``peer`` (if given), then call ``then()`` once the receive landed."""

    peer: int
    slot: int
    send: Array | None
    recv: Array | None
    then: Callable[[], None] | None = None


class Schedule:
    """Runs ``steps`` of ``op`` in order and resolves ``handle`` with ``result``."""

    __slots__ = (
        "_flushed",
        "_i",
        "_released",
        "_timing_out",
        "_waiting",
        "core",
        "handle",
        "kind",
        "op",
        "result",
        "steps",
        "timeout",
    )

    def __init__(
        self,
        core: GroupCore,
        kind: str,
        op: Op,
        steps: list[Step],
        handle: asyncio.Future[Any],
        result: Any,
        timeout: float | None,
    ) -> None:
        self.core = core
        self.kind = kind
        self.op = op
        self.steps = steps
        self.handle = handle
        self.result = result
        self.timeout = timeout
        self._i = 0
        self._flushed = True  # nothing this schedule sent is still queued in user space
        self._timing_out = False
        self._released = False
        self._waiting: asyncio.Future[None] | None = None  # the receive the schedule awaits

    def __del__(self) -> None:
        # As asyncio does for a pending Task (the Task path gets asyncio's own warning).
        handle = getattr(self, "handle", None)
        if handle is not None and not handle.done():
            log.warning(
                "%s (op #%d) was garbage-collected while pending: its handle was "
                "never awaited and its group was dropped",
                self.kind,
                self.op.seq,
            )

    # -- running ---------------------------------------------------------------------------

    def start(self) -> None:
        """First step (scheduled with call_soon by the group)."""
        if self.handle.done():
            # Cancelled before it started: nothing moved. Like a Task cancelled before its
            # first step, the operation stays registered, so the peers' frames for it are
            # held rather than taken for a protocol error (docs/failures.md).
            return
        failure = self.core._fabric.failure
        if failure is not None:
            self._fail(failure)
            return
        self._advance()

    def _advance(self) -> None:
        op = self.op
        try:
            while self._i < len(self.steps):
                step = self.steps[self._i]
                fut = None
                if step.recv is not None:
                    # The hook goes on from the transport's read path as the frame lands
                    # (sending never reads, so not before the lines below); the done
                    # callback covers failures, and whichever comes second does nothing.
                    fut = op.recv(step.peer, step.slot, 0, step.recv, hook=self._landed)
                if step.send is not None:
                    op.send_now(step.peer, step.slot, 0, step.send)
                    self._flushed = False
                if fut is not None and not fut.done():
                    self._waiting = fut
                    fut.add_done_callback(self._landed)
                    return
                if not self._after(fut):
                    return
        except Exception as exc:
            self._fail(exc)
            return
        if not self._flushed and op.unsent():  # rare for one-frame messages: let a task
            self._spawn(self._drain())  # wait for the socket
            return
        self._succeed()

    def _after(self, fut: asyncio.Future[None] | None) -> bool:
        """The current step's receive (if any) is done: check it and run the step's
        callback. False if the schedule cannot go on synchronously."""
        if fut is not None:
            exc = (
                GroupBrokenError(f"{self.kind} (op #{self.op.seq}): receive withdrawn")
                if fut.cancelled()
                else fut.exception()
            )
            if exc is not None:
                self._fail(exc)
                return False
        step = self.steps[self._i]
        if step.then is not None and step.send is not None:
            if self.op.unsent():
                # The callback may rewrite the buffer still queued for sending: wait first.
                self._spawn(self._drain())
                return False
            self._flushed = True  # (the callback sends nothing: no second look at the end)
        return self._next()

    def _next(self) -> bool:
        """Run the current step's callback and move to the next step. False if the
        callback raised (the schedule failed)."""
        then = self.steps[self._i].then
        self._i += 1
        if then is not None:
            try:
                then()
            except Exception as exc:
                self._fail(exc)
                return False
        return True

    def _landed(self, fut: asyncio.Future[None]) -> None:
        if fut is not self._waiting:
            return  # seen already (hook, then done callback)
        self._waiting = None
        if self.handle.done() or self._timing_out:
            return
        if self._after(fut):
            self._advance()

    def _spawn(self, coro: Any) -> None:
        self.core._track(asyncio.get_running_loop().create_task(coro))

    async def _drain(self) -> None:
        """Wait until this op's frames left user space, then go on."""
        try:
            await self.op.finish()
        except Exception as exc:
            self._fail(exc)
            return
        if self.handle.done() or self._timing_out:
            return
        if self._i < len(self.steps):  # stopped before a step's callback
            if self._next():
                self._advance()
        else:
            self._succeed()

    # -- outcomes --------------------------------------------------------------------------

    def _succeed(self) -> None:
        self.core._done[self.kind] += 1
        self._release(withdraw=False)  # every receive landed: nothing to withdraw
        if not self.handle.done():
            self.handle.set_result(self.result)

    def _fail(self, exc: BaseException) -> None:
        # As _run does: anything but an aiocollect error is wrapped, and breaks the group.
        exc = self.core._fabric.cause(self.op.wrap(self.kind, exc))
        self._release()
        if not self.handle.done():
            self.handle.set_exception(exc)

    def on_done(self, handle: asyncio.Future[Any]) -> None:
        """The handle's done callback: it leaves the group's in-flight set, and a caller's
        cancellation after data moved breaks the group."""
        self.core._tasks.pop(handle, None)
        if handle.cancelled() and not self._timing_out:
            op = self.op
            if op.moved_data():
                self.core._fabric.fail(
                    GroupBrokenError(
                        f"{self.kind} (op #{op.seq}) was cancelled on rank {self.core.rank} with "
                        "data in flight"
                    )
                )
            if self._i or op.pending or op.moved_data():  # it started
                self._release()

    def expire(self) -> None:
        """The deadline passed: find whom to blame (a liveness probe), then fail."""
        if self.handle.done() or self._timing_out:
            return
        self._timing_out = True
        self._spawn(self._timeout())

    async def _timeout(self) -> None:
        core, op = self.core, self.op
        fabric = core._fabric
        if fabric.failure is None:
            err = await core._timeout_error(self.kind, op, self.timeout)
            fabric.fail(err)
        assert fabric.failure is not None
        self._release()
        if not self.handle.done():
            self.handle.set_exception(fabric.failure)

    def _release(self, withdraw: bool = True) -> None:
        """Unregister the operation once (``withdraw``: first withdraw the receives that
        have not landed; the success path has none)."""
        if self._released:
            return
        self._released = True
        op = self.op
        if withdraw:
            op.abandon()
        self.core._fabric.unregister(op.gid, op.seq)
