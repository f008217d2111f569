"""The frame header (sans-IO): packing, parsing and its bounds checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiocollect.errors import ProtocolError
from aiocollect.transport.wire import (
    ABORT,
    CONTROL,
    DATA,
    HEADER,
    HEADER_SIZE,
    KINDS,
    MAGIC,
    MAX_CONTROL,
    P2P,
    Header,
    control_header,
    pack_header,
    parse_header,
)

U32, U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
headers = st.builds(
    Header,
    kind=st.sampled_from(KINDS),
    coll=st.integers(0, 255),
    op=st.integers(0, 255),
    dtype=st.integers(0, 255),
    gid=U32,
    chunk=U32,
    seq=U64,
    slot=U64,
    root=st.integers(-(2**31), 2**31 - 1),
    elems=U64,
    length=st.integers(0, 1 << 20),
)


def test_header_is_fifty_bytes() -> None:
    assert HEADER_SIZE == 50 == len(control_header(ABORT, 0))


@given(h=headers)
def test_round_trip(h: Header) -> None:
    raw = pack_header(h)
    assert len(raw) == HEADER_SIZE
    assert parse_header(raw, 1 << 20) == h


@given(h=headers)
def test_key_and_fingerprint(h: Header) -> None:
    assert h.key == (h.kind, h.gid, h.seq, h.slot, h.chunk)
    assert h.fingerprint == (h.coll, h.dtype, h.elems, h.op, h.root)


def test_control_header() -> None:
    h = parse_header(control_header(ABORT, 17), 0)
    assert (h.kind, h.length, h.root, h.seq) == (ABORT, 17, -1, 0)


@pytest.mark.parametrize("magic", [0, 0xFFFF, MAGIC ^ 0x100])
def test_bad_magic(magic: int) -> None:
    raw = HEADER.pack(magic, DATA, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0)
    with pytest.raises(ProtocolError, match=f"magic 0x{magic:04x}"):
        parse_header(raw, 100)


@pytest.mark.parametrize("kind", [0, 7, 99, 255])
def test_unknown_kind(kind: int) -> None:
    with pytest.raises(ProtocolError, match=f"kind {kind}"):
        parse_header(HEADER.pack(MAGIC, kind, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0), 100)


@pytest.mark.parametrize("kind", [DATA, P2P])
def test_payload_bound_is_the_chunk_size(kind: int) -> None:
    def raw(length: int) -> bytes:
        return pack_header(Header(kind, 0, 0, 0, 0, 0, 0, 0, -1, 0, length))

    assert parse_header(raw(64), 64).length == 64
    with pytest.raises(ProtocolError, match="exceeds the limit of 64"):
        parse_header(raw(65), 64)
    with pytest.raises(ProtocolError):
        parse_header(raw(2**64 - 1), 64)


@pytest.mark.parametrize("kind", CONTROL)
def test_control_frames_have_their_own_bound(kind: int) -> None:
    assert parse_header(control_header(kind, MAX_CONTROL), 1).length == MAX_CONTROL
    with pytest.raises(ProtocolError, match="exceeds"):
        parse_header(control_header(kind, MAX_CONTROL + 1), 1 << 40)
