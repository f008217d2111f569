"""ABORT frames (sans-IO): what a rank tells its peers when the group breaks, and what
the peers rebuild from it; and the liveness probe's question."""

from __future__ import annotations

import struct

import msgpack
import pytest

from aiocollect import errors
from aiocollect.engine.closing import decode_abort as _decode_abort
from aiocollect.engine.closing import encode_abort as _encode_abort
from aiocollect.engine.fabric import Fabric
from aiocollect.engine.liveness import CALLED_QUERY


@pytest.mark.parametrize(
    ("exc", "cls"),
    [
        (errors.MismatchError("rank 0 called x but rank 1 called y"), errors.MismatchError),
        (errors.PeerTimeout("ranks [2, 3] sent nothing", [3, 2]), errors.PeerTimeout),
        (errors.PeerDisconnected("rank 2 disconnected", 2), errors.PeerDisconnected),
        (errors.ProtocolError("bad frame"), errors.GroupBrokenError),
        (errors.GroupBrokenError("aborted"), errors.GroupBrokenError),
        (ValueError("anything else"), errors.GroupBrokenError),
    ],
)
def test_abort_round_trip(exc: BaseException, cls: type[BaseException]) -> None:
    rebuilt = _decode_abort(1, _encode_abort(0, exc))
    assert type(rebuilt) is cls
    assert str(rebuilt) == f"rank 0 aborted the group: {exc}"
    if isinstance(exc, errors.PeerTimeout):
        assert rebuilt.ranks == [2, 3]  # type: ignore[attr-defined]
    if isinstance(exc, errors.PeerDisconnected):
        assert rebuilt.rank == 2  # type: ignore[attr-defined]


def test_relayed_abort_keeps_its_origin() -> None:
    """A rank relaying an ABORT it received forwards the original, not its own view."""
    first = _decode_abort(1, _encode_abort(0, errors.MismatchError("m")))
    relayed = _decode_abort(2, _encode_abort(1, first))
    assert str(relayed) == "rank 0 aborted the group: m"


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb({"type": "X"}),
        msgpack.packb({"rank": "zero", "type": "X", "message": "m"}),
        msgpack.packb({"rank": 0, "type": "PeerTimeout", "message": "m", "ranks": ["a"]}),
    ],
)
def test_malformed_abort_is_a_protocol_error(payload: bytes) -> None:
    exc = _decode_abort(3, payload)
    assert isinstance(exc, errors.ProtocolError)
    assert "rank 3 sent a malformed ABORT frame" in str(exc)


def test_probe_question_answers_whether_an_operation_was_called() -> None:
    """A PING may ask "have you called operation seq of group gid?"; the answer is one
    byte after the echoed payload (a plain token is just echoed)."""
    fabric = Fabric(rank=1, world_size=3, max_frame=64)
    token = (7).to_bytes(8, "little")
    assert fabric.liveness.called(token) == b""

    def ask(gid: int, seq: int) -> bytes:
        return fabric.liveness.called(token + CALLED_QUERY.pack(gid, seq))

    assert ask(0, 0) == b"\x00"
    fabric.registry.register(0, 0, (1, 1, 1, 0, -1), [0, 1, 2])
    fabric.registry.register(0, 1, (1, 1, 1, 0, -1), [0, 1, 2])
    # a yes carries this rank's fingerprint of the operation (mismatches found while waiting)
    fp = struct.pack("<qqqqq", 1, 1, 1, 0, -1)
    assert [ask(0, 0), ask(0, 1), ask(0, 2), ask(5, 0)] == [
        b"\x01" + fp,
        b"\x01" + fp,
        b"\x00",
        b"\x00",
    ]
