"""From torch tensors and c10d options to what aiocollect takes: numpy views, ops, timeouts.

Contiguous CPU tensors are shared with numpy (no copy). Non-contiguous tensors travel
through a contiguous copy, written back when the collective has finished (:class:`Staging`).
Dtypes numpy cannot represent (float8 variants...) travel as raw bytes for the collectives
that only move data; reductions on them raise UsageError.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aiocollect._buffers import Array
from aiocollect.errors import UsageError
from aiocollect.types import ReduceOp

_NUMPY_DTYPES = {
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
}

_OPS = {
    "SUM": ReduceOp.SUM,
    "PRODUCT": ReduceOp.PROD,
    "MIN": ReduceOp.MIN,
    "MAX": ReduceOp.MAX,
    "AVG": ReduceOp.AVG,
    "BAND": ReduceOp.BAND,
    "BOR": ReduceOp.BOR,
    "BXOR": ReduceOp.BXOR,
}


def _bfloat16(flat: torch.Tensor, reducing: bool) -> Array:
    raw: Array = flat.view(torch.int16).numpy()
    try:
        import ml_dtypes
    except ImportError:
        if reducing:
            raise UsageError(
                "reductions on bfloat16 tensors need the ml_dtypes package "
                "(pip install 'aiocollect[bfloat16]')"
            ) from None
        return raw
    return raw.view(ml_dtypes.bfloat16)


def as_numpy(tensor: torch.Tensor, *, reducing: bool = False) -> Array:
    """A flat numpy view of a contiguous CPU tensor (shares its memory).

    Raises:
        UsageError: not a CPU tensor, not contiguous, or a dtype that cannot be reduced.
    """
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise UsageError(f"the aiocollect backend takes CPU tensors, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise UsageError("internal: tensor must be contiguous here")
    flat = tensor.detach().reshape(-1)
    if flat.is_conj() or flat.is_neg():
        raise UsageError(
            "tensors with a lazy conj/neg bit are not supported; call "
            "resolve_conj()/resolve_neg() first"
        )
    if tensor.dtype in _NUMPY_DTYPES:
        arr: Array = flat.numpy()
        return arr
    if tensor.dtype == torch.bfloat16:
        return _bfloat16(flat, reducing)
    if reducing:
        raise UsageError(f"the aiocollect backend cannot reduce {tensor.dtype} tensors")
    raw: Array = flat.view(torch.uint8).numpy()
    return raw


def _check_dense(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise UsageError(f"the aiocollect backend takes dense tensors, got {tensor.layout}")
    if tensor.device.type != "cpu":
        raise UsageError(f"the aiocollect backend takes CPU tensors, got one on {tensor.device}")


class Staging:
    """Contiguous stand-ins for tensors that are not, and the copies back afterwards."""

    def __init__(self) -> None:
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def read(self, tensor: torch.Tensor, *, reducing: bool = False) -> Array:
        """A numpy view of ``tensor``'s data (a copy when it is not contiguous)."""
        _check_dense(tensor)
        src = tensor if tensor.is_contiguous() else tensor.detach().contiguous()
        return as_numpy(src, reducing=reducing)

    def write(self, tensor: torch.Tensor, *, reducing: bool = False) -> Array:
        """A numpy view the collective writes into; copied into ``tensor`` by :meth:`flush`
        when ``tensor`` is not contiguous."""
        _check_dense(tensor)
        if tensor.is_contiguous():
            return as_numpy(tensor, reducing=reducing)
        tmp = tensor.detach().contiguous()
        self._back.append((tensor, tmp))
        return as_numpy(tmp, reducing=reducing)

    def flush(self) -> None:
        """Copy the stand-ins back into their tensors."""
        with torch.no_grad():
            for dst, src in self._back:
                dst.copy_(src)
        self._back.clear()


def reduce_op(op: Any) -> tuple[ReduceOp, float | None]:
    """The aiocollect op for a c10d ``ReduceOp`` (or ``RedOpType``), and for PREMUL_SUM the
    factor to scale the inputs by before a SUM.

    Raises:
        UsageError: an op the backend does not implement.
    """
    kind = getattr(op, "op", op)
    name = getattr(kind, "name", str(kind)).upper()
    if name == "PREMUL_SUM":
        factor = getattr(op, "factor", None)
        if factor is None and isinstance(op, dist.ReduceOp):
            # torch releases whose ReduceOp has no ``factor`` attribute (2.9) still pickle
            # it: the state is (op type, factor)
            state = op.__getstate__()
            if isinstance(state, tuple) and len(state) == 2:
                factor = state[1]
        if isinstance(factor, torch.Tensor):
            factor = float(factor.item())
        if not isinstance(factor, (int, float)):
            raise UsageError(f"PREMUL_SUM needs a numeric factor, got {factor!r}")
        return ReduceOp.SUM, float(factor)
    try:
        return _OPS[name], None
    except KeyError:
        raise UsageError(f"the aiocollect backend does not implement reduce op {op!r}") from None


def timeout_seconds(value: Any) -> float | None:
    """Seconds of a c10d options ``timeout`` (None when unset, i.e. negative)."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
        return seconds if seconds > 0 else None
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    return None


def numel(tensor: torch.Tensor) -> int:
    return int(tensor.numel())


def check_same(tensors: list[torch.Tensor], numel_: int, dtype: torch.dtype, what: str) -> None:
    """Every tensor has ``numel_`` elements of ``dtype``.

    Raises:
        UsageError: naming the first that does not.
    """
    for i, t in enumerate(tensors):
        if numel(t) != numel_ or t.dtype != dtype:
            raise UsageError(
                f"{what}[{i}] has {numel(t)} elements of {t.dtype}; expected {numel_} of {dtype}"
            )
