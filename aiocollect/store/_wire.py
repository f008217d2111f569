"""Wire format of the TCP store (sans-IO apart from :func:`read_frame`, for small frames;
:mod:`aiocollect.store._stream` reads and writes large ones in chunks).

Every message is a frame: a 4-byte big-endian length, then that many bytes of msgpack.

Connection start (server speaks first)::

    S->C  [MAGIC, VERSION, nonce_s | None]        nonce only when the server has a secret
          | [MAGIC, VERSION, False, reason]        refused (protected mode); then closed
    C->S  [nonce_c, proof("store-client")]         when nonce_s was sent
          | [None, None]                           when it was not
    S->C  [True, proof("store-server")] | [False, reason]    (only when nonce_s was sent)

Then the client sends requests ``[rid, op, *args]`` and the server answers
``[rid, status, payload]``, in any order (waits answer when they complete)::

    [rid, "set", key, value]         -> OK None
    [rid, "get", key, timeout]       -> OK value | TIMEOUT [key]
    [rid, "add", key, amount]        -> OK new_value
    [rid, "wait", [keys], timeout]   -> OK None | TIMEOUT [missing keys]
    [rid, "multi_get", [keys], timeout] -> OK [value, ...] | TIMEOUT [missing keys]
                                        | ERROR reason (the answer would exceed max_frame)
    [rid, "check", [keys]]           -> OK [bool, ...]
    [rid, "delete", key]             -> OK existed
    [rid, "cancel", target_rid]      (no answer; abandons a pending get/wait)

``timeout`` is seconds (float) or None for no deadline. ``multi_get`` came with protocol
version 3: a client finding a version 2 server (which would close the connection on an
unknown op) reads many keys with ``wait`` and one ``get`` each instead; a version 2
client refuses a version 3 server at the handshake, saying which versions met. Any
failure to decode or validate closes the connection; a refused ``set``/``add`` (quota)
answers ``ERROR reason``.

Decoding is bounded (:func:`decode`): a message is an array whose items are scalars or
arrays of scalars (no maps, no extension types, no deeper nesting), with at most
:data:`MAX_ITEMS` values in all, so a frame of N bytes never becomes more than a few
hundred thousand Python objects, whatever N is.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgpack

from aiocollect import _auth
from aiocollect.errors import ProtocolError

MAGIC = "aiocollect-store"
VERSION = 3
#: Server versions a client accepts (2: without ``multi_get``).
ACCEPTED_VERSIONS = (2, 3)
#: The first version whose server answers ``multi_get``.
MULTI_GET_VERSION = 3
MAX_FRAME = 64 * 1024 * 1024
#: Bodies (and ``bin`` values) above this size are decoded to views, not copies.
VIEW_MIN = 64 * 1024
MAX_HANDSHAKE_FRAME = 1024
#: Most keys one ``wait``/``check``/``multi_get`` may name (and one answer may list).
MAX_KEYS = 16384
#: Most values in one decoded message: the keys of a wait plus its few other fields.
MAX_ITEMS = MAX_KEYS + 16
#: Longest key (and error text), in UTF-8 bytes.
MAX_KEY_BYTES = 64 * 1024
HEADER = struct.Struct("!I")
CONTEXT = b"aiocollect-store/1"
CLIENT_ROLE = b"store-client"
SERVER_ROLE = b"store-server"

#: What a frame's body or a stored value may be: received frames are decoded in place.
Buffer: TypeAlias = bytes | bytearray | memoryview

OK = 0
TIMEOUT = 1
ERROR = 2

OPS = frozenset({"set", "get", "add", "wait", "multi_get", "check", "delete", "cancel"})
#: Bytes an answer to ``multi_get`` adds to the values it carries: per value (its ``bin``
#: header) and in all (the answer's frame header, array headers, request id, status).
MULTI_GET_PER_VALUE = 5
MULTI_GET_OVERHEAD = 32
_MAX_RID = 2**63


def encode(obj: object) -> list[bytes]:
    """The frame for ``obj``, as header and body (for ``writelines``, avoiding a copy).

    Raises:
        TypeError, ValueError, OverflowError: ``obj`` is not msgpack-serializable.
    """
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return [HEADER.pack(len(body)), body]


# Size of the value each msgpack type byte starts, when it is fixed: fixints, nil, bools,
# floats, ints. _ARRAY, _STR, _BIN: the byte starts one (then the header's size); _REFUSED:
# maps, extension types and the never-used 0xc1.
_ARRAY, _STR, _BIN, _REFUSED = -1, -2, -3, -4
_SIZE = [_REFUSED] * 256
for _b in (*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3):
    _SIZE[_b] = 1
for _b, _n in (
    (0xCA, 5),
    (0xCB, 9),
    (0xCC, 2),
    (0xCD, 3),
    (0xCE, 5),
    (0xCF, 9),
    (0xD0, 2),
    (0xD1, 3),
    (0xD2, 5),
    (0xD3, 9),
):
    _SIZE[_b] = _n
for _b in (*range(0x90, 0xA0), 0xDC, 0xDD):
    _SIZE[_b] = _ARRAY
for _b in (*range(0xA0, 0xC0), 0xD9, 0xDA, 0xDB):
    _SIZE[_b] = _STR
for _b in (0xC4, 0xC5, 0xC6):
    _SIZE[_b] = _BIN
#: Bytes of the length field after the type byte, for the sized types.
_LENGTH_BYTES = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4, 0xDC: 2, 0xDD: 4}
#: Arrays nest at most this deep: the message's own, and lists of keys inside it.
MAX_DEPTH = 2


def check_shape(body: Buffer, max_items: int = MAX_ITEMS, *, partial: bool = False) -> list[int]:
    """Check, without building any object, that ``body`` is one msgpack value of the shape
    the store speaks: scalars (nil, bool, int, float, str, bin) and arrays nested at most
    :data:`MAX_DEPTH` deep, with at most ``max_items`` values in all.

    Its cost is proportional to the number of values, not to the bytes; each array's
    length is checked against what is left of ``max_items`` before any of its items is
    looked at, so a hostile frame is refused after reading a few bytes of it. With
    ``partial``, ``body`` is the beginning of a frame still arriving: running out of bytes
    is not an error (so a frame can be refused before the rest of it is buffered).

    Returns:
        Where each item of the message begins, when it is an array (the items' spans, for
        :func:`decode`); empty when it is a scalar, or with ``partial``.

    Raises:
        ProtocolError: anything else (maps, extension types, deeper nesting, too many
            values, a truncated value, trailing bytes).
    """
    end = len(body)
    pos = 0
    left = [1]  # values still to read in each array being read (the outermost: the body)
    budget = max_items
    size = _SIZE
    starts: list[int] = []
    while left:
        if not left[-1]:
            left.pop()
            continue
        left[-1] -= 1
        if len(left) == 2:
            starts.append(pos)
        if pos >= end:
            if partial:
                return []
            raise ProtocolError("malformed store message: truncated")
        b = body[pos]
        n = size[b]
        if n > 0:
            pos += n
            continue
        if n == _REFUSED:
            raise ProtocolError(
                "malformed store message: maps and extension types are not part of it"
            )
        if 0xA0 <= b <= 0xBF:
            pos += 1 + (b & 0x1F)
            continue
        if 0x90 <= b <= 0x9F:
            count, pos = b & 0x0F, pos + 1
        else:
            width = _LENGTH_BYTES[b]
            count = int.from_bytes(body[pos + 1 : pos + 1 + width], "big")
            pos += 1 + width
            if n != _ARRAY:
                pos += count
                continue
        if len(left) > MAX_DEPTH:
            raise ProtocolError("malformed store message: arrays nested too deep")
        budget -= count
        if budget < 0:
            raise ProtocolError(f"malformed store message: more than {max_items} values")
        left.append(count)
    if pos != end and not (partial and pos > end):
        raise ProtocolError(
            "malformed store message: " + ("truncated" if pos > end else "trailing bytes")
        )
    return [] if partial else starts


def decode(body: Buffer, max_items: int = MAX_ITEMS) -> Any:
    """Decode one frame's body, bounding what it may expand to (see :func:`check_shape`).

    Strings are at most :data:`MAX_KEY_BYTES` long; the msgpack decoder enforces the same
    limits again (``max_*_len``). A body over :data:`VIEW_MIN` bytes must be an array; its
    ``bin`` items over :data:`VIEW_MIN` bytes come back as read-only ``memoryview`` slices
    of ``body``, not copies (so a large value costs no copy in one go, and keeps ``body``
    alive; ``body`` must not change afterwards).

    Raises:
        ProtocolError: not exactly one value of that shape.
    """
    starts = check_shape(body, max_items)
    if len(body) <= VIEW_MIN:
        return _unpack(body, max_items)
    if not starts:
        raise ProtocolError("malformed store message: a large message must be an array")
    view = memoryview(body).toreadonly()
    items: list[Any] = []
    for start, end in zip(starts, [*starts[1:], len(body)], strict=True):
        b = body[start]
        if 0xC4 <= b <= 0xC6 and end - start > VIEW_MIN:
            items.append(view[start + 1 + _LENGTH_BYTES[b] : end])
        else:
            items.append(_unpack(view[start:end], max_items))
    return items


def _unpack(body: Buffer, max_items: int) -> Any:
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_KEY_BYTES,
            max_bin_len=max(len(body), 1),
            max_array_len=max_items,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed store message: {exc}") from None


def encode_frame(items: list[object]) -> tuple[bytes, Buffer]:
    """The frame for the message ``items`` as a head and a blob, written one after the
    other: when the last item is a ``bin`` over :data:`VIEW_MIN` bytes, the blob is that
    value itself, uncopied (:func:`encode_parts`); else the head is the header and the
    blob the encoded body.

    Raises:
        TypeError, ValueError, OverflowError: ``items`` is not msgpack-serializable.
    """
    if items and isinstance(items[-1], bytes | memoryview) and len(items[-1]) > VIEW_MIN:
        return encode_parts(items[:-1], items[-1])
    header, body = encode(items)
    return header, body


def encode_parts(items: list[object], blob: Buffer) -> tuple[bytes, Buffer]:
    """The frame for ``[*items, blob]`` as its beginning (header, ``items`` and the bin
    header of ``blob``) and ``blob`` itself, uncopied, to be written after it.

    Raises:
        TypeError, ValueError, OverflowError: an item is not msgpack-serializable.
    """
    if len(items) >= 15:
        raise ValueError("encode_parts: at most 14 items before the blob")
    head = bytes([0x90 | (len(items) + 1)]) + b"".join(
        msgpack.packb(x, use_bin_type=True) for x in items
    )
    head += b"\xc6" + len(blob).to_bytes(4, "big")
    return HEADER.pack(len(head) + len(blob)) + head, blob


async def read_frame(reader: asyncio.StreamReader, limit: int) -> Any:
    """Read and decode one frame in one go (the handshake's; for any size of frame use
    :func:`aiocollect.store._stream.read_frame`).

    Raises:
        ProtocolError: the announced length exceeds ``limit`` or the body is malformed.
        asyncio.IncompleteReadError: the stream ended (the peer closed the connection).
        ConnectionError: the connection failed.
    """
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > limit:
        raise ProtocolError(f"store message of {size} bytes exceeds the limit of {limit}")
    return decode(await reader.readexactly(size))


@dataclass(frozen=True, slots=True)
class Request:
    """A validated request; fields not used by ``op`` keep their defaults."""

    rid: int
    op: str
    key: str = ""
    keys: tuple[str, ...] = ()
    value: bytes | memoryview = b""
    amount: int = 0
    timeout: float | None = None
    target: int = 0


def _want(cond: bool, what: str) -> None:
    if not cond:
        raise ProtocolError(f"malformed store request: {what}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_timeout(x: object) -> bool:
    return x is None or (isinstance(x, int | float) and not isinstance(x, bool) and x >= 0)


def parse_request(msg: Any) -> Request:
    """Validate a decoded request.

    Raises:
        ProtocolError: wrong shape, unknown op or argument types.
    """
    _want(isinstance(msg, list) and len(msg) >= 2, "not a [rid, op, ...] list")
    rid, op, args = msg[0], msg[1], msg[2:]
    _want(_is_int(rid) and 0 <= rid < _MAX_RID, "bad request id")
    _want(isinstance(op, str) and op in OPS, f"unknown op {op!r}")
    arity = {"check": 1, "delete": 1, "cancel": 1}.get(op, 2)
    _want(len(args) == arity, f"{op} takes {arity} arguments")
    if op in ("check", "wait", "multi_get"):
        keys = args[0]
        _want(isinstance(keys, list) and all(isinstance(k, str) for k in keys), "bad keys")
        if op == "check":
            return Request(rid, op, keys=tuple(keys))
        _want(_is_timeout(args[1]), "bad timeout")
        return Request(rid, op, keys=tuple(keys), timeout=_float(args[1]))
    if op == "cancel":
        _want(_is_int(args[0]), "bad cancel target")
        return Request(rid, op, target=args[0])
    key = args[0]
    _want(isinstance(key, str), "key is not a str")
    if op == "set":
        _want(isinstance(args[1], bytes | memoryview), "value is not bytes")
        return Request(rid, op, key=key, value=args[1])
    if op == "get":
        _want(_is_timeout(args[1]), "bad timeout")
        return Request(rid, op, key=key, timeout=_float(args[1]))
    if op == "add":
        _want(_is_int(args[1]), "amount is not an int")
        return Request(rid, op, key=key, amount=args[1])
    return Request(rid, op, key=key)  # delete


def _float(x: int | float | None) -> float | None:
    return None if x is None else float(x)


def parse_response(msg: Any) -> tuple[int, int, Any]:
    """Validate a decoded response: ``(rid, status, payload)``.

    Raises:
        ProtocolError: wrong shape.
    """
    if (
        not isinstance(msg, list)
        or len(msg) != 3
        or not _is_int(msg[0])
        or msg[1] not in (OK, TIMEOUT, ERROR)
    ):
        raise ProtocolError("malformed store response")
    return msg[0], msg[1], msg[2]


def hello(nonce: bytes | None) -> list[object]:
    """The server's first message."""
    return [MAGIC, VERSION, nonce]


def refusal(reason: str) -> list[object]:
    """The server's first and last message to a connection it refuses (protected mode)."""
    return [MAGIC, VERSION, False, reason]


class Refused(Exception):
    """The server refused this connection before the handshake; ``str()`` is its reason."""


def multi_get_size(values: Sequence[Buffer]) -> int:
    """An upper bound on the body of the answer to a ``multi_get`` carrying ``values``."""
    return MULTI_GET_OVERHEAD + sum(len(v) + MULTI_GET_PER_VALUE for v in values)


def parse_hello(msg: Any) -> tuple[int, bytes | None]:
    """The server's protocol version and nonce from its hello (nonce None: the server has
    no secret).

    Raises:
        Refused: the server refused the connection (its message says why and what to do).
        ProtocolError: not an aiocollect store, or another protocol version.
    """
    if (
        isinstance(msg, list)
        and len(msg) == 4
        and msg[0] == MAGIC
        and msg[2] is False
        and isinstance(msg[3], str)
    ):
        raise Refused(msg[3])
    if not (isinstance(msg, list) and len(msg) == 3 and msg[0] == MAGIC):
        raise ProtocolError("the peer is not an aiocollect TCP store")
    version = msg[1]
    if version not in ACCEPTED_VERSIONS or isinstance(version, bool):
        raise ProtocolError(
            f"store protocol version {version!r}, expected one of {list(ACCEPTED_VERSIONS)}"
        )
    nonce = msg[2]
    if nonce is not None and not (isinstance(nonce, bytes) and len(nonce) == _auth.NONCE_BYTES):
        raise ProtocolError("bad store challenge")
    return version, nonce


def client_proof(secret: bytes, nonce_c: bytes, nonce_s: bytes) -> list[object]:
    """The client's answer to the challenge."""
    return [nonce_c, _auth.proof(secret, CLIENT_ROLE, nonce_c, nonce_s, CONTEXT)]


#: The client's first frame when the server has no secret.
NO_PROOF: list[object] = [None, None]


def check_client_proof(secret: bytes, nonce_s: bytes, msg: Any) -> bytes | None:
    """The client's nonce if its proof is valid, else None (malformed counts as invalid)."""
    if not (isinstance(msg, list) and len(msg) == 2):
        return None
    nonce_c, mac = msg
    if not (isinstance(nonce_c, bytes) and len(nonce_c) == _auth.NONCE_BYTES):
        return None
    if not isinstance(mac, bytes):
        return None
    if not _auth.check(secret, mac, CLIENT_ROLE, nonce_c, nonce_s, CONTEXT):
        return None
    return nonce_c


def server_proof(secret: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    """The server's proof, sent once the client's proof checked out."""
    return _auth.proof(secret, SERVER_ROLE, nonce_s, nonce_c, CONTEXT)


def check_server_verdict(secret: bytes, nonce_c: bytes, nonce_s: bytes, msg: Any) -> str | None:
    """None if the server accepted us and proved the secret, else the reason it failed."""
    if isinstance(msg, list) and len(msg) == 2 and msg[0] is False:
        return f"the store rejected our secret ({msg[1]})"
    if not (isinstance(msg, list) and len(msg) == 2 and msg[0] is True):
        return "malformed authentication answer from the store"
    mac = msg[1]
    if not isinstance(mac, bytes) or not _auth.check(
        secret, mac, SERVER_ROLE, nonce_s, nonce_c, CONTEXT
    ):
        return "the store could not prove the shared secret"
    return None
