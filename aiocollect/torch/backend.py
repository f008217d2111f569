"""``AiocollectProcessGroup``: a ``torch.distributed.ProcessGroup`` driven by aiocollect.

Each c10d method turns its tensors and options into a plan (see ``_ops``) on the calling
thread, then hands the plan to the process's loop thread, which issues the aiocollect
operations in call order and completes the returned :class:`~aiocollect.torch.work.Work`.

Failures: an operation that fails (mismatch, peer lost, timeout) completes its Work with the
error (raised by ``wait()``) but its torch future with a normal value, because torch 2.13's
DistributedDataParallel crashes the process on a failed future. The first failure is
recorded; every later call on the group raises GroupBrokenError naming it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

import aiocollect
from aiocollect.api import listen_host
from aiocollect.errors import GroupBrokenError, UsageError
from aiocollect.group import Group
from aiocollect.torch import _alltoall, _ops
from aiocollect.torch._loop import LoopThread, loop_thread
from aiocollect.torch._tensors import timeout_seconds
from aiocollect.torch.store import TorchStore
from aiocollect.torch.work import Work, completed_work

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
                f"aiocollect process group (rank {self._rank}) failed earlier: "
                f"{self._failure!r}") from self._failure

    # -- running plans ---------------------------------------------------------------------

    def _launch(self, plan: _ops.Plan) -> Work:
        """Start ``plan`` on the loop thread; return its Work at once."""
        self.check()
        work = Work(plan.result, self._thread, plan.kind)
        group = self._group

        def begin() -> None:
            try:
                handles = plan.start(group)
            except BaseException as exc:
                self._settled(work, exc)
                return
            task = asyncio.get_running_loop().create_task(self._settle(plan, handles, work))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

        self._thread.call(begin)
        return work

    async def _settle(self, plan: _ops.Plan, handles: _ops.Handles, work: Work) -> None:
        if handles:
            await asyncio.wait(handles)
        exc: BaseException | None = None
        for h in handles:
            err = GroupBrokenError(f"{plan.kind} was cancelled: its group was closed or "
                                   "aborted") if h.cancelled() else h.exception()
            if err is not None and exc is None:
                exc = err
        source = None
        if exc is None:
            try:
                source = plan.finish([h.result() for h in handles])
            except Exception as err:
                exc = err
        self._settled(work, exc, source)

    def _settled(self, work: Work, exc: BaseException | None, source: int | None = None) -> None:
        if exc is not None and not isinstance(exc, UsageError) and self._failure is None:
            self._failure = exc
            log.error("aiocollect.torch: %s failed on rank %d: %r", work, self._rank, exc)
        work._complete(exc, source)

    # -- reductions ------------------------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        """All-reduce in place (``opts``: AllreduceOptions or a ReduceOp)."""
        op = opts if _is_op(opts) else _opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = timeout_seconds(_opt(opts, "timeout", None))
        return self._launch(_ops.allreduce(_tensor_list(tensors), op, timeout))

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Work:
        """All-reduce each tensor of ``tensors``."""
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        """Reduce into ``opts.rootRank``'s tensor; other ranks' tensors are unchanged."""
        plan = _ops.reduce(_tensor_list(tensors), _opt(opts, "rootRank", 0),
                           _opt(opts, "reduceOp", dist.ReduceOp.SUM), self._rank,
                           timeout_seconds(_opt(opts, "timeout", None)))
        return self._launch(plan)

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any,  # type: ignore[override]
                       opts: Any = None) -> Work:
        """Reduce the inputs (one list of world-size tensors per output), scatter blocks."""
        outputs = _tensor_list(output_tensors)
        inputs = [_tensor_list(x) for x in input_tensors]
        if inputs and isinstance(input_tensors[0], torch.Tensor):
            inputs = [list(input_tensors)]
        op = _opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = timeout_seconds(_opt(opts, "timeout", None))
        plans = [_ops.reduce_scatter(o, i, op, self._world, timeout)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._launch(_ops.combine("reduce_scatter", plans))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Work:
        """Reduce ``input`` (world-size blocks) across ranks; this rank's block to ``output``."""
        op = _opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = timeout_seconds(_opt(opts, "timeout", None))
        return self._launch(_ops.reduce_scatter_single(output, input, op, self._world, timeout))

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Work:
        op = _opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = timeout_seconds(_opt(opts, "timeout", None))
        plans = [_ops.reduce_scatter_single(o, i, op, self._world, timeout)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._launch(_ops.combine("reduce_scatter", plans))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    # -- data movement ---------------------------------------------------------------------

    def broadcast(self, tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        """Copy ``opts.rootRank``'s tensors into every rank's."""
        root = opts if isinstance(opts, int) else _opt(opts, "rootRank", 0)
        timeout = timeout_seconds(_opt(opts, "timeout", None))
        return self._launch(_ops.broadcast(_tensor_list(tensors), root, timeout))

    def allgather(self, output_tensors: Any, input_tensors: Any,
                  opts: Any = None) -> Work:
        """Gather every rank's input into ``output_tensors[i]`` (one list per input)."""
        inputs = _tensor_list(input_tensors)
        outputs = [_tensor_list(x) for x in output_tensors]
        if output_tensors and isinstance(output_tensors[0], torch.Tensor):
            outputs = [list(output_tensors)]
        timeout = timeout_seconds(_opt(opts, "timeout", None))
        plans = [_ops.allgather(o, i, self._world, timeout)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._launch(_ops.combine("allgather", plans))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> Work:
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Work:
        """Gather every rank's ``input`` into consecutive blocks of ``output``."""
        timeout = timeout_seconds(_opt(opts, "timeout", None))
        return self._launch(_ops.all_gather_single(output, input, self._world, timeout))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> Work:
        timeout = timeout_seconds(_opt(opts, "timeout", None))
        plans = [_ops.all_gather_single(o, i, self._world, timeout)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._launch(_ops.combine("allgather", plans))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def gather(self, output_tensors: Any, input_tensors: Any,  # type: ignore[override]
               opts: Any = None) -> Work:
        """Gather every rank's input on ``opts.rootRank`` (``output_tensors[0]`` there)."""
        root = _opt(opts, "rootRank", 0)
        inputs = _tensor_list(input_tensors)
        outputs = _root_tensors(output_tensors)
        if len(inputs) != 1:
            raise UsageError(f"gather takes one input tensor per rank, got {len(inputs)}")
        timeout = timeout_seconds(_opt(opts, "timeout", None))
        return self._launch(_ops.gather(outputs, inputs[0], root, self._rank, self._world,
                                        timeout))

    def scatter(self, output_tensors: Any, input_tensors: Any,  # type: ignore[override]
                opts: Any = None) -> Work:
        """Scatter ``input_tensors[0]`` of ``opts.rootRank``, block i to rank i."""
        root = _opt(opts, "rootRank", 0)
        outputs = _tensor_list(output_tensors)
        inputs = _root_tensors(input_tensors)
        if len(outputs) != 1:
            raise UsageError(f"scatter takes one output tensor per rank, got {len(outputs)}")
        timeout = timeout_seconds(_opt(opts, "timeout", None))
        return self._launch(_ops.scatter(outputs[0], inputs, root, self._rank, self._world,
                                         timeout))

    def alltoall(self, output_tensors: list[torch.Tensor],
                 input_tensors: list[torch.Tensor], opts: Any = None) -> Work:
        """Send ``input_tensors[i]`` to rank i; receive rank j's into ``output_tensors[j]``."""
        timeout = timeout_seconds(_opt(opts, "timeout", None))
        return self._launch(_alltoall.alltoall(list(output_tensors), list(input_tensors),
                                               self._rank, self._world, timeout))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> Work:
        """All-to-all along dim 0, evenly or with the given split sizes (rows per rank)."""
        timeout = timeout_seconds(_opt(opts, "timeout", None))
        return self._launch(_alltoall.all_to_all_single(
            output, input, list(output_split_sizes), list(input_split_sizes), self._rank,
            self._world, timeout))

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def barrier(self, opts: Any = None) -> Work:
        """Complete once every rank has entered (``opts``: BarrierOptions or a timedelta)."""
        timeout = opts if isinstance(opts, timedelta) else _opt(opts, "timeout", None)
        return self._launch(_ops.barrier(timeout_seconds(timeout)))

    # -- point to point --------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Work:
        """Send to group rank ``dstRank``; matched by (source, tag) in order."""
        return self._launch(_ops.send(_tensor_list(tensors), dstRank, tag, None))

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Work:
        """Receive from group rank ``srcRank``."""
        return self._launch(_ops.recv(_tensor_list(tensors), srcRank, tag, None))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        """Receive from any rank; ``work._source_rank()`` tells which."""
        return self._launch(_ops.recv(_tensor_list(tensors), None, tag, None))

    # -- coalescing (no-op: every call is already asynchronous) ----------------------------

    def _start_coalescing(self, device: torch.device) -> None:
        del device

    def _end_coalescing(self, device: torch.device) -> Work:
        del device
        return completed_work([], self._thread, "coalescing")

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


def create_process_group(store: Store, rank: int, world_size: int,
                         timeout: timedelta) -> AiocollectProcessGroup:
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
        return await aiocollect.open_group(rank, world_size, store=adapter,
                                           name=f"torch-{generation}", timeout=seconds,
                                           host=host)

    group = thread.run(form())
    thread.track(group)
    return AiocollectProcessGroup(group, thread, store)


__all__ = ["BACKEND_NAME", "AiocollectProcessGroup", "create_process_group"]
