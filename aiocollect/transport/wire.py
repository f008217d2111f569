"""The frame format (sans-IO).

Every frame is a fixed 50-byte little-endian header, then ``length`` payload bytes::

    magic   u16  0xAC01
    kind    u8   DATA | P2P | ABORT | GOODBYE | PING | PONG
    coll    u8   Collective of the operation (fingerprint)
    op      u8   reduction op code (fingerprint; 0 when none)
    dtype   u8   dtype code (fingerprint)
    gid     u32  group id (WORLD_GID = 0: the world group; sub-groups from split get their own)
    chunk   u32  chunk index within the slot
    seq     u64  operation sequence number (P2P: per (sender, tag) message counter)
    slot    u64  algorithm-defined step/block slot (P2P: the user tag)
    root    i32  root rank of the operation, -1 when none (fingerprint)
    elems   u64  element count of the operation (fingerprint)
    length  u64  payload bytes

A frame is addressed by its *key* ``(kind, gid, seq, slot, chunk)``; receives are posted by
key and matched in any order. Handshakes before the first frame are length-prefixed msgpack
maps (u32 length, at most ``MAX_HANDSHAKE`` bytes).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from aiocollect.errors import ProtocolError

MAGIC = 0xAC01
HEADER = struct.Struct("<HBBBBIIQQiQQ")
HEADER_SIZE = HEADER.size
#: The magic as it starts every header (the shared-memory ring's reference records put
#: their own magic in its place).
MAGIC_BYTES = MAGIC.to_bytes(2, "little")
#: Byte offsets into a packed header: the kind (right after the magic), the group id and
#: the sequence number (followed by the slot).
KIND_AT = len(MAGIC_BYTES)
GID_AT = 6
SEQ_AT = 14
#: The sequence number's field, packed on its own (a header is patched with it in place).
SEQ = struct.Struct("<Q")
LENGTH_PREFIX = struct.Struct("<I")
MAX_HANDSHAKE = 64 * 1024
MAX_CONTROL = 1 << 20

DATA = 1
P2P = 2
ABORT = 3
GOODBYE = 4
PING = 5
PONG = 6
KINDS = (DATA, P2P, ABORT, GOODBYE, PING, PONG)
CONTROL = (ABORT, GOODBYE, PING, PONG)

#: The group id of the world group (every rank; sub-groups from ``split`` get their own,
#: never this one).
WORLD_GID = 0


class Key(NamedTuple):
    """What a frame is addressed by; receives are posted by key and matched in any order.

    Equal (and hashing equal) to the plain tuple of its fields, and shown as one in
    messages."""

    kind: int
    gid: int
    seq: int
    slot: int
    chunk: int

    def __repr__(self) -> str:
        return repr(tuple(self))


#: Builds a Key from a tuple without the NamedTuple constructor's Python-level call (the
#: read path makes one per frame).
_new_key = tuple.__new__


class Header(NamedTuple):
    kind: int
    coll: int
    op: int
    dtype: int
    gid: int
    chunk: int
    seq: int
    slot: int
    root: int
    elems: int
    length: int

    @property
    def key(self) -> Key:
        return _new_key(Key, (self.kind, self.gid, self.seq, self.slot, self.chunk))

    @property
    def fingerprint(self) -> tuple[int, int, int, int, int]:
        return (self.coll, self.dtype, self.elems, self.op, self.root)


def stream_of(header: bytes) -> bytes:
    """The ``(kind, gid, seq, slot)`` bytes of a packed frame header: frames of one stream
    keep their order."""
    return (
        header[KIND_AT : KIND_AT + 1] + header[GID_AT : GID_AT + 4] + header[SEQ_AT : SEQ_AT + 16]
    )


def pack_header(h: Header) -> bytes:
    return HEADER.pack(MAGIC, *h)


def control_header(kind: int, length: int) -> bytes:
    """Header of a control frame (ABORT, GOODBYE, PING, PONG)."""
    return HEADER.pack(MAGIC, kind, 0, 0, 0, 0, 0, 0, 0, -1, 0, length)


def parse_header(buf: bytes | bytearray | memoryview, max_length: int, offset: int = 0) -> Header:
    """Decode and bounds-check the header at ``buf[offset:]``.

    Raises:
        ProtocolError: bad magic, unknown kind, or a payload longer than allowed.
    """
    fields = HEADER.unpack_from(buf, offset)
    if fields[0] != MAGIC:
        raise ProtocolError(f"bad frame magic 0x{fields[0]:04x}")
    h = Header._make(fields[1:])
    if h.kind not in KINDS:
        raise ProtocolError(f"unknown frame kind {h.kind}")
    limit = MAX_CONTROL if h.kind in CONTROL else max_length
    if h.length > limit:
        raise ProtocolError(f"frame of {h.length} bytes exceeds the limit of {limit}")
    return h
