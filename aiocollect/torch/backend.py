"""``AiocollectProcessGroup``: a ``torch.distributed.ProcessGroup`` driven by aiocollect.

Each c10d method turns its tensors and options into a plan (see ``_ops``) on the calling
thread, then hands the plan to the process's loop thread, which issues the aiocollect
operations in call order and completes the returned :class:`~aiocollect.torch.work.Work`.

Failures: an operation that fails (mismatch, peer lost, timeout, a copy-back that fails)
completes its Work with the error (raised by ``wait()``) and its torch future with the same
error, except for calls made by autograd's engine (DistributedDataParallel's reducer and
its comm hooks), whose futures complete with a normal value: torch 2.13's reducer crashes
the process (SIGSEGV) on a failed future. The first failure of a collective is recorded;
every later call on the group raises GroupBrokenError naming it.

Order: collectives start in call order; ``barrier()`` completes only after every operation
issued before it on the group has completed (as gloo's does), and so does the Work that
``_end_coalescing`` returns for the operations issued since ``_start_coalescing``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

import aiocollect
from aiocollect.api import listen_host
from aiocollect.errors import GroupBrokenError, PeerTimeout, UsageError
from aiocollect.group import Group
from aiocollect.torch import _alltoall, _checks, _ops
from aiocollect.torch._loop import LoopThread, loop_thread
from aiocollect.torch._tensors import timeout_seconds
from aiocollect.torch.store import TorchStore
from aiocollect.torch.work import Work

log = logging.getLogger("aiocollect.torch")

BACKEND_NAME = "aiocollect"
_SHUTDOWN_TIMEOUT = 30.0


def _tensor_list(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def _root_tensors(value: Any) -> list[torch.Tensor]:
    """The root's tensor list of gather/scatter: c10d passes ``[tensors]`` or ``tensors``
    (empty on the other ranks)."""
    if not value:
        return []
    return list(value) if isinstance(value[0], torch.Tensor) else list(value[0])


def _opt(opts: Any, name: str, default: Any) -> Any:
    return getattr(opts, name, default) if opts is not None else default


_TIMEOUT_WORDING = re.compile(r" (Timed out|closed|timeout) ")


class CollectiveTimeout(PeerTimeout, RuntimeError):
    """A collective of the torch backend ran past its deadline: a
    :class:`~aiocollect.PeerTimeout` that is also the RuntimeError torch code expects, worded
    as torch's backends word it (``... Timed out waiting 1000ms ...``). ``__cause__`` is
    aiocollect's own error."""


class MonitoredBarrierError(PeerTimeout, RuntimeError):
    """Some ranks did not reach a monitored barrier in time; ``ranks`` lists them."""


def _timeout_error(exc: PeerTimeout, kind: str, seconds: float | None) -> PeerTimeout:
    if _TIMEOUT_WORDING.search(str(exc)):
        return exc
    waited = f"{seconds * 1000:.0f}ms" if seconds is not None else "past the group deadline"
    err = CollectiveTimeout(
        f"aiocollect {kind}: Timed out waiting {waited} for ranks {exc.ranks}: {exc}", exc.ranks
    )
    err.__cause__ = exc
    return err


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


@dataclass
class Options:
    """What ``pg.options`` shows (gloo's ``Options`` fields that apply): ``_timeout``, the
    default deadline of this group's collectives (``timedelta(0)``: none)."""

    _timeout: timedelta
    backend: str = BACKEND_NAME


class AiocollectProcessGroup(dist.ProcessGroup):
    """A c10d process group over an aiocollect :class:`~aiocollect.Group`.

    Created by torch through the registered backend (``init_process_group("aiocollect")``,
    ``new_group(...)``); see :func:`create_process_group`. Tensors must be on the CPU.

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
        return BACKEND_NAME

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._world

    # The base class keeps names in its backends, and this group has none.
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
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
        given = timeout_seconds(_opt(opts, "timeout", None))
        return given if given is not None else self._default_timeout

    def _launch(
        self,
        plan: _ops.Plan,
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
        plan: _ops.Plan,
        handles: _ops.Handles,
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
            exc = _timeout_error(
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

    # -- reductions ------------------------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        """All-reduce in place (``opts``: AllreduceOptions or a ReduceOp). Several tensors are
        several inputs, as with gloo: the reduction runs across all of them, and every one
        receives it. Sparse COO tensors: SUM only."""
        op = opts if _is_op(opts) else _opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = self._timeout(None if _is_op(opts) else opts)
        return self._launch(
            _ops.allreduce(_tensor_list(tensors), op, timeout), timeout, "all_reduce"
        )

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Work:
        """All-reduce each tensor of ``tensors`` (one dtype), as one flat buffer."""
        op = opts if _is_op(opts) else _opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = self._timeout(None if _is_op(opts) else opts)
        return self._launch(
            _ops.allreduce_coalesced(_tensor_list(tensors), op, timeout),
            timeout,
            "allreduce_coalesced",
        )

    def reduce(self, tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        """Reduce into ``opts.rootRank``'s tensor; other ranks' tensors are unchanged."""
        timeout = self._timeout(opts)
        plan = _ops.reduce(
            _tensor_list(tensors),
            _opt(opts, "rootRank", 0),
            _opt(opts, "reduceOp", dist.ReduceOp.SUM),
            self._rank,
            timeout,
            world=self._world,
            root_tensor=_opt(opts, "rootTensor", 0),
        )
        return self._launch(plan, timeout, "reduce")

    def reduce_scatter(  # type: ignore[override]
        self,
        output_tensors: Any,
        input_tensors: Any,
        opts: Any = None,
    ) -> Work:
        """Reduce the inputs (one list of world-size tensors per output), scatter blocks;
        ``inputs[i]`` may be shaped like rank i's output when ranks' outputs differ."""
        outputs = _tensor_list(output_tensors)
        inputs = [_tensor_list(x) for x in input_tensors]
        if inputs and isinstance(input_tensors[0], torch.Tensor):
            inputs = [list(input_tensors)]
        _checks.non_empty("reduce_scatter", outputs)
        if len(outputs) != len(inputs):
            raise _checks.fail(
                "reduce_scatter", "requires input/output tensor lists to have the same length"
            )
        op = _opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = self._timeout(opts)
        plans = [
            _ops.reduce_scatter(o, i, op, self._world, timeout, self._rank)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._launch(_ops.combine("reduce_scatter", plans), timeout, "reduce_scatter")

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Work:
        """Reduce ``input`` (world-size blocks) across ranks; this rank's block to ``output``."""
        op = _opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = self._timeout(opts)
        return self._launch(
            _ops.reduce_scatter_single(output, input, op, self._world, timeout),
            timeout,
            "_reduce_scatter_base",
        )

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        op = _opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = self._timeout(opts)
        plans = [
            _ops.reduce_scatter_single(o, i, op, self._world, timeout)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._launch(
            _ops.combine("reduce_scatter", plans), timeout, "reduce_scatter_tensor_coalesced"
        )

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    # -- data movement ---------------------------------------------------------------------

    def broadcast(  # type: ignore[override]
        self,
        tensors: Any,
        opts: Any = None,
        root: int | None = None,
    ) -> Work:
        """Copy ``opts.rootRank``'s ``tensors[opts.rootTensor]`` into every tensor of every
        rank (``broadcast(tensor, root=r)`` works too)."""
        if root is None:
            root = opts if isinstance(opts, int) else _opt(opts, "rootRank", 0)
        root_tensor = 0 if isinstance(opts, int) else _opt(opts, "rootTensor", 0)
        timeout = self._timeout(None if isinstance(opts, int) else opts)
        return self._launch(
            _ops.broadcast(
                _tensor_list(tensors),
                root,
                timeout,
                world=self._world,
                rank=self._rank,
                root_tensor=root_tensor,
            ),
            timeout,
            "broadcast",
        )

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Work:
        """Gather every rank's inputs: ``output_tensors[i][r * N + k]`` receives rank r's
        input k (N inputs per rank, as with gloo)."""
        inputs = _tensor_list(input_tensors)
        outputs = [_tensor_list(x) for x in output_tensors]
        if output_tensors and isinstance(output_tensors[0], torch.Tensor):
            outputs = [list(output_tensors)]
        timeout = self._timeout(opts)
        return self._launch(
            _ops.allgather_multi(outputs, inputs, self._world, timeout),
            timeout,
            "all_gather",
            inputs,
        )

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        """``output_lists[r][i]`` receives rank r's ``input_list[i]``."""
        timeout = self._timeout(opts)
        plan = _ops.allgather_coalesced(
            [list(o) for o in output_lists], list(input_list), self._world, timeout
        )
        return self._launch(plan, timeout, "allgather_coalesced", list(input_list))

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Work:
        """Gather every rank's ``input`` into consecutive blocks of ``output``."""
        timeout = self._timeout(opts)
        return self._launch(
            _ops.all_gather_single(output, input, self._world, timeout),
            timeout,
            "_allgather_base",
            [input],
        )

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        timeout = self._timeout(opts)
        plans = [
            _ops.all_gather_single(o, i, self._world, timeout)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._launch(
            _ops.combine("allgather", plans),
            timeout,
            "allgather_into_tensor_coalesced",
            list(inputs),
        )

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def gather(  # type: ignore[override]
        self,
        output_tensors: Any,
        input_tensors: Any,
        opts: Any = None,
    ) -> Work:
        """Gather every rank's input on ``opts.rootRank`` (``output_tensors[0]`` there)."""
        root = _opt(opts, "rootRank", 0)
        _checks.root_rank("gather", root, self._world)
        inputs = _tensor_list(input_tensors)
        _checks.single("gather", inputs, "input tensor list")
        outputs = self._root_tensors("gather", output_tensors, root, "output")
        timeout = self._timeout(opts)
        return self._launch(
            _ops.gather(outputs, inputs[0], root, self._rank, self._world, timeout),
            timeout,
            "gather",
            inputs,
        )

    def _root_tensors(self, name: str, nested: Any, root: int, what: str) -> list[Any]:
        """The root's list of per-rank tensors of gather/scatter (``[[t0, t1, ...]]``, or
        the flat list itself); empty elsewhere, where anything else is gloo's error."""
        outer = list(nested)
        if self._rank != root:
            if outer:
                raise _checks.fail(name, f"requires empty {what} on non-root")
            return []
        if outer and isinstance(outer[0], torch.Tensor):
            outer = [outer]  # a flat list: the root's tensors themselves
        _checks.single(name, outer, f"{what} list")
        return list(outer[0])

    def scatter(  # type: ignore[override]
        self,
        output_tensors: Any,
        input_tensors: Any,
        opts: Any = None,
    ) -> Work:
        """Scatter ``input_tensors[0]`` of ``opts.rootRank``, block i to rank i."""
        root = _opt(opts, "rootRank", 0)
        _checks.root_rank("scatter", root, self._world)
        outputs = _tensor_list(output_tensors)
        _checks.single("scatter", outputs, "output tensor list")
        inputs = self._root_tensors("scatter", input_tensors, root, "input")
        timeout = self._timeout(opts)
        return self._launch(
            _ops.scatter(outputs[0], inputs, root, self._rank, self._world, timeout),
            timeout,
            "scatter",
            inputs,
        )

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        """Send ``input_tensors[i]`` to rank i; receive rank j's into ``output_tensors[j]``."""
        timeout = self._timeout(opts)
        return self._launch(
            _alltoall.alltoall(
                list(output_tensors), list(input_tensors), self._rank, self._world, timeout
            ),
            timeout,
            "all_to_all",
            list(input_tensors),
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Work:
        """All-to-all along dim 0, evenly or with the given split sizes (rows per rank).
        Both tensors must be contiguous (as with gloo)."""
        _checks.contiguous("alltoall_base", input)
        _checks.contiguous("alltoall_base", output)
        timeout = self._timeout(opts)
        return self._launch(
            _alltoall.all_to_all_single(
                output,
                input,
                list(output_split_sizes),
                list(input_split_sizes),
                self._rank,
                self._world,
                timeout,
            ),
            timeout,
            "all_to_all",
            [input],
        )

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def barrier(self, opts: Any = None) -> Work:
        """Complete once every rank has entered and every operation this rank issued on the
        group before it has completed (``opts``: BarrierOptions or a timedelta)."""
        timeout = opts if isinstance(opts, timedelta) else _opt(opts, "timeout", None)
        seconds = timeout_seconds(timeout)
        if seconds is None:
            seconds = self._default_timeout
        return self._launch(_ops.barrier(seconds), seconds, "barrier", [], after=0)

    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier that names the ranks that did not arrive (gloo's monitored_barrier).

        Waits for this rank's earlier operations on the group, then meets the other ranks
        through the group's store: rank 0 waits for every rank, then releases them.

        Raises:
            MonitoredBarrierError: on rank 0, the first rank that did not arrive within
                ``timeout`` (every such rank with ``wait_all_ranks``), or ``Rank 0 timed out``
                when the time was up before it could look (a zero ``timeout``); on the
                others, rank 0 did not release them in time.
        """
        if isinstance(timeout, timedelta) and timeout.total_seconds() <= 0:
            seconds = 0.0  # gloo's meaning: no time at all
        else:
            given = timeout_seconds(timeout)
            seconds = given or self._default_timeout or self._group.timeout or 1800.0
        deadline = time.monotonic() + seconds
        self.barrier_local(seconds or None)
        n = self._monitored
        self._monitored += 1
        prefix = f"aiocollect/monitored/{n}"
        self._store.set(f"{prefix}/{self._rank}", "1")
        ms = f"{seconds * 1000:.0f} ms"
        if self._rank != 0:
            try:
                self._store.wait(
                    [f"{prefix}/released"],
                    timedelta(seconds=max(0.001, deadline - time.monotonic())),
                )
            except Exception as exc:
                raise MonitoredBarrierError(
                    f"Rank {self._rank} successfully reached monitoredBarrier, but received "
                    f"errors while waiting for rank 0 to release it within {ms} ({exc}). "
                    "Please check rank 0 logs for faulty rank.",
                    [0],
                ) from exc
            return
        missing: list[int] = []
        for peer in range(1, self._world):
            key = f"{prefix}/{peer}"
            left = deadline - time.monotonic()
            if left <= 0 and not missing and not self._store.check([key]):
                raise MonitoredBarrierError(
                    f"Rank 0 timed out in monitoredBarrier after {ms}", [peer]
                )
            try:
                if left <= 0 or missing:
                    if not self._store.check([key]):
                        raise TimeoutError(key)
                else:
                    self._store.wait([key], timedelta(seconds=left))
            except Exception:
                missing.append(peer)
                if not wait_all_ranks:
                    break
        if missing:
            who = (
                f"Rank {missing[0]}"
                if len(missing) == 1 and not wait_all_ranks
                else "Ranks " + ", ".join(map(str, missing))
            )
            raise MonitoredBarrierError(f"{who} failed to pass monitoredBarrier in {ms}", missing)
        self._store.set(f"{prefix}/released", "1")

    def barrier_local(self, timeout: float | None = None) -> None:
        """Block until every operation issued on this group before the call has completed
        (on this rank only; no message is sent)."""
        work = self._launch(_ops.nothing(), timeout, "wait_prior", [], after=0)
        work.wait()

    # -- point to point --------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Work:
        """Send to group rank ``dstRank``; matched by (source, tag) in order."""
        tensors = _tensor_list(tensors)
        return self._launch(
            _ops.send(tensors, dstRank, tag, self._default_timeout),
            self._default_timeout,
            "send",
            tensors,
        )

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Work:
        """Receive from group rank ``srcRank``."""
        tensors = _tensor_list(tensors)
        return self._launch(
            _ops.recv(tensors, srcRank, tag, self._default_timeout),
            self._default_timeout,
            "recv",
            tensors,
        )

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        """Receive from any rank; ``work._source_rank()`` tells which."""
        tensors = _tensor_list(tensors)
        return self._launch(
            _ops.recv(tensors, None, tag, self._default_timeout),
            self._default_timeout,
            "recvAnySource",
            tensors,
        )

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
        return self._launch(_ops.nothing("coalesced"), None, "coalesced", [], after=start)

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


def _is_op(value: Any) -> bool:
    return isinstance(value, (dist.ReduceOp, dist.ReduceOp.RedOpType))


def _listen_address(store: Store) -> str:
    """Where this rank's links listen: AIOCOLLECT_IFNAME's address, else the address that
    routes to torchrun's MASTER_ADDR or to the TCPStore's host, else loopback."""
    target = os.environ.get("MASTER_ADDR")
    inner: Any = store
    while target is None and isinstance(inner, PrefixStore):
        inner = inner.underlying_store
    if target is None and isinstance(inner, TCPStore):
        target = inner.host
    return listen_host(None, f"tcp://{target or '127.0.0.1'}:0")


def create_process_group(
    store: Store, rank: int, world_size: int, timeout: timedelta
) -> AiocollectProcessGroup:
    """The backend creator torch calls for ``init_process_group("aiocollect")`` and for
    every ``new_group`` of this backend.

    Forms an aiocollect group through ``store`` (the group's c10d PrefixStore) on this
    process's loop thread; blocks until every rank has joined.

    Raises:
        RendezvousTimeout: some ranks did not join within ``timeout`` (named).
        RendezvousError, StoreError, AuthenticationError: as their names say.
    """
    total = timeout.total_seconds() if isinstance(timeout, timedelta) else 0.0
    seconds = total if total > 0 else None
    adapter = TorchStore(store, timeout=seconds or 1800.0)
    thread = loop_thread()
    host = _listen_address(store)

    async def form() -> Group:
        # Incarnations of a group on one store (destroy + init again) get distinct names.
        generation = (await adapter.add("aiocollect/generation", 1) - 1) // world_size
        return await aiocollect.open_group(
            rank, world_size, store=adapter, name=f"torch-{generation}", timeout=seconds, host=host
        )

    group = thread.run(form())
    thread.track(group)
    return AiocollectProcessGroup(group, thread, store)


__all__ = ["BACKEND_NAME", "AiocollectProcessGroup", "create_process_group"]
