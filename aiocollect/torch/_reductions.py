"""Plans of the reducing c10d calls: allreduce (dense and sparse), allreduce_coalesced,
reduce and reduce_scatter (see ``_plan`` for what a plan is)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from aiocollect.errors import UsageError
from aiocollect.group import Group
from aiocollect.torch import _checks
from aiocollect.torch._plan import Handles, Plan, copy_into, flushing, prescaled
from aiocollect.torch._tensors import Staging, as_numpy, check_same, numel, reduce_op


def _local_reduce(tensors: list[torch.Tensor], op: Any) -> torch.Tensor:
    """The element-wise reduction of ``tensors`` (same dtype and shape) by a c10d ``op``,
    as one new contiguous tensor: a rank's several inputs count as that many inputs."""
    kind = getattr(op, "op", op)
    name = getattr(kind, "name", str(kind)).upper()
    with torch.no_grad():
        stacked = torch.stack([t.detach() for t in tensors])
        if name in ("SUM", "AVG", "PREMUL_SUM"):
            out = stacked.sum(0)
            if name == "AVG":  # the mean over ranks of the per-rank means
                out = out / len(tensors)
        elif name == "PRODUCT":
            out = stacked.prod(0)
        elif name == "MIN":
            out = stacked.amin(0)
        elif name == "MAX":
            out = stacked.amax(0)
        elif name in ("BAND", "BOR", "BXOR"):
            fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[
                name
            ]
            out = tensors[0].detach().clone()
            for t in tensors[1:]:
                out = fn(out, t.detach())
        else:
            raise UsageError(f"the aiocollect backend does not implement reduce op {op!r}")
        return out.to(tensors[0].dtype).contiguous()


def allreduce(tensors: list[torch.Tensor], op: Any, timeout: float | None) -> Plan:
    """Reduce across ranks and across the several tensors of each rank (gloo's meaning of a
    list); every tensor of every rank receives the result."""
    _checks.non_empty("allreduce", tensors)
    _checks.same_layout("allreduce", tensors)
    if tensors[0].layout == torch.sparse_coo:
        return sparse_allreduce(tensors, op, timeout)
    _checks.type_and_sizes("allreduce", tensors, tensors[0])
    rop, factor = reduce_op(op)
    staging = Staging()
    if len(tensors) == 1:
        arrays = [prescaled(staging.write(tensors[0], reducing=True), factor, copy=False)]

        def start(group: Group) -> Handles:
            return [group.allreduce(a, op=rop, timeout=timeout) for a in arrays]

        return Plan("allreduce", list(tensors), start, flushing(staging))
    buf = _local_reduce(tensors, op)
    arr = prescaled(as_numpy(buf, reducing=True), factor, copy=False)

    def start_many(group: Group) -> Handles:
        return [group.allreduce(arr, op=rop, timeout=timeout)]

    def finish(results: list[Any]) -> int | None:
        copy_into(tensors, buf)
        return None

    return Plan("allreduce", list(tensors), start_many, finish)


def allreduce_coalesced(tensors: list[torch.Tensor], op: Any, timeout: float | None) -> Plan:
    """All-reduce each tensor, as one flat buffer (a tensor listed twice gets the reduction
    of its value, as with gloo)."""
    # gloo's order: the list, the layouts, the types, then the layout's kind
    _checks.non_empty("allreduce_coalesced", tensors)
    _checks.same_layout("allreduce_coalesced", tensors)
    for t in tensors:
        if t.dtype != tensors[0].dtype:
            raise _checks.fail("allreduce_coalesced", "tensors must all have the same type")
    if tensors[0].layout != torch.strided:
        raise _checks.fail("allreduce_coalesced", f"unsupported layout: {tensors[0].layout}")
    rop, factor = reduce_op(op)
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    arr = prescaled(as_numpy(flat, reducing=True), factor, copy=False)

    def start(group: Group) -> Handles:
        return [group.allreduce(arr, op=rop, timeout=timeout)]

    def finish(results: list[Any]) -> int | None:
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = numel(t)
                t.copy_(flat[offset : offset + n].reshape(t.shape))
                offset += n
        return None

    return Plan("allreduce_coalesced", list(tensors), start, finish)


def sparse_allreduce(tensors: list[torch.Tensor], op: Any, timeout: float | None) -> Plan:
    """SUM of sparse COO tensors: every rank gathers every rank's indices and values
    (uneven sizes) and adds them up; each tensor is replaced by the coalesced sum."""
    kind = getattr(op, "op", op)
    if getattr(kind, "name", str(kind)).upper() != "SUM":
        raise _checks.fail(
            "allreduce", f"unsupported reduction operation {op!r} for sparse tensors (only SUM)"
        )
    for i, t in enumerate(tensors):
        if t.shape != tensors[0].shape:
            raise _checks.fail(
                "allreduce",
                f"invalid tensor size at index {i} (expected "
                f"{list(tensors[0].shape)}, got {list(t.shape)})",
            )
        if t.dtype != tensors[0].dtype:
            raise _checks.fail("allreduce", f"invalid tensor type at index {i}")
        if t.device.type != "cpu":
            raise UsageError(f"the aiocollect backend takes CPU tensors, got one on {t.device}")
    size, dtype = tensors[0].shape, tensors[0].dtype
    with torch.no_grad():
        local = tensors[0].detach()
        for t in tensors[1:]:
            local = local + t.detach()
        local = local.coalesce()
    sparse_dims = local.sparse_dim()
    dense_shape = tuple(local.values().shape[1:])
    indices = as_numpy(local.indices().contiguous())
    values = as_numpy(local.values().contiguous())

    def start(group: Group) -> Handles:
        return [
            group.allgatherv(indices, timeout=timeout),
            group.allgatherv(values, timeout=timeout),
        ]

    def finish(results: list[Any]) -> int | None:
        idx_parts = [
            torch.from_numpy(np.ascontiguousarray(p)).reshape(sparse_dims, -1) for p in results[0]
        ]
        val_parts = [
            torch.from_numpy(np.ascontiguousarray(p)).view(dtype).reshape(-1, *dense_shape)
            for p in results[1]
        ]
        with torch.no_grad():
            total = torch.sparse_coo_tensor(
                torch.cat(idx_parts, 1),
                torch.cat(val_parts, 0),
                size,
                dtype=dtype,
                check_invariants=True,
            ).coalesce()
            for t in tensors:
                t.copy_(total)
        return None

    return Plan("sparse_allreduce", list(tensors), start, finish)


def reduce(
    tensors: list[torch.Tensor],
    root: int,
    op: Any,
    rank: int,
    timeout: float | None,
    *,
    world: int,
    root_tensor: int = 0,
) -> Plan:
    _checks.root_rank("reduce", root, world)
    _checks.root_tensor("reduce", root_tensor, len(tensors))
    _checks.single("reduce", list(tensors), "tensor list")
    rop, factor = reduce_op(op)
    staging = Staging()
    arrays = []
    for t in tensors:
        if rank == root:
            arrays.append(prescaled(staging.write(t, reducing=True), factor, copy=False))
        else:  # other ranks' tensors stay unchanged
            arrays.append(
                prescaled(staging.read(t, reducing=True), factor, copy=factor is not None)
            )

    def start(group: Group) -> Handles:
        return [group.reduce(a, root=root, op=rop, timeout=timeout) for a in arrays]

    return Plan("reduce", list(tensors), start, flushing(staging))


def reduce_scatter_single(
    output: torch.Tensor, input_: torch.Tensor, op: Any, world: int, timeout: float | None
) -> Plan:
    rop, factor = reduce_op(op)
    if numel(input_) != world * numel(output) or input_.dtype != output.dtype:
        raise UsageError(
            f"reduce_scatter: input has {numel(input_)} elements of "
            f"{input_.dtype}; expected {world} x {numel(output)} of {output.dtype}"
        )
    staging = Staging()
    send = prescaled(staging.read(input_, reducing=True), factor, copy=factor is not None)
    out = staging.write(output, reducing=True)

    def start(group: Group) -> Handles:
        return [group.reduce_scatter(send, out=out, op=rop, timeout=timeout)]

    return Plan("reduce_scatter", [output], start, flushing(staging))


def _reduce_scatter_v(
    output: torch.Tensor, inputs: list[torch.Tensor], op: Any, rank: int, timeout: float | None
) -> Plan:
    """reduce_scatter where rank i's block has its own size (``inputs[i]`` is shaped like
    rank i's output): one allreduce of all the blocks, then this rank's block."""
    if numel(inputs[rank]) != numel(output):
        raise _checks.fail(
            "reduce_scatter",
            f"invalid tensor size: input {rank} has "
            f"{numel(inputs[rank])} elements, the output "
            f"{numel(output)}",
        )
    for i, t in enumerate(inputs):
        if t.dtype != output.dtype:
            raise _checks.fail("reduce_scatter", f"invalid tensor type at index {i}")
    rop, factor = reduce_op(op)
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1) for t in inputs])
    arr = prescaled(as_numpy(flat, reducing=True), factor, copy=False)
    start_at = sum(numel(t) for t in inputs[:rank])

    def start(group: Group) -> Handles:
        return [group.allreduce(arr, op=rop, timeout=timeout)]

    def finish(results: list[Any]) -> int | None:
        with torch.no_grad():
            output.copy_(flat[start_at : start_at + numel(output)].reshape(output.shape))
        return None

    return Plan("reduce_scatter", [output], start, finish)


def reduce_scatter(
    output: torch.Tensor,
    inputs: list[torch.Tensor],
    op: Any,
    world: int,
    timeout: float | None,
    rank: int = 0,
) -> Plan:
    if len(inputs) != world:
        raise _checks.fail(
            "reduce_scatter",
            f"invalid input tensor list (expected length {world}, got {len(inputs)})",
        )
    if any(numel(t) != numel(inputs[0]) for t in inputs):
        return _reduce_scatter_v(output, inputs, op, rank, timeout)
    check_same(inputs, numel(output), output.dtype, "reduce_scatter input")
    flat = torch.cat([t.detach().reshape(-1) for t in inputs]) if inputs else output.new_empty(0)
    return reduce_scatter_single(output, flat, op, world, timeout)
