"""Serialising Python values for the object collectives.

A value travels as msgpack and comes back *exactly*: same types, same contents, on every
rank. msgpack alone would not do that (a tuple would come back a list, a tuple key would
make the receiver's map unhashable, a numpy scalar would become a Python number, a
bytearray bytes), so the encoding adds extension types and the sender checks the whole
value before anything is sent:

- ``None``, ``bool``, ``int`` (-2**63 to 2**64 - 1), ``float``, ``str``, ``bytes``, ``list``
  and ``dict`` (keys of any of these types) are msgpack's own;
- ``tuple`` is extension 2 (its items, packed as an array), so tuple keys work;
- ``numpy.ndarray`` is extension 1 and a numpy scalar extension 3: a header
  ``[dtype.str, shape]`` then the C-order bytes, for bool, integer, float and complex
  dtypes only.

Only these exact types qualify (no subclasses: an ``OrderedDict``, an ``IntEnum`` or a
named tuple would not come back as itself). Anything else is pickled when the caller passes
``allow_pickle=True`` on every rank, and refused with :class:`UsageError` otherwise. A
pickled payload is refused by a receiver that does not allow pickle (unpickling can run
code).

Nothing received is trusted: :func:`loads` checks every extension strictly (header types,
dtype, data length against the shape) and turns any decoding failure into
:class:`ProtocolError`. Values are at most :data:`MAX_OBJECT_BYTES` serialised; receivers
check declared sizes against it before allocating.
"""

from __future__ import annotations

import math
import pickle
import re
from typing import Any

import msgpack
import numpy as np

from aiocollect.errors import ProtocolError, UsageError

#: Largest serialised value (bytes) an object collective sends or accepts. A receiver
#: checks every declared size against it before allocating anything.
MAX_OBJECT_BYTES = 1 << 30
#: Deepest nesting of lists, tuples and dicts a value may have.
MAX_DEPTH = 64

_NDARRAY = 1
_TUPLE = 2
_SCALAR = 3
_PICKLE_MARK = b"\x00PK"
_KINDS = "biufc"  # bool, signed and unsigned integers, floats, complex
_DTYPE = re.compile(r"[<>|][biufc][0-9]{1,2}")
_MAX_NDIM = 64
_PLAIN = (type(None), bool, float, str, bytes)


class _Unsupported(Exception):
    """The value would not survive msgpack exactly: ``what`` is wrong at ``path``."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.path: list[str] = []

    def __str__(self) -> str:
        path = self.path if len(self.path) <= 6 else [*self.path[:3], "...", *self.path[-2:]]
        return f"the value{''.join(path)} {self.what}"


def _check(obj: Any, depth: int = 0) -> None:
    """Raise _Unsupported unless ``obj`` round-trips exactly through :func:`dumps`."""
    kind = type(obj)
    if kind in _PLAIN:
        return
    if kind is int:
        if not -(1 << 63) <= obj < 1 << 64:
            raise _Unsupported("is an int outside msgpack's 64-bit range")
        return
    if kind is list or kind is tuple or kind is dict:
        if depth >= MAX_DEPTH:
            raise _Unsupported(f"is nested deeper than {MAX_DEPTH} levels")
        items = obj.items() if kind is dict else enumerate(obj)
        for key, value in items:
            try:
                if kind is dict:
                    _check(key, depth + 1)
                _check(value, depth + 1)
            except _Unsupported as exc:
                exc.path.insert(0, f"[{key!r:.40}]")
                raise
        return
    if kind is np.ndarray or isinstance(obj, np.generic):
        if obj.dtype.kind not in _KINDS or not _DTYPE.fullmatch(obj.dtype.str):
            raise _Unsupported(
                f"has dtype {obj.dtype}; only bool, integer, float and complex numpy dtypes "
                "are sent without pickle"
            )
        return
    raise _Unsupported(f"is a {kind.__module__}.{kind.__qualname__}")


def _array_ext(code: int, obj: Any) -> msgpack.ExtType:
    arr = np.asarray(obj)  # a numpy scalar becomes a 0-d array
    header = msgpack.packb([arr.dtype.str, list(arr.shape)])
    return msgpack.ExtType(code, header + arr.tobytes(order="C"))


def _default(obj: Any) -> Any:
    # _check has vetted the value: only these three reach here.
    if type(obj) is tuple:
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if isinstance(obj, np.generic):
        return _array_ext(_SCALAR, obj)
    return _array_ext(_NDARRAY, obj)


def _pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True))


def dumps(obj: Any, allow_pickle: bool) -> bytes:
    """Serialise ``obj`` so that :func:`loads` gives back an equal value of the same types.

    Args:
        obj: the value (see the module docstring for what msgpack carries).
        allow_pickle: pickle a value msgpack cannot carry exactly, instead of refusing it.

    Raises:
        UsageError: ``obj`` cannot be carried exactly without pickle and pickle is not
            allowed (the message names the offending part), pickling failed, or the
            serialised value exceeds :data:`MAX_OBJECT_BYTES`.
    """
    try:
        _check(obj)
        data = _pack(obj)
    except (_Unsupported, RecursionError) as exc:
        if not allow_pickle:
            why = exc if isinstance(exc, _Unsupported) else "it is nested too deeply"
            raise UsageError(
                f"value cannot be sent exactly without pickle ({why}); pass "
                "allow_pickle=True on every rank to use pickle"
            ) from None
        try:
            data = _PICKLE_MARK + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:
            raise UsageError(f"value cannot be pickled: {type(err).__name__}: {err}") from err
    if len(data) > MAX_OBJECT_BYTES:
        raise UsageError(
            f"value is {len(data)} bytes serialised, more than the "
            f"{MAX_OBJECT_BYTES} an object collective carries (MAX_OBJECT_BYTES);"
            " send large arrays with broadcast/allgather instead"
        )
    return data


def _array(code: int, data: bytes) -> Any:
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    header = unpacker.unpack()  # OutOfData when empty: loads turns it into ProtocolError
    if not (
        type(header) is list
        and len(header) == 2
        and type(header[0]) is str
        and type(header[1]) is list
    ):
        raise ProtocolError(f"array header is a {type(header).__name__}, not [dtype, shape]")
    dtype_str, shape = header
    if not _DTYPE.fullmatch(dtype_str):
        raise ProtocolError(f"array dtype {dtype_str[:40]!r} is not a plain numeric dtype")
    if len(shape) > _MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise ProtocolError(f"array shape is not a list of at most {_MAX_NDIM} sizes")
    if code == _SCALAR and shape:
        raise ProtocolError(f"numpy scalar with shape {shape}")
    dtype = np.dtype(dtype_str)
    offset = unpacker.tell()
    if dtype.kind not in _KINDS or dtype.itemsize * math.prod(shape) != len(data) - offset:
        raise ProtocolError(
            f"array of {dtype_str} and shape {shape} does not match its "
            f"{len(data) - offset} bytes of data"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=offset).reshape(shape).copy()
    return arr[()] if code == _SCALAR else arr


class _Decoder:
    """The ext hook of one :func:`loads`: tuples nest at most MAX_DEPTH deep (each level is
    a nested unpack on the C stack, so a hostile nesting could exhaust it)."""

    def __init__(self) -> None:
        self.depth = 0

    def __call__(self, code: int, data: bytes) -> Any:
        if code == _TUPLE:
            if self.depth >= MAX_DEPTH:
                raise ProtocolError(f"tuples nested deeper than {MAX_DEPTH} levels")
            self.depth += 1
            try:
                items = _unpack(data, self)
            finally:
                self.depth -= 1
            if type(items) is not list:
                raise ProtocolError("tuple extension does not hold an array")
            return tuple(items)
        if code in (_NDARRAY, _SCALAR):
            return _array(code, data)
        raise ProtocolError(f"unknown msgpack extension {code}")


def _unpack(data: bytes, hook: _Decoder) -> Any:
    return msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False)


def loads(data: bytes, allow_pickle: bool, origin: str = "a peer") -> Any:
    """Inverse of :func:`dumps`, for bytes that came from ``origin`` (named in errors).

    Raises:
        ProtocolError: the bytes are not a value :func:`dumps` could have produced (any
            decoding failure: truncated or trailing data, a malformed extension, an
            unhashable map key, ...), or a pickled payload while pickle is not allowed.
    """
    if data.startswith(_PICKLE_MARK):
        if not allow_pickle:
            raise ProtocolError(f"{origin} sent a pickled value but allow_pickle is False")
        try:
            return pickle.loads(data[len(_PICKLE_MARK) :])
        except Exception as exc:
            raise ProtocolError(
                f"{origin} sent a malformed pickled value: {type(exc).__name__}: {exc}"
            ) from exc
    try:
        return _unpack(data, _Decoder())
    except Exception as exc:  # anything a hostile payload can provoke
        raise ProtocolError(
            f"{origin} sent a malformed value: {type(exc).__name__}: {exc}"
        ) from exc
