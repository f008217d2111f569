"""Deterministic test data and numpy references shared by the collective tests."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.transport.shm_ring import unavailable as _shm_unavailable
from aiocollect.types import resolve_op

try:
    import ml_dtypes

    BF16: Any = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    BF16 = None

CHUNK = 16  # bytes: tiny, so small inputs take the multi-chunk path

#: The marks of a ``transport="shm"`` case of a test parametrized over transports: skipped
#: where shared memory is unavailable.
ON_SHM = (
    pytest.mark.skipif(
        _shm_unavailable() is not None, reason=f"shared memory unavailable: {_shm_unavailable()}"
    ),
)

DTYPES = [
    np.dtype(d)
    for d in (
        "bool",
        "int8",
        "int32",
        "int64",
        "uint8",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
] + ([BF16] if BF16 is not None else [])
CORE_DTYPES = [
    np.dtype(d) for d in ("bool", "int8", "int32", "int64", "float16", "float32", "float64")
]
OPS = list(ac.ReduceOp)


def counts_for(dtype: np.dtype[Any], chunk: int = CHUNK) -> list[int]:
    """0, 1, chunk-1, chunk+1 and several chunks plus a remainder (in elements)."""
    ce = max(1, chunk // dtype.itemsize)
    return sorted({0, 1, max(1, ce - 1), ce + 1, 3 * ce + max(1, ce // 2)})


def valid_ops(dtype: np.dtype[Any]) -> list[ac.ReduceOp]:
    out = []
    for op in OPS:
        try:
            resolve_op(op, dtype)
        except ac.UsageError:
            continue
        out.append(op)
    return out


def data(
    rank: int, count: int, dtype: np.dtype[Any], seed: int = 0, op: Any = None
) -> np.ndarray[Any, Any]:
    """Per-rank deterministic data; PROD gets values near 1 so products stay finite."""
    rng = np.random.default_rng(seed * 1000 + rank * 7 + count)
    kind = dtype.kind if dtype != BF16 else "f"
    if kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    if kind in "iu":
        hi = 4 if op is ac.ReduceOp.PROD else 100
        return rng.integers(0, hi, count).astype(dtype)
    base = rng.uniform(0.5, 1.5, count) if op is ac.ReduceOp.PROD else rng.uniform(-4, 4, count)
    if kind == "c":
        return (base + 1j * rng.uniform(-1, 1, count)).astype(dtype)
    return base.astype(dtype)


def reference(arrays: list[np.ndarray[Any, Any]], op: Any) -> np.ndarray[Any, Any]:
    dtype = arrays[0].dtype
    rop, ufunc = resolve_op(op, dtype)
    wide = dtype
    if dtype.kind == "f" or dtype == BF16:
        wide = np.dtype(np.float64)
    if dtype.kind == "c":
        wide = np.dtype(np.complex128)
    acc = functools.reduce(lambda a, b: ufunc(a, b), [a.astype(wide) for a in arrays])
    if rop is ac.ReduceOp.AVG:
        acc = acc / len(arrays)
    return np.asarray(acc)


def assert_close(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], what: str = "") -> None:
    dtype = got.dtype
    if dtype.kind in "fc" or dtype == BF16:
        real = np.dtype(np.float32) if dtype == BF16 else np.empty(0, dtype).real.dtype
        eps = 2.0**-7 if dtype == BF16 else float(np.finfo(real).eps)
        rtol = 64 * eps
        np.testing.assert_allclose(
            got.astype(want.dtype), want, rtol=rtol, atol=rtol * 30, err_msg=what
        )
    else:
        np.testing.assert_array_equal(got, want.astype(dtype), err_msg=what)
