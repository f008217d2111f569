"""Argument checks shared by the collective methods. Each raises UsageError."""

from __future__ import annotations

from typing import Any

import numpy as np

from aiocollect._buffers import Array, as_array
from aiocollect.errors import UsageError
from aiocollect.types import OpLike, resolve_op

MAX_TAG = (1 << 63) - 1


def check_rank(value: Any, world_size: int, what: str) -> int:
    if type(value) is int and 0 <= value < world_size:  # the common case, per operation
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise UsageError(f"{what} must be an int, got {type(value).__name__}")
    out = int(value)
    if not 0 <= out < world_size:
        raise UsageError(f"{what}={out} is out of range for world size {world_size}")
    return out


def check_tag(tag: Any) -> int:
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
    return resolve_op(op, arr.dtype)


def output(out: Any, shape: tuple[int, ...], dtype: np.dtype[Any], name: str = "out") -> Array:
    """Validate a user ``out`` buffer, or allocate one."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    arr = as_array(out, name, writable=True)
    if arr.dtype != dtype:
        raise UsageError(f"{name} has dtype {arr.dtype}, expected {dtype}")
    if arr.size != int(np.prod(shape)):
        raise UsageError(f"{name} has shape {arr.shape}, expected {shape}")
    return arr


def divisible(arr: Array, world_size: int, name: str) -> None:
    if arr.ndim == 0 or arr.shape[0] % world_size:
        raise UsageError(
            f"{name}.shape[0] must be divisible by the world size {world_size}, "
            f"got shape {arr.shape}"
        )
