"""Wire format of the TCP store (sans-IO apart from :func:`read_frame`).

Every message is a frame: a 4-byte big-endian length, then that many bytes of msgpack.

Connection start (server speaks first)::

    S->C  [MAGIC, VERSION, nonce_s | None]        nonce only when the server has a secret
    C->S  [nonce_c, proof("store-client")]         only when nonce_s was sent
    S->C  [True, proof("store-server")] | [False, reason]

Then the client sends requests ``[rid, op, *args]`` and the server answers
``[rid, status, payload]``, in any order (waits answer when they complete)::

    [rid, "set", key, value]         -> OK None
    [rid, "get", key, timeout]       -> OK value | TIMEOUT [key]
    [rid, "add", key, amount]        -> OK new_value
    [rid, "wait", [keys], timeout]   -> OK None | TIMEOUT [missing keys]
    [rid, "check", [keys]]           -> OK [bool, ...]
    [rid, "delete", key]             -> OK existed
    [rid, "cancel", target_rid]      (no answer; abandons a pending get/wait)

``timeout`` is seconds (float) or None for no deadline. Any failure to decode or validate
closes the connection.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from aiocollect import _auth
from aiocollect.errors import ProtocolError

MAGIC = "aiocollect-store"
VERSION = 1
MAX_FRAME = 64 * 1024 * 1024
MAX_HANDSHAKE_FRAME = 1024
HEADER = struct.Struct("!I")
CONTEXT = b"aiocollect-store/1"
CLIENT_ROLE = b"store-client"
SERVER_ROLE = b"store-server"

OK = 0
TIMEOUT = 1
ERROR = 2

OPS = frozenset({"set", "get", "add", "wait", "check", "delete", "cancel"})
_MAX_RID = 2**63


def encode(obj: object) -> list[bytes]:
    """The frame for ``obj``, as header and body (for ``writelines``, avoiding a copy).

    Raises:
        TypeError, ValueError, OverflowError: ``obj`` is not msgpack-serializable.
    """
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return [HEADER.pack(len(body)), body]


def decode(body: bytes) -> Any:
    """Decode one frame's body.

    Raises:
        ProtocolError: not exactly one valid msgpack object.
    """
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed store message: {exc}") from None


async def read_frame(reader: asyncio.StreamReader, limit: int) -> Any:
    """Read and decode one frame.

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
    value: bytes = b""
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
    if op in ("check", "wait"):
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
        _want(isinstance(args[1], bytes), "value is not bytes")
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


def parse_hello(msg: Any) -> bytes | None:
    """The server's nonce from its hello (None: the server has no secret).

    Raises:
        ProtocolError: not an aiocollect store, or another protocol version.
    """
    if not (isinstance(msg, list) and len(msg) == 3 and msg[0] == MAGIC):
        raise ProtocolError("the peer is not an aiocollect TCP store")
    if msg[1] != VERSION:
        raise ProtocolError(f"store protocol version {msg[1]!r}, expected {VERSION}")
    nonce = msg[2]
    if nonce is not None and not (isinstance(nonce, bytes) and len(nonce) == _auth.NONCE_BYTES):
        raise ProtocolError("bad store challenge")
    return nonce


def client_proof(secret: bytes, nonce_c: bytes, nonce_s: bytes) -> list[object]:
    """The client's answer to the challenge."""
    return [nonce_c, _auth.proof(secret, CLIENT_ROLE, nonce_c, nonce_s, CONTEXT)]


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
