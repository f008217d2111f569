"""Plans for all-to-all: even exchanges use aiocollect's ``alltoall``; uneven ones (split
sizes that differ per rank) travel as point-to-point messages on a reserved tag."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from aiocollect._buffers import Array
from aiocollect.errors import UsageError
from aiocollect.group import Group
from aiocollect.torch._plan import Handles, Plan, flushing
from aiocollect.torch._tensors import Staging, numel

#: Tag of the point-to-point messages that carry uneven all-to-all exchanges; user tags are
#: folded into [0, 2**32) and never reach it.
ALLTOALLV_TAG = 1 << 62


def _splits(sizes: list[int] | None, rows: int, world: int, what: str) -> list[int]:
    if not sizes:
        if rows % world:
            raise UsageError(
                f"all_to_all: {what} has {rows} rows, not divisible by the world size {world}"
            )
        return [rows // world] * world
    if len(sizes) != world or sum(sizes) != rows or min(sizes) < 0:
        raise UsageError(
            f"all_to_all: {what} split sizes {list(sizes)} do not divide its "
            f"{rows} rows among {world} ranks"
        )
    return [int(s) for s in sizes]


def all_to_all_single(
    output: torch.Tensor,
    input_: torch.Tensor,
    output_splits: list[int] | None,
    input_splits: list[int] | None,
    rank: int,
    world: int,
    timeout: float | None,
) -> Plan:
    if input_.dtype != output.dtype:
        raise UsageError(
            f"all_to_all: input dtype {input_.dtype} differs from output dtype {output.dtype}"
        )
    in_rows = input_.shape[0] if input_.dim() else 1
    out_rows = output.shape[0] if output.dim() else 1
    ins = _splits(input_splits, in_rows, world, "input")
    outs = _splits(output_splits, out_rows, world, "output")
    in_row = numel(input_) // in_rows if in_rows else 0
    out_row = numel(output) // out_rows if out_rows else 0
    staging = Staging()
    send = staging.read(input_)
    out = staging.write(output)
    even = len(set(ins)) == 1 and ins == outs and in_row == out_row
    if even:

        def start(group: Group) -> Handles:
            return [group.alltoall(send, out=out, timeout=timeout)]

        return Plan("alltoall", [output], start, flushing(staging))
    sends = _cut(send, [s * in_row for s in ins])
    recvs = _cut(out, [s * out_row for s in outs])
    return Plan("alltoallv", [output], _exchange(sends, recvs, rank, timeout), flushing(staging))


def _cut(arr: Array, counts: list[int]) -> list[Array]:
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [arr[bounds[i] : bounds[i + 1]] for i in range(len(counts))]


def _exchange(
    sends: list[Array], recvs: list[Array], rank: int, timeout: float | None
) -> Callable[[Group], Handles]:
    """Uneven all-to-all over point-to-point messages on a reserved tag."""
    if sends[rank].size != recvs[rank].size:
        raise UsageError(
            f"all_to_all: rank {rank} sends itself {sends[rank].size} elements "
            f"but expects {recvs[rank].size}"
        )

    def start(group: Group) -> Handles:
        recvs[rank][...] = sends[rank]
        handles: Handles = []
        for peer in range(len(sends)):
            if peer != rank:
                handles.append(group.recv(recvs[peer], peer, tag=ALLTOALLV_TAG, timeout=timeout))
                handles.append(group.send(sends[peer], peer, tag=ALLTOALLV_TAG, timeout=timeout))
        return handles

    return start


def alltoall(
    outputs: list[torch.Tensor],
    inputs: list[torch.Tensor],
    rank: int,
    world: int,
    timeout: float | None,
) -> Plan:
    if len(outputs) != world or len(inputs) != world:
        raise UsageError(
            f"all_to_all: expected {world} input and output tensors, got "
            f"{len(inputs)} and {len(outputs)}"
        )
    dtype = inputs[0].dtype
    for what, tensors in (("input", inputs), ("output", outputs)):
        for i, t in enumerate(tensors):
            if t.dtype != dtype:
                raise UsageError(f"all_to_all {what}[{i}] has dtype {t.dtype}, input[0] {dtype}")
    send_buf = torch.cat([t.detach().reshape(-1) for t in inputs])
    recv_buf = torch.empty(sum(numel(o) for o in outputs), dtype=dtype)
    in_splits = [numel(t) for t in inputs]
    out_splits = [numel(o) for o in outputs]
    plan = all_to_all_single(recv_buf, send_buf, out_splits, in_splits, rank, world, timeout)

    def finish(results: list[Any]) -> int | None:
        offset = 0
        with torch.no_grad():
            for o in outputs:
                o.copy_(recv_buf[offset : offset + numel(o)].reshape(o.shape))
                offset += numel(o)
        return None

    return Plan(plan.kind, list(outputs), plan.start, finish)
