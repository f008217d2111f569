"""Plans: what one c10d call does, as aiocollect operations, and the pieces plans share.

A builder (``_reductions``, ``_movement``, ``_alltoall``) runs on the caller's thread: it
checks the tensors (raising before anything is sent), takes numpy views or staging copies,
and returns a :class:`Plan`. The plan's ``start`` runs later on the loop thread and issues
the aiocollect calls synchronously, so sequence numbers follow the order of the torch calls;
``finish`` copies results back into the caller's tensors once every handle has finished.
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
from aiocollect.group import Group
from aiocollect.torch._tensors import Staging, numel

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


def prescaled(arr: Array, factor: float | None, *, copy: bool) -> Array:
    """``arr`` multiplied by a PREMUL_SUM factor (in place unless ``copy``)."""
    if factor is None:
        return arr.copy() if copy else arr
    out = np.empty_like(arr) if copy else arr
    # (IEEE whatever numpy's error state, as every reduction: engine/reduce.py)
    with contextlib.suppress(*FP_SIGNALS):
        np.multiply(arr, factor, out=out, casting="unsafe")
    return out


def copy_into(tensors: list[torch.Tensor], source: torch.Tensor) -> None:
    with torch.no_grad():
        for t in tensors:
            t.copy_(source.reshape(t.shape))


def copy_blocks(buf: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    n = numel(buf) // max(1, len(outputs))
    with torch.no_grad():
        for i, out in enumerate(outputs):
            out.copy_(buf[i * n : (i + 1) * n].reshape(out.shape))


def nothing(kind: str = "wait_prior") -> Plan:
    """A plan that sends nothing (it only orders: see the process group's ``after``)."""
    return Plan(kind, [], lambda group: [])


def barrier(timeout: float | None) -> Plan:
    def start(group: Group) -> Handles:
        return [group.barrier(timeout=timeout)]

    return Plan("barrier", [], start)
