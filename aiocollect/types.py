"""Reduction ops and the dtype/collective/op codes carried in frame fingerprints (packed
and unpacked by ``aiocollect.fingerprint``)."""

from __future__ import annotations

import contextlib
import enum
import zlib
from typing import Any

import numpy as np

from aiocollect.errors import UsageError


class ReduceOp(enum.IntEnum):
    """Built-in reductions. Any binary numpy ufunc may be passed instead."""

    SUM = 1
    PROD = 2
    MIN = 3
    MAX = 4
    AVG = 5
    BAND = 6
    BOR = 7
    BXOR = 8


OpLike = ReduceOp | np.ufunc

_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.AVG: np.add,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

# Codes for the wire fingerprint. Order is part of the protocol: append only.
DTYPE_NAMES: tuple[str, ...] = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "bfloat16",
    "longdouble",
    "clongdouble",
    "float8_e4m3fn",
    "float8_e5m2",
)
_DTYPE_CODE = {name: i + 1 for i, name in enumerate(DTYPE_NAMES)}


class Collective(enum.IntEnum):
    """Collective kinds, as carried in frame fingerprints."""

    BARRIER = 1
    BROADCAST = 2
    ALLREDUCE = 3
    REDUCE = 4
    ALLGATHER = 5
    ALLGATHERV = 6
    GATHER = 7
    SCATTER = 8
    REDUCE_SCATTER = 9
    ALLTOALL = 10
    ALLTOALLV = 11
    SEND = 12
    # 13 was SPLIT (never sent): reserved, so old fingerprints never decode as another.
    OBJECT = 14


_NAMES: dict[np.dtype[Any], str] = {}
_CODES: dict[np.dtype[Any], int] = {}  # dtype_code's answers (supported dtypes only)


def dtype_name(dtype: np.dtype[Any]) -> str:
    """A stable, human-readable dtype name (``float32``, ``bfloat16``...)."""
    name = _NAMES.get(dtype)
    if name is None:  # numpy computes .name in Python: cache it, calls are per operation
        name = _NAMES[dtype] = str(dtype.name)
    return name


def dtype_code(dtype: np.dtype[Any]) -> int:
    """The wire code of ``dtype``.

    Raises:
        UsageError: the dtype is not supported (structured, object, non-native order...).
    """
    code = _CODES.get(dtype)
    if code is not None:
        return code
    if not dtype.isnative:
        raise UsageError(f"dtype {dtype} is not in native byte order")
    code = _DTYPE_CODE.get(dtype_name(dtype))
    if code is None:
        raise UsageError(
            f"unsupported dtype {dtype}: use a numpy integer, float, complex, bool, "
            "float16 or ml_dtypes.bfloat16 array"
        )
    _CODES[dtype] = code
    return code


def dtype_label(code: int) -> str:
    """Inverse of :func:`dtype_code` for error messages."""
    if 1 <= code <= len(DTYPE_NAMES):
        return DTYPE_NAMES[code - 1]
    return f"dtype#{code}"


def _kind(dtype: np.dtype[Any]) -> str:
    if dtype.kind == "V" and dtype_name(dtype) in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return "f"
    return str(dtype.kind)


def op_code(op: OpLike) -> int:
    """Wire code of an op: 1..8 for ReduceOp, 64..255 for a custom ufunc (by name)."""
    if isinstance(op, ReduceOp):
        return int(op)
    return 64 + zlib.crc32(op.__name__.encode()) % 192


def op_label(code: int) -> str:
    if code == 0:
        return "none"
    try:
        return ReduceOp(code).name
    except ValueError:
        return f"ufunc#{code}"


def resolve_op(op: Any, dtype: np.dtype[Any]) -> tuple[OpLike, np.ufunc]:
    """Validate ``op`` for ``dtype``; return the op and the ufunc that applies it.

    Raises:
        UsageError: unknown op, a bitwise op on floats, AVG on integers or bool, or a
            ufunc that is not binary.
    """
    try:
        cached = _RESOLVED.get((type(op), op, dtype))
    except TypeError:  # unhashable: not a valid op, the checks below say why
        cached = None
    if cached is not None:
        return cached
    resolved = _resolve_op(op, dtype)
    with contextlib.suppress(TypeError):
        _RESOLVED[(type(op), op, dtype)] = resolved
    return resolved


_RESOLVED: dict[tuple[type, Any, np.dtype[Any]], tuple[OpLike, np.ufunc]] = {}


def _resolve_op(op: Any, dtype: np.dtype[Any]) -> tuple[OpLike, np.ufunc]:
    if isinstance(op, np.ufunc):
        if op.nin != 2 or op.nout != 1:
            raise UsageError(f"reduction ufunc {op.__name__} must take 2 inputs and give 1 output")
        return op, op
    try:
        rop = ReduceOp(op)
    except (ValueError, TypeError):
        raise UsageError(f"unknown reduction op {op!r}: use ac.ReduceOp or a numpy ufunc") from None
    kind = _kind(dtype)
    if rop in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and kind not in "biu":
        raise UsageError(f"{rop.name} needs an integer or bool dtype, got {dtype_name(dtype)}")
    if rop is ReduceOp.AVG and kind not in "fc":
        raise UsageError(f"AVG needs a float or complex dtype, got {dtype_name(dtype)}")
    if rop in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise UsageError(f"{rop.name} is not defined for complex dtype {dtype_name(dtype)}")
    return rop, _UFUNCS[rop]
