"""The bytes on a shared-memory link's socket (transport/shm_socket.py), parsed with no
event loop: doorbells, frames split anywhere across reads, an escaped ABORT, and every
malformed input."""

from __future__ import annotations

import pytest

from aiocollect.errors import ProtocolError
from aiocollect.transport.shm_socket import (
    ABORTED,
    BELL,
    ESCAPE,
    ESCAPED,
    FRAME,
    RANG,
    SOCKET_FRAME,
    SOCKET_FRAME_MAX,
    Event,
    SocketParser,
)
from aiocollect.transport.wire import (
    ABORT,
    DATA,
    HEADER_SIZE,
    P2P,
    Header,
    control_header,
    pack_header,
)

MAX_FRAME = 1 << 20


def _frame(kind: int, payload: bytes, slot: int = 0) -> bytes:
    n = len(payload)
    return pack_header(Header(kind, 1, 0, 1, 0, 0, 1, slot, -1, n, n)) + payload


def _feed(parser: SocketParser, *reads: bytes) -> list[Event]:
    events: list[Event] = []
    for data in reads:
        events.extend(parser.feed(memoryview(data)))
    return events


def test_doorbells_ring_once_per_read() -> None:
    parser = SocketParser(MAX_FRAME)
    assert _feed(parser, BELL * 5) == [(RANG, None, b"")]
    assert not parser.busy


@pytest.mark.parametrize("split", [1, 2, HEADER_SIZE, HEADER_SIZE + 1, HEADER_SIZE + 3])
def test_frames_split_anywhere_come_whole_and_in_order(split: int) -> None:
    a, b = _frame(DATA, b"abcd", slot=1), _frame(P2P, b"", slot=2)
    wire = BELL + SOCKET_FRAME + a + SOCKET_FRAME + b + BELL
    parser = SocketParser(MAX_FRAME)
    events = _feed(parser, wire[:split], wire[split:])
    frames = [(h.slot, bytes(data)) for kind, h, data in events if kind == FRAME and h]
    assert frames == [(1, a), (2, b)]
    assert (RANG, None, b"") in events
    assert not parser.busy


def test_a_partly_read_frame_keeps_the_parser_busy() -> None:
    frame = _frame(DATA, b"x" * 100)
    parser = SocketParser(MAX_FRAME)
    assert _feed(parser, SOCKET_FRAME + frame[:10]) == []
    assert parser.busy
    assert parser.frame is not None
    assert parser.head is None
    assert _feed(parser, frame[10 : HEADER_SIZE + 5]) == []
    assert parser.head is not None
    assert parser.head.length == 100
    ((kind, _, data),) = _feed(parser, frame[HEADER_SIZE + 5 :])
    assert kind == FRAME
    assert bytes(data) == frame
    assert not parser.busy


def test_an_escaped_abort_is_taken_whole_and_nothing_after_it() -> None:
    message = b"the ring is corrupt"
    abort = control_header(ABORT, len(message)) + message
    parser = SocketParser(MAX_FRAME)
    events = _feed(parser, BELL + ESCAPE + abort[:7])
    assert events == [(ESCAPED, None, b"")]  # (no doorbell: the escape ends the bytes)
    assert parser.busy
    assert _feed(parser, abort[7:] + b"\x07 trailing") == [(ABORTED, None, message)]
    assert not parser.busy
    assert parser.escaped is None


def _huge() -> bytes:
    n = SOCKET_FRAME_MAX + 1
    return SOCKET_FRAME + pack_header(Header(DATA, 1, 0, 1, 0, 0, 0, 0, -1, n, n))


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (b"\x07", "byte 0x07 on its socket"),
        (_huge(), f"at most {SOCKET_FRAME_MAX}"),
        (SOCKET_FRAME + b"\x00" * HEADER_SIZE, "a malformed frame on its socket: bad frame magic"),
        (ESCAPE + _frame(DATA, b"x"), "only an ABORT may follow"),
    ],
)
def test_malformed_input_is_a_protocol_error_and_resets(wire: bytes, match: str) -> None:
    parser = SocketParser(MAX_FRAME)
    with pytest.raises(ProtocolError, match=match):
        _feed(parser, BELL + wire)
    assert not parser.busy
    assert parser.frame is None
    assert parser.escaped is None
