"""The machinery under every c10d method of the aiocollect process group: running a plan
on the loop thread and completing its Work, recording the first failure, sequence numbers,
the default timeout, coalescing, and the group's identity and lifecycle.

Each c10d method (``process_group``) turns its tensors and options into a plan on the
calling thread, then :meth:`PlanRunner._launch` hands the plan to the process's loop
thread, which issues the aiocollect operations in call order and completes the returned
:class:`~aiocollect.torch.work.Work`.

Failures: an operation that fails (mismatch, peer lost, timeout, a copy-back that fails)
completes its Work with the error (raised by ``wait()``) and its torch future with the same
error, except for calls made by autograd's engine (DistributedDataParallel's reducer and
its comm hooks), whose futures complete with a normal value: torch's reducer crashes the
process (SIGSEGV) on a failed future. The first failure of a collective is recorded; every
later call on the group raises GroupBrokenError naming it.

Order: collectives start in call order; an operation launched with ``after`` (barrier,
``_end_coalescing``) completes only after every operation issued before it on the group
since ``after`` has completed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from aiocollect.errors import GroupBrokenError, PeerTimeout, UsageError
from aiocollect.group import Group
from aiocollect.torch import _plan
from aiocollect.torch._loop import LoopThread
from aiocollect.torch._tensors import timeout_seconds
from aiocollect.torch.bridge import BACKEND_NAME, Options
from aiocollect.torch.errors import timeout_error
from aiocollect.torch.work import Work

log = logging.getLogger("aiocollect.torch")

_SHUTDOWN_TIMEOUT = 30.0


def opt(opts: Any, name: str, default: Any) -> Any:
    """Field ``name`` of a c10d options object, or ``default``.

    Args:
        opts: the options object, or None.
        name: the field.
        default: the value when ``opts`` is None or lacks the field.

    Returns:
        The field's value or ``default``.
    """
    return getattr(opts, name, default) if opts is not None else default


def _called_by_autograd() -> bool:
    """Whether the c10d call comes from autograd's engine or DistributedDataParallel (its
    reducer, its comm hooks): some Python frame of the call is theirs, or the call has no
    Python frame outside this package at all (an engine worker thread)."""
    frame = sys._getframe(2)
    outside = False
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_HERE):
            outside = True
            if any(part in name.replace(os.sep, "/") for part in _DDP_PATHS):
                return True
        frame = frame.f_back  # type: ignore[assignment]
    return not outside


_DDP_PATHS = (
    "/torch/autograd/",
    "/torch/nn/parallel/",
    "/torch/distributed/algorithms/ddp_comm_hooks/",
)
_HERE = os.path.dirname(os.path.abspath(__file__))


class PlanRunner(dist.ProcessGroup):
    """The base of :class:`~aiocollect.torch.AiocollectProcessGroup`: everything but the
    collective methods.

    Args:
        group: the formed aiocollect group (it lives on ``thread``'s loop).
        thread: the loop thread.
        store: the c10d store the group was formed on.
    """

    def __init__(self, group: Group, thread: LoopThread, store: Store) -> None:
        # torch 2.13 rejects the (store, rank, size) constructor for Python subclasses.
        super().__init__(group.rank, group.world_size)  # type: ignore[call-arg]
        self._store = store
        self._group = group
        self._thread = thread
        self._rank = group.rank
        self._world = group.world_size
        self._failure: BaseException | None = None
        self._group_name = ""
        self._group_desc = ""
        self._seq = 0  # c10d calls made (the sequence number), caller side
        self._inflight: dict[int, asyncio.Future[None]] = {}  # loop thread only
        self._default_timeout: float | None = None  # _set_default_timeout; None: the group's
        self._coalesce_from: int | None = None
        self._monitored = 0

    def __repr__(self) -> str:
        return f"AiocollectProcessGroup(rank={self._rank}, size={self._world})"

    # -- identity --------------------------------------------------------------------------

    def getBackendName(self) -> str:
        """Returns:
        ``"aiocollect"``.
        """
        return BACKEND_NAME

    def getRank(self) -> int:
        """Returns:
        This process's rank in the group.
        """
        return self._rank

    def getSize(self) -> int:
        """Returns:
        The group's size.
        """
        return self._world

    def setGroupName(self, name: str) -> None:
        """Record the group's name (the base class keeps names in its backends, and this
        group has none).

        Args:
            name: the name torch gives the group.
        """
        self._group_name = name

    def getGroupName(self) -> str:
        """Returns:
        The name set by :meth:`setGroupName` (empty before).
        """
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        """Record the group's description.

        Args:
            desc: the description torch gives the group.
        """
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        """Returns:
        The description set by :meth:`setGroupDesc` (empty before).
        """
        return self._group_desc

    @property
    def aiocollect_group(self) -> Group:
        """The underlying aiocollect group (use it only from the loop thread)."""
        return self._group

    @property
    def failure(self) -> BaseException | None:
        """The first error of a collective on this group, or None."""
        return self._failure

    def check(self) -> None:
        """Raise GroupBrokenError (caused by the first failure) if a collective failed."""
        if self._failure is not None:
            raise GroupBrokenError(
                f"aiocollect process group (rank {self._rank}) failed earlier: {self._failure!r}"
            ) from self._failure

    # -- running plans ---------------------------------------------------------------------

    def _timeout(self, opts: Any) -> float | None:
        given = timeout_seconds(opt(opts, "timeout", None))
        return given if given is not None else self._default_timeout

    def _launch(
        self,
        plan: _plan.Plan,
        timeout: float | None = None,
        title: str = "",
        inputs: list[torch.Tensor] | None = None,
        *,
        after: int | None = None,
    ) -> Work:
        """Start ``plan`` on the loop thread; return its Work at once.

        ``after``: the Work completes only once every operation issued on this group with a
        sequence number ``>= after`` and below its own has completed (barrier: 0).
        """
        self.check()
        seq = self._seq
        self._seq += 1
        work = Work(
            plan.result if plan.value is None else plan.value,
            self._thread,
            plan.kind,
            fail_future=not _called_by_autograd(),
        )
        group = self._group
        profile = _profile_start(
            f"{BACKEND_NAME}:{title or plan.kind}", plan.result if inputs is None else inputs
        )
        inference = torch.is_inference_mode_enabled() or any(t.is_inference() for t in plan.result)

        def begin() -> None:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            prior = (
                [] if after is None else [f for s, f in self._inflight.items() if after <= s < seq]
            )
            self._inflight[seq] = done
            try:
                handles = plan.start(group)
            except BaseException as exc:
                self._settled(work, exc, None, seq, timeout, profile)
                return
            task = loop.create_task(
                self._settle(plan, handles, prior, work, seq, timeout, profile, inference)
            )
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

        self._thread.call(begin)
        return work

    async def _settle(
        self,
        plan: _plan.Plan,
        handles: _plan.Handles,
        prior: list[asyncio.Future[None]],
        work: Work,
        seq: int,
        timeout: float | None,
        profile: Any,
        inference: bool,
    ) -> None:
        if handles or prior:
            await asyncio.wait([*handles, *prior])
        exc: BaseException | None = None
        for h in handles:
            err = (
                GroupBrokenError(f"{plan.kind} was cancelled: its group was closed or aborted")
                if h.cancelled()
                else h.exception()
            )
            if err is not None and exc is None:
                exc = err
        source = None
        if exc is None:
            try:
                with torch.inference_mode(inference):
                    source = plan.finish([h.result() for h in handles])
            except Exception as err:
                exc = err
        self._settled(work, exc, source, seq, timeout, profile)

    def _settled(
        self,
        work: Work,
        exc: BaseException | None,
        source: int | None,
        seq: int,
        timeout: float | None,
        profile: Any,
    ) -> None:
        if isinstance(exc, PeerTimeout):
            exc = timeout_error(
                exc, work._kind, timeout if timeout is not None else self._group.timeout
            )
        if exc is not None and not isinstance(exc, UsageError) and self._failure is None:
            self._failure = exc
            log.error("aiocollect.torch: %s failed on rank %d: %r", work, self._rank, exc)
        work._complete(exc, source)
        _profile_end(profile)
        done = self._inflight.pop(seq, None)
        if done is not None and not done.done():
            done.set_result(None)

    # -- sequence numbers, options ---------------------------------------------------------

    def _get_sequence_number_for_group(self) -> int:
        """The number of c10d calls made on this group (the same on every rank that made
        the same calls)."""
        return self._seq

    def _set_sequence_number_for_group(self) -> None:
        """Sequence numbers start at 0 on every rank; nothing to agree on."""

    @property
    def options(self) -> Options:
        """``_timeout``: the default deadline of this group's collectives."""
        seconds = self._default_timeout
        if seconds is None:
            seconds = self._group.timeout
        return Options(timedelta(seconds=seconds or 0.0))

    def _set_default_timeout(self, timeout: timedelta) -> None:
        """The deadline of the collectives called later without one of their own."""
        self._default_timeout = timeout_seconds(timeout)

    def barrier_local(self, timeout: float | None = None) -> None:
        """Block until every operation issued on this group before the call has completed.

        On this rank only; no message is sent.

        Args:
            timeout: seconds to wait (None: no limit).

        Raises:
            GroupBrokenError: an earlier collective of the group failed.
        """
        work = self._launch(_plan.nothing(), timeout, "wait_prior", [], after=0)
        work.wait()

    #: Read by torch releases whose ``batch_isend_irecv`` asks every group's backend (2.15):
    #: False, so it issues each operation on its own, as older releases do for this group.
    supports_coalescing = False

    def _get_backend(self, device: torch.device) -> PlanRunner:  # type: ignore[override]
        """This group is its own backend, for every device (it has no c10d backends).

        Args:
            device: the device asked about (any).

        Returns:
            The process group itself.
        """
        del device
        return self

    # -- coalescing ------------------------------------------------------------------------

    def _start_coalescing(self, device: torch.device) -> None:
        """Operations issued from now on run as issued; :meth:`_end_coalescing` returns one
        Work for all of them."""
        del device
        self._coalesce_from = self._seq

    def _end_coalescing(self, device: torch.device) -> Work:
        """A Work that completes when every operation issued since
        :meth:`_start_coalescing` has completed (and fails with the first that failed)."""
        del device
        start, self._coalesce_from = self._coalesce_from, None
        if start is None:
            raise UsageError("_end_coalescing without _start_coalescing")
        return self._launch(_plan.nothing("coalesced"), None, "coalesced", [], after=start)

    # -- lifecycle -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the aiocollect group gracefully (waits up to 30 s for pending work)."""
        if self._group.closed or self._thread.in_thread():
            return
        try:
            self._thread.run(self._group.aclose(_SHUTDOWN_TIMEOUT), _SHUTDOWN_TIMEOUT + 5)
        except Exception as exc:
            log.warning("aiocollect.torch: shutdown of %r: %r", self, exc)

    def abort(self) -> None:
        """Break the group on every rank now; pending work fails with GroupBrokenError."""
        if self._group.closed:
            return

        async def _abort() -> None:
            self._group.abort()

        if self._thread.in_thread():
            self._group.abort()
        else:
            self._thread.run(_abort(), _SHUTDOWN_TIMEOUT)


def _profile_start(name: str, inputs: list[torch.Tensor]) -> Any:
    """A profiler record of one c10d call (as gloo records ``gloo:all_reduce``), ended on
    completion, so it shows as an asynchronous event with the inputs' shapes; None when no
    profiler runs."""
    if not torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
        return None
    try:
        return torch.autograd._record_function_with_args_enter(  # type: ignore[attr-defined]
            name, *[t for t in inputs if isinstance(t, torch.Tensor)]
        )
    except Exception as exc:  # the profiler must never break a collective
        log.debug("aiocollect.torch: profiler record %s: %r", name, exc)
        return None


def _profile_end(handle: Any) -> None:
    if handle is not None:
        try:
            torch.autograd._record_function_with_args_exit(handle)  # type: ignore[attr-defined]
        except Exception as exc:
            log.debug("aiocollect.torch: profiler record end: %r", exc)
