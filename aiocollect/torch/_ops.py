"""Plans: one c10d collective call translated into aiocollect operations.

A builder runs on the caller's thread: it checks the tensors (UsageError, before anything is
sent), takes numpy views or staging copies, and returns a :class:`Plan`. The plan's
``start`` runs later on the loop thread and issues the aiocollect calls synchronously, so
sequence numbers follow the order of the torch calls; ``finish`` copies results back into
the caller's tensors once every handle has finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from aiocollect._buffers import Array
from aiocollect.errors import UsageError
from aiocollect.group import Group
from aiocollect.torch._tensors import Staging, as_numpy, check_same, numel, reduce_op

Handles = list["asyncio.Future[Any]"]


def _no_result(results: list[Any]) -> int | None:
    del results
    return None


@dataclass
class Plan:
    """What one torch call does: ``start(group)`` on the loop thread returns the aiocollect
    handles; ``finish(results)`` runs after all succeeded and may return a source rank."""

    kind: str
    result: list[torch.Tensor]
    start: Callable[[Group], Handles]
    finish: Callable[[list[Any]], int | None] = field(default=_no_result)


def user_tag(tag: int) -> int:
    """A c10d tag (a C int, possibly negative) as an aiocollect tag."""
    return int(tag) % (1 << 32)


def combine(kind: str, plans: list[Plan]) -> Plan:
    """One plan running ``plans`` in order (coalesced calls)."""
    counts: list[int] = []

    def start(group: Group) -> Handles:
        handles: Handles = []
        for p in plans:
            mine = p.start(group)
            counts.append(len(mine))
            handles.extend(mine)
        return handles

    def finish(results: list[Any]) -> int | None:
        offset = 0
        for p, n in zip(plans, counts, strict=True):
            p.finish(results[offset:offset + n])
            offset += n
        return None

    return Plan(kind, [t for p in plans for t in p.result], start, finish)


def flushing(staging: Staging) -> Callable[[list[Any]], int | None]:
    def finish(results: list[Any]) -> int | None:
        del results
        staging.flush()
        return None

    return finish


def _prescaled(arr: Array, factor: float | None, *, copy: bool) -> Array:
    """``arr`` multiplied by a PREMUL_SUM factor (in place unless ``copy``)."""
    if factor is None:
        return arr.copy() if copy else arr
    if copy:
        return np.asarray(arr * factor, dtype=arr.dtype)
    np.multiply(arr, factor, out=arr, casting="unsafe")
    return arr


# -- reductions -------------------------------------------------------------------------------

def allreduce(tensors: list[torch.Tensor], op: Any, timeout: float | None) -> Plan:
    rop, factor = reduce_op(op)
    staging = Staging()
    arrays = [_prescaled(staging.write(t, reducing=True), factor, copy=False) for t in tensors]

    def start(group: Group) -> Handles:
        return [group.allreduce(a, op=rop, timeout=timeout) for a in arrays]

    return Plan("allreduce", list(tensors), start, flushing(staging))


def reduce(tensors: list[torch.Tensor], root: int, op: Any, rank: int,
           timeout: float | None) -> Plan:
    rop, factor = reduce_op(op)
    staging = Staging()
    arrays = []
    for t in tensors:
        if rank == root:
            arrays.append(_prescaled(staging.write(t, reducing=True), factor, copy=False))
        else:  # other ranks' tensors stay unchanged
            arrays.append(_prescaled(staging.read(t, reducing=True), factor,
                                     copy=factor is not None))

    def start(group: Group) -> Handles:
        return [group.reduce(a, root=root, op=rop, timeout=timeout) for a in arrays]

    return Plan("reduce", list(tensors), start, flushing(staging))


def reduce_scatter_single(output: torch.Tensor, input_: torch.Tensor, op: Any, world: int,
                          timeout: float | None) -> Plan:
    rop, factor = reduce_op(op)
    if numel(input_) != world * numel(output) or input_.dtype != output.dtype:
        raise UsageError(f"reduce_scatter: input has {numel(input_)} elements of "
                         f"{input_.dtype}; expected {world} x {numel(output)} of {output.dtype}")
    staging = Staging()
    send = _prescaled(staging.read(input_, reducing=True), factor, copy=factor is not None)
    out = staging.write(output, reducing=True)

    def start(group: Group) -> Handles:
        return [group.reduce_scatter(send, out=out, op=rop, timeout=timeout)]

    return Plan("reduce_scatter", [output], start, flushing(staging))


def reduce_scatter(output: torch.Tensor, inputs: list[torch.Tensor], op: Any, world: int,
                   timeout: float | None) -> Plan:
    if len(inputs) != world:
        raise UsageError(f"reduce_scatter: expected {world} input tensors, got {len(inputs)}")
    check_same(inputs, numel(output), output.dtype, "reduce_scatter input")
    flat = torch.cat([t.detach().reshape(-1) for t in inputs]) if inputs else output.new_empty(0)
    return reduce_scatter_single(output, flat, op, world, timeout)


# -- data movement ----------------------------------------------------------------------------

def broadcast(tensors: list[torch.Tensor], root: int, timeout: float | None) -> Plan:
    staging = Staging()
    arrays = [staging.write(t) for t in tensors]

    def start(group: Group) -> Handles:
        return [group.broadcast(a, root=root, timeout=timeout) for a in arrays]

    return Plan("broadcast", list(tensors), start, flushing(staging))


def _copy_blocks(buf: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    n = numel(buf) // max(1, len(outputs))
    with torch.no_grad():
        for i, out in enumerate(outputs):
            out.copy_(buf[i * n:(i + 1) * n].reshape(out.shape))


def all_gather_single(output: torch.Tensor, input_: torch.Tensor, world: int,
                      timeout: float | None) -> Plan:
    if numel(output) != world * numel(input_) or input_.dtype != output.dtype:
        raise UsageError(f"all_gather: output has {numel(output)} elements of {output.dtype}; "
                         f"expected {world} x {numel(input_)} of {input_.dtype}")
    staging = Staging()
    send = staging.read(input_)
    out = staging.write(output)
    if output.is_contiguous() and input_.is_contiguous() and _overlaps(input_, output):
        send = send.copy()  # in-place form: the input is a slice of the output

    def start(group: Group) -> Handles:
        return [group.allgather(send, out=out, timeout=timeout)]

    return Plan("allgather", [output], start, flushing(staging))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + numel(a) * a.element_size()
    b1 = b0 + numel(b) * b.element_size()
    return a0 < b1 and b0 < a1


def allgather(outputs: list[torch.Tensor], input_: torch.Tensor, world: int,
              timeout: float | None) -> Plan:
    if len(outputs) != world:
        raise UsageError(f"all_gather: expected {world} output tensors, got {len(outputs)}")
    n = numel(input_)
    if any(numel(o) != n for o in outputs):
        return _allgatherv(outputs, input_, timeout)
    check_same(outputs, n, input_.dtype, "all_gather output")
    buf = torch.empty(world * n, dtype=input_.dtype)
    plan = all_gather_single(buf, input_, world, timeout)

    def finish(results: list[Any]) -> int | None:
        _copy_blocks(buf, outputs)
        return None

    return Plan("allgather", list(outputs), plan.start, finish)


def _allgatherv(outputs: list[torch.Tensor], input_: torch.Tensor,
                timeout: float | None) -> Plan:
    """all_gather with tensors of different sizes per rank (outputs give the sizes)."""
    for i, o in enumerate(outputs):
        if o.dtype != input_.dtype:
            raise UsageError(f"all_gather output[{i}] has dtype {o.dtype}, input {input_.dtype}")
    send = Staging().read(input_)

    def start(group: Group) -> Handles:
        return [group.allgatherv(send, timeout=timeout)]

    def finish(results: list[Any]) -> int | None:
        parts: list[Array] = results[0]
        for i, (o, part) in enumerate(zip(outputs, parts, strict=True)):
            if part.size != numel(o):
                raise UsageError(f"all_gather: rank {i} sent {part.size} elements, "
                                 f"output[{i}] holds {numel(o)}")
            staging = Staging()
            staging.write(o)[...] = part.reshape(-1)
            staging.flush()
        return None

    return Plan("allgather", list(outputs), start, finish)


def gather(outputs: list[torch.Tensor], input_: torch.Tensor, root: int, rank: int, world: int,
           timeout: float | None) -> Plan:
    send = Staging().read(input_)
    n = numel(input_)
    buf: torch.Tensor | None = None
    if rank == root:
        if len(outputs) != world:
            raise UsageError(f"gather: the root needs {world} output tensors, got "
                             f"{len(outputs)}")
        check_same(outputs, n, input_.dtype, "gather output")
        buf = torch.empty(world * n, dtype=input_.dtype)
    out = None if buf is None else as_numpy(buf)

    def start(group: Group) -> Handles:
        return [group.gather(send, out=out, root=root, timeout=timeout)]

    def finish(results: list[Any]) -> int | None:
        if buf is not None:
            _copy_blocks(buf, outputs)
        return None

    return Plan("gather", list(outputs), start, finish)


def scatter(output: torch.Tensor, inputs: list[torch.Tensor], root: int, rank: int, world: int,
            timeout: float | None) -> Plan:
    staging = Staging()
    out = staging.write(output)
    send: Array | None = None
    if rank == root:
        if len(inputs) != world:
            raise UsageError(f"scatter: the root needs {world} input tensors, got {len(inputs)}")
        check_same(inputs, numel(output), output.dtype, "scatter input")
        flat = torch.cat([t.detach().reshape(-1) for t in inputs])
        send = as_numpy(flat)

    def start(group: Group) -> Handles:
        return [group.scatter(send, out, root=root, timeout=timeout)]

    return Plan("scatter", [output], start, flushing(staging))


def barrier(timeout: float | None) -> Plan:
    def start(group: Group) -> Handles:
        return [group.barrier(timeout=timeout)]

    return Plan("barrier", [], start)


# -- point to point ---------------------------------------------------------------------------

def send(tensors: list[torch.Tensor], dst: int, tag: int, timeout: float | None) -> Plan:
    arrays = [Staging().read(t) for t in tensors]
    t_ = user_tag(tag)

    def start(group: Group) -> Handles:
        return [group.send(a, dst, tag=t_, timeout=timeout) for a in arrays]

    return Plan("send", list(tensors), start)


def recv(tensors: list[torch.Tensor], src: int | None, tag: int, timeout: float | None) -> Plan:
    staging = Staging()
    arrays = [staging.write(t) for t in tensors]
    t_ = user_tag(tag)

    def start(group: Group) -> Handles:
        return [group.recv(a, src, tag=t_, timeout=timeout) for a in arrays]

    def finish(results: list[Any]) -> int | None:
        staging.flush()
        return int(results[0]) if results else src

    return Plan("recv", list(tensors), start, finish)

