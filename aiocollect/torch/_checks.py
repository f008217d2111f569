"""Argument checks of the c10d calls, raised on the caller's thread before anything runs.

The messages follow gloo's (``ProcessGroupGloo::broadcast: invalid root rank: -1``...), so
that code and tests written against gloo recognise them, and the error is an
:class:`ArgumentError`: both aiocollect's :class:`~aiocollect.UsageError` (a ValueError)
and the RuntimeError torch's backends raise for bad arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aiocollect.errors import UsageError


class ArgumentError(UsageError, RuntimeError):
    """A c10d call's arguments are invalid (nothing was sent; the group stays usable)."""


def fail(call: str, message: str) -> ArgumentError:
    """The error for ``call`` (a c10d method name), worded as gloo words it."""
    return ArgumentError(f"ProcessGroupAiocollect::{call}: {message}")


def root_rank(call: str, root: int, world: int) -> None:
    if not 0 <= root < world:
        raise fail(call, f"invalid root rank: {root}")


def root_tensor(call: str, index: int, count: int) -> None:
    if not 0 <= index < count:
        raise fail(call, f"invalid root tensor: {index}")


def non_empty(call: str, tensors: list[torch.Tensor], what: str = "tensor list") -> None:
    if not tensors:
        raise fail(call, f"requires non-empty {what}")


def single(call: str, items: Sequence[object], what: str) -> None:
    if len(items) != 1:
        raise fail(call, f"requires a single-element {what}")


def type_and_sizes(call: str, tensors: list[torch.Tensor], like: torch.Tensor) -> None:
    """Every tensor has ``like``'s dtype and shape."""
    for i, t in enumerate(tensors):
        if t.dtype != like.dtype:
            raise fail(
                call, f"invalid tensor type at index {i} (expected {like.dtype}, got {t.dtype})"
            )
        if t.shape != like.shape:
            raise fail(
                call,
                f"invalid tensor size at index {i} (expected "
                f"{list(like.shape)}, got {list(t.shape)})",
            )


def same_layout(call: str, tensors: list[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        if t.layout != tensors[0].layout:
            raise fail(
                call,
                f"invalid tensor layout at index {i} (expected "
                f"{tensors[0].layout}, got {t.layout})",
            )


def contiguous(call: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise fail(call, "Tensors must be contiguous")
