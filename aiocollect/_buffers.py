"""Turning user buffers into numpy arrays that share their memory, with clear errors."""

from __future__ import annotations

import array
import mmap
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

import numpy as np

from aiocollect.errors import UsageError
from aiocollect.types import dtype_code

Array = np.ndarray[Any, np.dtype[Any]]


class TensorLike(Protocol):
    """What :func:`as_array` reads of a torch tensor (CPU and contiguous, else UsageError);
    ``torch.Tensor`` matches it without aiocollect importing torch."""

    @property
    def device(self) -> Any: ...

    def is_contiguous(self) -> bool: ...

    def numpy(self) -> Any: ...


if TYPE_CHECKING:
    _ArrayArray: TypeAlias = array.array[Any]
else:  # (array.array is not subscriptable at run time before Python 3.12)
    _ArrayArray: TypeAlias = array.array
Buffer: TypeAlias = Array | bytes | bytearray | memoryview | _ArrayArray | mmap.mmap | TensorLike
"""What the collectives accept as a buffer: numpy arrays, objects with the buffer protocol
(``bytes`` only where nothing is written into it) and CPU torch tensors. Other
buffer-protocol objects work at run time too; the alias is for type checkers and readers."""
#: A Buffer of one type: a collective that fills the caller's buffer gives that buffer back.
B = TypeVar("B", bound=Buffer)


def as_array(buf: Any, name: str, *, writable: bool, dtype: bool = True) -> Array:
    """View ``buf`` as a C-contiguous numpy array sharing its memory.

    Accepts numpy arrays, objects with the buffer protocol (bytearray, memoryview,
    array.array) and CPU torch tensors. ``dtype=False``: the dtype is not checked here
    (the caller's plan for its dtype does, remembered per dtype: see ``Group._plans``).

    Raises:
        UsageError: ``buf`` is not a buffer, is not C-contiguous, is read-only while the
            collective writes to it, or has an unsupported dtype.
    """
    arr: Array
    if type(buf) is np.ndarray:  # the common case, kept short: this runs per operation
        flags = buf.flags
        if flags.c_contiguous and (flags.writeable or not writable):
            if dtype:
                dtype_code(buf.dtype)
            return buf
    if isinstance(buf, np.ndarray):
        arr = buf
    elif type(buf).__module__.startswith("torch"):
        arr = _torch_array(buf, name)
    else:
        try:
            view = memoryview(buf)
        except TypeError:
            raise UsageError(
                f"{name} must be a numpy array or support the buffer protocol, "
                f"got {type(buf).__name__}"
            ) from None
        if not view.c_contiguous:
            raise UsageError(f"{name} must be C-contiguous")
        try:
            arr = np.asarray(view)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{name}: unsupported buffer format {view.format!r}") from exc
    if not arr.flags.c_contiguous:
        raise UsageError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    if writable and not arr.flags.writeable:
        raise UsageError(f"{name} is read-only but the collective writes into it")
    if dtype:
        dtype_code(arr.dtype)
    return arr


def _torch_array(tensor: Any, name: str) -> Array:
    if tensor.device.type != "cpu":
        raise UsageError(f"{name} must be a CPU tensor, got device {tensor.device}")
    if not tensor.is_contiguous():
        raise UsageError(f"{name} must be a contiguous tensor")
    if str(tensor.dtype) == "torch.bfloat16":
        import ml_dtypes
        import torch

        arr: Array = tensor.detach().view(dtype=torch.int16).numpy()
        return arr.view(ml_dtypes.bfloat16)
    out: Array = tensor.detach().numpy()
    return out


def byte_castable(dtype: np.dtype[Any]) -> bool:
    """Whether :func:`byte_view` of an array of ``dtype`` is its ``data.cast("B")`` (the
    fast route; not for dtypes the buffer protocol cannot name, such as bfloat16)."""
    try:
        np.empty(1, dtype).data.cast("B")
    except (TypeError, ValueError):
        return False
    return True


def byte_view(arr: Array) -> memoryview:
    """A flat, writable-if-possible byte view of a C-contiguous array."""
    try:
        return arr.data.cast("B")  # a third of the cost of the numpy route below
    except (TypeError, ValueError):  # dtypes the buffer protocol cannot name (bfloat16)
        view: memoryview = arr.reshape(-1).view(np.uint8).data
        return view
