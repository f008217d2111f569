"""``AiocollectProcessGroup``: the collective methods of the c10d process group that torch
creates for the ``"aiocollect"`` backend.

Each method reads its tensors and options, checks them as gloo does (raising on the
caller's thread, before anything is sent), builds a plan (``_reductions``, ``_movement``,
``_alltoall``) and launches it (``_runner``), returning its Work at once.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aiocollect.torch import _checks, _movement, _plan, _reductions, monitored
from aiocollect.torch._point_to_point import PointToPoint, tensor_list
from aiocollect.torch._runner import opt
from aiocollect.torch._tensors import timeout_seconds
from aiocollect.torch.work import Work


def _is_op(value: Any) -> bool:
    return isinstance(value, (dist.ReduceOp, dist.ReduceOp.RedOpType))


class AiocollectProcessGroup(PointToPoint):
    """A c10d process group over an aiocollect :class:`~aiocollect.Group`.

    Created by torch through the registered backend (``init_process_group("aiocollect")``,
    ``new_group(...)``); see :func:`~aiocollect.torch.create_process_group`. Tensors must
    be on the CPU.

    Args:
        group: the formed aiocollect group (it lives on ``thread``'s loop).
        thread: the loop thread.
        store: the c10d store the group was formed on.
    """

    # -- reductions ------------------------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        """All-reduce in place.

        Several tensors are several inputs, as with gloo: the reduction runs across all of them,
        and every one receives it. Sparse COO tensors: SUM only.

        Args:
            tensors: a tensor or a list of tensors of one dtype and shape.
            opts: AllreduceOptions (``reduceOp``, ``timeout``) or a ReduceOp; None: SUM.

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            GroupBrokenError: an earlier collective of the group failed.
            ArgumentError: the arguments fail gloo's checks (a RuntimeError and a UsageError;
                nothing is sent).
        """
        op = opts if _is_op(opts) else opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = self._timeout(None if _is_op(opts) else opts)
        return self._launch(
            _reductions.allreduce(tensor_list(tensors), op, timeout), timeout, "all_reduce"
        )

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Work:
        """All-reduce each tensor of ``tensors`` (one dtype), as one flat buffer.

        Args:
            tensors: the tensors, reduced in place.
            opts: AllreduceCoalescedOptions or a ReduceOp; None: SUM.

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            GroupBrokenError: an earlier collective of the group failed.
            ArgumentError: the arguments fail gloo's checks (a RuntimeError and a UsageError;
                nothing is sent).
        """
        op = opts if _is_op(opts) else opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = self._timeout(None if _is_op(opts) else opts)
        return self._launch(
            _reductions.allreduce_coalesced(tensor_list(tensors), op, timeout),
            timeout,
            "allreduce_coalesced",
        )

    def reduce(self, tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        """Reduce into ``opts.rootRank``'s tensor; other ranks' tensors are unchanged.

        Args:
            tensors: a single-element list (or one tensor).
            opts: ReduceOptions (``rootRank``, ``rootTensor``, ``reduceOp``, ``timeout``).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            GroupBrokenError: an earlier collective of the group failed.
            ArgumentError: the arguments fail gloo's checks (a RuntimeError and a UsageError;
                nothing is sent).
        """
        timeout = self._timeout(opts)
        plan = _reductions.reduce(
            tensor_list(tensors),
            opt(opts, "rootRank", 0),
            opt(opts, "reduceOp", dist.ReduceOp.SUM),
            self._rank,
            timeout,
            world=self._world,
            root_tensor=opt(opts, "rootTensor", 0),
        )
        return self._launch(plan, timeout, "reduce")

    def reduce_scatter(  # type: ignore[override]
        self,
        output_tensors: Any,
        input_tensors: Any,
        opts: Any = None,
    ) -> Work:
        """Reduce the inputs across ranks and scatter the blocks: rank i's output receives block i.

        Args:
            output_tensors: this rank's output tensor (or a list of them).
            input_tensors: per output, a list of world-size tensors; ``inputs[i]`` may be shaped
                like rank i's output when ranks' outputs differ in size.
            opts: its c10d options object (None: the defaults).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            GroupBrokenError: an earlier collective of the group failed.
            ArgumentError: the arguments fail gloo's checks (a RuntimeError and a UsageError;
                nothing is sent).
        """
        outputs = tensor_list(output_tensors)
        inputs = [tensor_list(x) for x in input_tensors]
        if inputs and isinstance(input_tensors[0], torch.Tensor):
            inputs = [list(input_tensors)]
        _checks.non_empty("reduce_scatter", outputs)
        if len(outputs) != len(inputs):
            raise _checks.fail(
                "reduce_scatter", "requires input/output tensor lists to have the same length"
            )
        op = opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = self._timeout(opts)
        plans = [
            _reductions.reduce_scatter(o, i, op, self._world, timeout, self._rank)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._launch(_plan.combine("reduce_scatter", plans), timeout, "reduce_scatter")

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Work:
        """Reduce ``input`` (world-size blocks) across ranks; this rank's block to ``output``.

        Args:
            output: this rank's block.
            input: world-size blocks, concatenated.
            opts: its c10d options object (None: the defaults).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            UsageError: the sizes or dtypes do not fit.
            GroupBrokenError: an earlier collective of the group failed.
        """
        op = opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = self._timeout(opts)
        return self._launch(
            _reductions.reduce_scatter_single(output, input, op, self._world, timeout),
            timeout,
            "_reduce_scatter_base",
        )

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        """``reduce_scatter_single`` of each ``(outputs[i], inputs[i])`` pair, as one call.

        Args:
            outputs: this rank's blocks.
            inputs: the inputs, world-size blocks each.
            opts: its c10d options object (None: the defaults).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            UsageError: the sizes or dtypes do not fit.
            GroupBrokenError: an earlier collective of the group failed.
        """
        op = opt(opts, "reduceOp", dist.ReduceOp.SUM)
        timeout = self._timeout(opts)
        plans = [
            _reductions.reduce_scatter_single(o, i, op, self._world, timeout)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._launch(
            _plan.combine("reduce_scatter", plans), timeout, "reduce_scatter_tensor_coalesced"
        )

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    # -- data movement ---------------------------------------------------------------------

    def broadcast(  # type: ignore[override]
        self,
        tensors: Any,
        opts: Any = None,
        root: int | None = None,
    ) -> Work:
        """Copy ``opts.rootRank``'s ``tensors[opts.rootTensor]`` into every tensor of every rank.

        Args:
            tensors: a tensor or a list of tensors of one dtype and shape.
            opts: BroadcastOptions, or the root rank as an int.
            root: the root rank, overriding ``opts`` (``broadcast(tensor, root=r)``).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            GroupBrokenError: an earlier collective of the group failed.
            ArgumentError: the arguments fail gloo's checks (a RuntimeError and a UsageError;
                nothing is sent).
        """
        if root is None:
            root = opts if isinstance(opts, int) else opt(opts, "rootRank", 0)
        root_tensor = 0 if isinstance(opts, int) else opt(opts, "rootTensor", 0)
        timeout = self._timeout(None if isinstance(opts, int) else opts)
        return self._launch(
            _movement.broadcast(
                tensor_list(tensors),
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
        """Gather every rank's inputs: ``output_tensors[i][r * N + k]`` receives rank r's input k.

        N inputs per rank, as with gloo; every output has the input's size.

        Args:
            output_tensors: one list of N x world tensors per input (or that list alone).
            input_tensors: this rank's N inputs (or one tensor).
            opts: its c10d options object (None: the defaults).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            GroupBrokenError: an earlier collective of the group failed.
            ArgumentError: the arguments fail gloo's checks (a RuntimeError and a UsageError;
                nothing is sent).
        """
        inputs = tensor_list(input_tensors)
        outputs = [tensor_list(x) for x in output_tensors]
        if output_tensors and isinstance(output_tensors[0], torch.Tensor):
            outputs = [list(output_tensors)]
        timeout = self._timeout(opts)
        return self._launch(
            _movement.allgather_multi(outputs, inputs, self._world, timeout),
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
        """``output_lists[r][i]`` receives rank r's ``input_list[i]``.

        Args:
            output_lists: world-size lists, each shaped like ``input_list``.
            input_list: this rank's inputs (one dtype; sizes may differ).
            opts: its c10d options object (None: the defaults).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            GroupBrokenError: an earlier collective of the group failed.
            ArgumentError: the arguments fail gloo's checks (a RuntimeError and a UsageError;
                nothing is sent).
        """
        timeout = self._timeout(opts)
        plan = _movement.allgather_coalesced(
            [list(o) for o in output_lists], list(input_list), self._world, timeout
        )
        return self._launch(plan, timeout, "allgather_coalesced", list(input_list))

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Work:
        """Gather every rank's ``input`` into consecutive blocks of ``output``.

        Args:
            output: world-size blocks of ``input``'s size (concatenated or stacked).
            input: this rank's block (it may be ``output``'s own block).
            opts: its c10d options object (None: the defaults).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            UsageError: the sizes or dtypes do not fit.
            GroupBrokenError: an earlier collective of the group failed.
        """
        timeout = self._timeout(opts)
        return self._launch(
            _movement.all_gather_single(output, input, self._world, timeout),
            timeout,
            "_allgather_base",
            [input],
        )

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        """``all_gather_single`` of each ``(outputs[i], inputs[i])`` pair, as one call.

        Args:
            outputs: the outputs, world-size blocks each.
            inputs: this rank's blocks.
            opts: its c10d options object (None: the defaults).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            UsageError: the sizes or dtypes do not fit.
            GroupBrokenError: an earlier collective of the group failed.
        """
        timeout = self._timeout(opts)
        plans = [
            _movement.all_gather_single(o, i, self._world, timeout)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._launch(
            _plan.combine("allgather", plans),
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
        """Gather every rank's input on ``opts.rootRank`` (into ``output_tensors[0]`` there).

        Args:
            output_tensors: on the root, ``[outputs]`` with world-size tensors; elsewhere empty.
            input_tensors: a single-element list (or one tensor).
            opts: GatherOptions (``rootRank``, ``timeout``).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            GroupBrokenError: an earlier collective of the group failed.
            ArgumentError: the arguments fail gloo's checks (a RuntimeError and a UsageError;
                nothing is sent).
        """
        root = opt(opts, "rootRank", 0)
        _checks.root_rank("gather", root, self._world)
        inputs = tensor_list(input_tensors)
        _checks.single("gather", inputs, "input tensor list")
        outputs = self._root_tensors("gather", output_tensors, root, "output")
        timeout = self._timeout(opts)
        return self._launch(
            _movement.gather(outputs, inputs[0], root, self._rank, self._world, timeout),
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
        """Scatter ``input_tensors[0]`` of ``opts.rootRank``, block i to rank i.

        Args:
            output_tensors: a single-element list (or one tensor) receiving this rank's block.
            input_tensors: on the root, ``[inputs]`` with world-size tensors; elsewhere empty.
            opts: ScatterOptions (``rootRank``, ``timeout``).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            GroupBrokenError: an earlier collective of the group failed.
            ArgumentError: the arguments fail gloo's checks (a RuntimeError and a UsageError;
                nothing is sent).
        """
        root = opt(opts, "rootRank", 0)
        _checks.root_rank("scatter", root, self._world)
        outputs = tensor_list(output_tensors)
        _checks.single("scatter", outputs, "output tensor list")
        inputs = self._root_tensors("scatter", input_tensors, root, "input")
        timeout = self._timeout(opts)
        return self._launch(
            _movement.scatter(outputs[0], inputs, root, self._rank, self._world, timeout),
            timeout,
            "scatter",
            inputs,
        )

    def barrier(self, opts: Any = None) -> Work:
        """Complete once every rank has entered and every earlier operation of this rank on
        the group has completed.

        Args:
            opts: BarrierOptions (``timeout``) or a timedelta; None: the default timeout.

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            GroupBrokenError: an earlier collective of the group failed.
        """
        timeout = opts if isinstance(opts, timedelta) else opt(opts, "timeout", None)
        seconds = timeout_seconds(timeout)
        if seconds is None:
            seconds = self._default_timeout
        return self._launch(_plan.barrier(seconds), seconds, "barrier", [], after=0)

    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier that names the ranks that did not arrive (gloo's monitored_barrier).

        See :func:`aiocollect.torch.monitored.monitored_barrier`.

        Args:
            timeout: how long to wait (None: the group's default timeout).
            wait_all_ranks: rank 0 names every rank that did not arrive.

        Raises:
            MonitoredBarrierError: some ranks did not arrive (or were not released) in time.
        """
        monitored.monitored_barrier(self, timeout, wait_all_ranks)


__all__ = ["AiocollectProcessGroup"]
