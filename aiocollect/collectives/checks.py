"""Argument checks of the collective methods. Each raises UsageError.

The checks of a call's shape (ranks, tags, ops, divisibility) run in the planner
(plan.py) or on the send/recv path; those of the buffers that change from call to call
(``out``, scatter's ``send``, alltoallv's counts) run per call in the group's methods.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aiocollect._buffers import Array, as_array
from aiocollect.errors import UsageError
from aiocollect.types import OpLike, resolve_op

MAX_TAG = (1 << 63) - 1


def check_rank(value: Any, world_size: int, what: str) -> int:
    """``value`` as a group rank.

    Args:
        value: an int (or numpy integer; not a bool) in ``[0, world_size)``.
        world_size: the group's size.
        what: the argument's name for the message (``"root"``, ``"dst"``...).

    Returns:
        The rank as an int.

    Raises:
        UsageError: ``value`` is not an int, or out of range.
    """
    if type(value) is int and 0 <= value < world_size:  # the common case, per operation
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise UsageError(f"{what} must be an int, got {type(value).__name__}")
    out = int(value)
    if not 0 <= out < world_size:
        raise UsageError(f"{what}={out} is out of range for world size {world_size}")
    return out


def check_tag(tag: Any) -> int:
    """``tag`` as a message tag: an int (or numpy integer; not a bool) in ``[0, 2**63)``.

    Raises:
        UsageError: anything else.
    """
    if type(tag) is int and 0 <= tag <= MAX_TAG:  # the common case, per operation
        return tag
    if (
        isinstance(tag, bool)
        or not isinstance(tag, (int, np.integer))
        or not (0 <= int(tag) <= MAX_TAG)
    ):
        raise UsageError(f"tag must be an int in [0, 2**63), got {tag!r}")
    return int(tag)


def reduction(op: Any, arr: Array) -> tuple[OpLike, np.ufunc]:
    """The reduction ``op`` for ``arr``'s dtype and the ufunc that applies it
    (``types.resolve_op``).

    Raises:
        UsageError: an unknown op, or one the dtype cannot take.
    """
    return resolve_op(op, arr.dtype)


def output(out: Any, shape: tuple[int, ...], dtype: np.dtype[Any], name: str = "out") -> Array:
    """Validate a user ``out`` buffer, or allocate one.

    Args:
        out: the caller's buffer, or None for a new array of ``shape`` and ``dtype``.
        shape: the shape the result has (``out`` needs only its size).
        dtype: the result's dtype.
        name: the argument's name for the messages.

    Returns:
        ``out`` as an array, or the new array.

    Raises:
        UsageError: ``out`` is not a writable contiguous buffer, or has another dtype
            or size.
    """
    if out is None:
        return np.empty(shape, dtype=dtype)
    arr = as_array(out, name, writable=True)
    if arr.dtype != dtype:
        raise UsageError(f"{name} has dtype {arr.dtype}, expected {dtype}")
    if arr.size != int(np.prod(shape)):
        raise UsageError(f"{name} has shape {arr.shape}, expected {shape}")
    return arr


def divisible(arr: Array, world_size: int, name: str) -> None:
    """Check that ``arr``'s first axis splits into ``world_size`` blocks.

    Raises:
        UsageError: ``arr`` is a scalar, or its first axis is not divisible.
    """
    if arr.ndim == 0 or arr.shape[0] % world_size:
        raise UsageError(
            f"{name}.shape[0] must be divisible by the world size {world_size}, "
            f"got shape {arr.shape}"
        )


def scatter_source(send: Any, out: Array, world_size: int) -> Array:
    """The root's ``send`` of a scatter into blocks like ``out``.

    Returns:
        ``send`` as an array of ``out``'s dtype and ``world_size`` times its size.

    Raises:
        UsageError: ``send`` is None, not a contiguous buffer (or of a dtype aiocollect
            does not carry), or of another dtype or size.
    """
    if send is None:
        raise UsageError("scatter: the root must pass send")
    src = as_array(send, "send", writable=False)
    if src.dtype != out.dtype or src.size != world_size * out.size:
        raise UsageError(
            f"scatter: send has shape {src.shape} and dtype {src.dtype}; expected "
            f"{(world_size, *out.shape)} of {out.dtype}"
        )
    return src


def row_counts(counts: Any, send: Array, world_size: int) -> list[int]:
    """alltoallv's ``counts`` as a list of ints.

    Args:
        counts: a sequence or array of ``world_size`` non-negative row counts.
        send: the rows they split (their sum must be its row count).
        world_size: the group's size.

    Returns:
        The counts.

    Raises:
        UsageError: not ``world_size`` non-negative counts, or a sum other than
            ``send``'s row count.
    """
    out = [int(c) for c in np.asarray(counts).reshape(-1)]
    if len(out) != world_size or min(out, default=0) < 0:
        raise UsageError(f"send_counts must hold {world_size} non-negative counts, got {out}")
    if send.ndim == 0 or sum(out) != send.shape[0]:
        raise UsageError(f"send_counts sum to {sum(out)} but send has shape {send.shape}")
    return out


def rows_output(out: Any, send: Array) -> Array | None:
    """alltoallv's ``out``: rows like ``send``'s (its row count is checked against what
    arrives, by the algorithm).

    Returns:
        ``out`` as an array, or None for None.

    Raises:
        UsageError: ``out`` is not a writable contiguous buffer, or its dtype or row
            shape differs from ``send``'s.
    """
    if out is None:
        return None
    res = as_array(out, "out", writable=True)
    if res.dtype != send.dtype or res.shape[1:] != send.shape[1:]:
        raise UsageError(
            f"out must have dtype {send.dtype} and rows of shape "
            f"{send.shape[1:]}, got {res.dtype} {res.shape}"
        )
    return res
