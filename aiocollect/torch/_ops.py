"""Plans: one c10d collective call translated into aiocollect operations.

A builder runs on the caller's thread: it checks the tensors (UsageError, before anything is
sent), takes numpy views or staging copies, and returns a :class:`Plan`. The plan's
``start`` runs later on the loop thread and issues the aiocollect calls synchronously, so
sequence numbers follow the order of the torch calls; ``finish`` copies results back into
the caller's tensors once every handle has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from aiocollect._buffers import Array
from aiocollect.engine.reduce import FP_SIGNALS
from aiocollect.errors import UsageError
from aiocollect.group import Group
from aiocollect.torch import _checks
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
    #: the future's value when it is not ``result`` (gloo's nested lists)
    value: list[Any] | None = None


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
            p.finish(results[offset : offset + n])
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
    out = np.empty_like(arr) if copy else arr
    # (IEEE whatever numpy's error state, as every reduction: engine/reduce.py)
    with contextlib.suppress(*FP_SIGNALS):
        np.multiply(arr, factor, out=out, casting="unsafe")
    return out


# -- reductions -------------------------------------------------------------------------------


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


def _copy_into(tensors: list[torch.Tensor], source: torch.Tensor) -> None:
    with torch.no_grad():
        for t in tensors:
            t.copy_(source.reshape(t.shape))


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
        arrays = [_prescaled(staging.write(tensors[0], reducing=True), factor, copy=False)]

        def start(group: Group) -> Handles:
            return [group.allreduce(a, op=rop, timeout=timeout) for a in arrays]

        return Plan("allreduce", list(tensors), start, flushing(staging))
    buf = _local_reduce(tensors, op)
    arr = _prescaled(as_numpy(buf, reducing=True), factor, copy=False)

    def start_many(group: Group) -> Handles:
        return [group.allreduce(arr, op=rop, timeout=timeout)]

    def finish(results: list[Any]) -> int | None:
        _copy_into(tensors, buf)
        return None

    return Plan("allreduce", list(tensors), start_many, finish)


def allreduce_coalesced(tensors: list[torch.Tensor], op: Any, timeout: float | None) -> Plan:
    """All-reduce each tensor, as one flat buffer (a tensor listed twice gets the reduction
    of its value, as with gloo)."""
    _checks.non_empty("allreduce_coalesced", tensors)
    for t in tensors:
        if t.dtype != tensors[0].dtype:
            raise _checks.fail("allreduce_coalesced", "tensors must all have the same type")
    _checks.same_layout("allreduce_coalesced", tensors)
    if tensors[0].layout != torch.strided:
        raise _checks.fail("allreduce_coalesced", f"unsupported layout: {tensors[0].layout}")
    rop, factor = reduce_op(op)
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    arr = _prescaled(as_numpy(flat, reducing=True), factor, copy=False)

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
            arrays.append(_prescaled(staging.write(t, reducing=True), factor, copy=False))
        else:  # other ranks' tensors stay unchanged
            arrays.append(
                _prescaled(staging.read(t, reducing=True), factor, copy=factor is not None)
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
    send = _prescaled(staging.read(input_, reducing=True), factor, copy=factor is not None)
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
    arr = _prescaled(as_numpy(flat, reducing=True), factor, copy=False)
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


# -- data movement ----------------------------------------------------------------------------


def broadcast(
    tensors: list[torch.Tensor],
    root: int,
    timeout: float | None,
    *,
    world: int,
    rank: int,
    root_tensor: int = 0,
) -> Plan:
    """The root's ``tensors[root_tensor]`` into every tensor of every rank."""
    _checks.root_rank("broadcast", root, world)
    _checks.root_tensor("broadcast", root_tensor, len(tensors))
    _checks.type_and_sizes("broadcast", tensors, tensors[0])
    staging = Staging()
    source = tensors[root_tensor] if rank == root else tensors[0]
    arr = staging.write(source)
    others = [t for t in tensors if t is not source]

    def start(group: Group) -> Handles:
        return [group.broadcast(arr, root=root, timeout=timeout)]

    def finish(results: list[Any]) -> int | None:
        staging.flush()
        _copy_into(others, source)
        return None

    return Plan("broadcast", list(tensors), start, finish)


def _copy_blocks(buf: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    n = numel(buf) // max(1, len(outputs))
    with torch.no_grad():
        for i, out in enumerate(outputs):
            out.copy_(buf[i * n : (i + 1) * n].reshape(out.shape))


def all_gather_single(
    output: torch.Tensor, input_: torch.Tensor, world: int, timeout: float | None
) -> Plan:
    if numel(output) != world * numel(input_) or input_.dtype != output.dtype:
        raise UsageError(
            f"all_gather: output has {numel(output)} elements of {output.dtype}; "
            f"expected {world} x {numel(input_)} of {input_.dtype}"
        )
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


def allgather(
    outputs: list[torch.Tensor], input_: torch.Tensor, world: int, timeout: float | None
) -> Plan:
    if len(outputs) != world:
        raise _checks.fail(
            "allgather",
            f"invalid output tensor list at index 0 (expected length {world}, got {len(outputs)})",
        )
    n = numel(input_)
    if any(numel(o) != n for o in outputs):
        return _allgatherv(outputs, input_, timeout)
    _checks.type_and_sizes("allgather", outputs, outputs[0])
    check_same(outputs, n, input_.dtype, "all_gather output")
    buf = torch.empty(world * n, dtype=input_.dtype)
    plan = all_gather_single(buf, input_, world, timeout)

    def finish(results: list[Any]) -> int | None:
        _copy_blocks(buf, outputs)
        return None

    return Plan("allgather", list(outputs), plan.start, finish)


def allgather_multi(
    outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], world: int, timeout: float | None
) -> Plan:
    """gloo's allgather of N inputs per rank: every ``outputs[i]`` holds N x world tensors,
    ``outputs[i][r * N + k]`` = rank r's input k."""
    _checks.non_empty("allgather", inputs, "input tensor list")
    if len(outputs) != len(inputs):
        raise _checks.fail(
            "allgather", "requires input/output tensor lists to have the same length"
        )
    expected = len(inputs) * world
    for i, out in enumerate(outputs):
        if len(out) != expected:
            raise _checks.fail(
                "allgather",
                f"invalid output tensor list at index {i} "
                f"(expected length {expected}, got {len(out)})",
            )
    _checks.type_and_sizes("allgather", inputs, inputs[0])
    if len(inputs) == 1:  # outputs of other sizes: ranks gather tensors of their own sizes
        for out in outputs:
            for i, t in enumerate(out):
                if t.dtype != inputs[0].dtype:
                    raise _checks.fail(
                        "allgather",
                        f"invalid tensor type at index {i} "
                        f"(expected {inputs[0].dtype}, got "
                        f"{t.dtype})",
                    )
        plans = [allgather(o, inputs[0], world, timeout) for o in outputs]
        return combine("allgather", plans)
    for out in outputs:
        _checks.type_and_sizes("allgather", out, inputs[0])
    with torch.no_grad():
        flat_in = torch.cat([t.detach().reshape(-1) for t in inputs])
    buf = torch.empty(world * numel(flat_in), dtype=flat_in.dtype)
    plan = all_gather_single(buf, flat_in, world, timeout)

    def finish(results: list[Any]) -> int | None:
        for out in outputs:
            _copy_blocks(buf, out)
        return None

    # gloo's future value: the nested output lists when there are several
    return Plan(
        "allgather",
        [t for o in outputs for t in o],
        plan.start,
        finish,
        value=[list(o) for o in outputs],
    )


def allgather_coalesced(
    outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], world: int, timeout: float | None
) -> Plan:
    """``outputs[r][i]`` = rank r's ``inputs[i]`` (torch's [rank][input] layout); the
    inputs may differ in size, and travel as one flat buffer."""
    call = "allgather_coalesced"
    if len(outputs) != world:
        raise _checks.fail(
            call,
            f"number of output lists should be equal to world size {world}, got {len(outputs)}",
        )
    _checks.non_empty(call, inputs, "input tensor list")
    for out in outputs:
        if len(out) != len(inputs):
            raise _checks.fail(
                call,
                f"invalid output size: each output list should hold "
                f"{len(inputs)} tensors, got {len(out)}",
            )
        for i, (o, t) in enumerate(zip(out, inputs, strict=True)):
            if o.dtype != t.dtype or t.dtype != inputs[0].dtype:
                raise _checks.fail(call, f"invalid tensor type at index {i}")
            if numel(o) != numel(t):
                raise _checks.fail(call, f"invalid size of output tensor at index {i}")
    with torch.no_grad():
        flat_in = torch.cat([t.detach().reshape(-1) for t in inputs])
    per_rank = numel(flat_in)
    buf = torch.empty(world * per_rank, dtype=flat_in.dtype)
    plan = all_gather_single(buf, flat_in, world, timeout)

    def finish(results: list[Any]) -> int | None:
        with torch.no_grad():
            for r, out in enumerate(outputs):
                offset = r * per_rank
                for o in out:
                    o.copy_(buf[offset : offset + numel(o)].reshape(o.shape))
                    offset += numel(o)
        return None

    return Plan(
        call,
        [t for o in outputs for t in o],
        plan.start,
        finish,
        value=[list(o) for o in outputs] if len(outputs) > 1 else None,
    )


def _allgatherv(outputs: list[torch.Tensor], input_: torch.Tensor, timeout: float | None) -> Plan:
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
                raise UsageError(
                    f"all_gather: rank {i} sent {part.size} elements, output[{i}] holds {numel(o)}"
                )
            staging = Staging()
            staging.write(o)[...] = part.reshape(-1)
            staging.flush()
        return None

    return Plan("allgather", list(outputs), start, finish)


def gather(
    outputs: list[torch.Tensor],
    input_: torch.Tensor,
    root: int,
    rank: int,
    world: int,
    timeout: float | None,
) -> Plan:
    send = Staging().read(input_)
    n = numel(input_)
    buf: torch.Tensor | None = None
    if rank == root:
        if len(outputs) != world:
            raise _checks.fail(
                "gather",
                f"Incorrect output list size {len(outputs)}. Output list size should be {world}",
            )
        _checks.type_and_sizes("gather", outputs, input_)
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


def scatter(
    output: torch.Tensor,
    inputs: list[torch.Tensor],
    root: int,
    rank: int,
    world: int,
    timeout: float | None,
) -> Plan:
    staging = Staging()
    out = staging.write(output)
    send: Array | None = None
    if rank == root:
        if len(inputs) != world:
            raise _checks.fail(
                "scatter",
                f"Incorrect input list size {len(inputs)}. Input list size should be {world}",
            )
        _checks.type_and_sizes("scatter", inputs, output)
        check_same(inputs, numel(output), output.dtype, "scatter input")
        flat = torch.cat([t.detach().reshape(-1) for t in inputs])
        send = as_numpy(flat)

    def start(group: Group) -> Handles:
        return [group.scatter(send, out, root=root, timeout=timeout)]

    return Plan("scatter", [output], start, flushing(staging))


def nothing(kind: str = "wait_prior") -> Plan:
    """A plan that sends nothing (it only orders: see the process group's ``after``)."""
    return Plan(kind, [], lambda group: [])


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
