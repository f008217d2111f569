"""Serialising Python values for the object collectives: msgpack, with numpy arrays as an
extension type. Pickle is used only when the caller passes ``allow_pickle=True`` on every
rank; a pickled payload is refused otherwise (it could run code on unpickling)."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import numpy as np

from aiocollect.errors import ProtocolError, UsageError

_NDARRAY = 1
_PICKLE_MARK = b"\x00PK"


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("object arrays are not serialisable without pickle")
        header = msgpack.packb([obj.dtype.str, list(obj.shape)])
        return msgpack.ExtType(_NDARRAY, header + np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _NDARRAY:
        raise ProtocolError(f"unknown msgpack extension {code}")
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    dtype, shape = unpacker.unpack()
    offset = unpacker.tell()
    return np.frombuffer(data, dtype=np.dtype(dtype), offset=offset).reshape(shape).copy()


def dumps(obj: Any, allow_pickle: bool) -> bytes:
    """Serialise ``obj``.

    Raises:
        UsageError: ``obj`` is not msgpack-serialisable and pickle is not allowed.
    """
    try:
        return bytes(msgpack.packb(obj, default=_default, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as exc:
        if not allow_pickle:
            raise UsageError(
                f"value is not msgpack-serialisable ({exc}); pass allow_pickle=True on "
                "every rank to use pickle") from None
    return _PICKLE_MARK + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes, allow_pickle: bool) -> Any:
    """Inverse of :func:`dumps`.

    Raises:
        ProtocolError: malformed bytes, or a pickled payload while pickle is not allowed.
    """
    if data.startswith(_PICKLE_MARK):
        if not allow_pickle:
            raise ProtocolError("received a pickled value but allow_pickle is False")
        return pickle.loads(data[len(_PICKLE_MARK):])
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except (ValueError, msgpack.exceptions.ExtraData) as exc:
        raise ProtocolError(f"malformed object payload: {exc}") from None
