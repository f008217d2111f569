"""Plans of the c10d calls that move data without reducing it: broadcast, the all-gather
family, gather, scatter, send and recv (see ``_plan`` for what a plan is; all-to-all is in
``_alltoall``)."""

from __future__ import annotations

from typing import Any

import torch

from aiocollect._buffers import Array
from aiocollect.errors import UsageError
from aiocollect.group import Group
from aiocollect.torch import _checks
from aiocollect.torch._plan import (
    Handles,
    Plan,
    combine,
    copy_blocks,
    copy_into,
    flushing,
    user_tag,
)
from aiocollect.torch._tensors import Staging, as_numpy, check_same, numel


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
        copy_into(others, source)
        return None

    return Plan("broadcast", list(tensors), start, finish)


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
    for i, o in enumerate(outputs):
        if numel(o) != n:  # gloo's check: every rank's block is the input's size
            raise _checks.fail(
                "allgather",
                f"invalid tensor size at index {i} (expected {list(input_.shape)}, "
                f"got {list(o.shape)})",
            )
    _checks.type_and_sizes("allgather", outputs, outputs[0])
    check_same(outputs, n, input_.dtype, "all_gather output")
    buf = torch.empty(world * n, dtype=input_.dtype)
    plan = all_gather_single(buf, input_, world, timeout)

    def finish(results: list[Any]) -> int | None:
        copy_blocks(buf, outputs)
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
            copy_blocks(buf, out)
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
            copy_blocks(buf, outputs)
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
