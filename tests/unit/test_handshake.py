"""The peer-link handshake (sans-IO): both sides driven by hand, message by message."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from aiocollect.errors import AuthenticationError, ProtocolError, RendezvousError
from aiocollect.rendezvous.handshake import (
    PROTOCOL_VERSION,
    AcceptorHandshake,
    ConnectorHandshake,
)
from aiocollect.transport.base import Rejection
from aiocollect.transport.tcp_link import LANE_ATTACHED

Msg = dict[str, Any]


def _wire(msg: Msg) -> Msg:
    """What the peer receives: every message survives msgpack."""
    out: Msg = msgpack.unpackb(msgpack.packb(msg, use_bin_type=True), raw=False)
    return out


def run(acceptor: AcceptorHandshake, connector: ConnectorHandshake) -> tuple[int, int]:
    """Shuttle messages until both sides know their peer; (acceptor's peer, connector's
    peer). A Rejection's reply is delivered to the connector, whose error is raised."""
    to_connector = [_wire(m) for m in acceptor.start()]
    assert connector.start() == []
    a_peer = c_peer = None
    while to_connector:
        replies, c_peer = connector.on_message(to_connector.pop(0))
        for msg in replies:
            try:
                back, a_peer = acceptor.on_message(_wire(msg))
            except Rejection as rej:
                connector.on_message(_wire(rej.reply))
                raise AssertionError("the connector accepted a reject") from None
            to_connector.extend(_wire(m) for m in back)
    assert a_peer is not None
    assert c_peer is not None
    return a_peer, c_peer


def acceptor(
    secret: bytes | None = None, rank: int = 0, world: int = 3, group: str = "g", admit: Any = None
) -> AcceptorHandshake:
    return AcceptorHandshake(group, rank, world, secret, admit or (lambda peer: None))


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_handshake_completes(secret: bytes | None) -> None:
    assert run(acceptor(secret), ConnectorHandshake("g", 2, 0, 3, secret)) == (2, 0)


@pytest.mark.parametrize(("a_secret", "c_secret"), [(b"right", b"wrong"), (b"right", None)])
def test_connector_without_the_secret_is_refused(
    a_secret: bytes,
    c_secret: bytes | None,
) -> None:
    with pytest.raises(AuthenticationError, match="rank 0 refused the link"):
        run(acceptor(a_secret), ConnectorHandshake("g", 2, 0, 3, c_secret))


def test_acceptor_without_the_secret_is_not_trusted() -> None:
    """The connector checks the acceptor's proof too (mutual authentication)."""
    with pytest.raises(AuthenticationError, match="rank 0 failed to prove"):
        run(acceptor(None), ConnectorHandshake("g", 2, 0, 3, b"s3cret"))


def _hello(secret: bytes | None, nonce: bytes, **changes: Any) -> Msg:
    c = ConnectorHandshake("g", 2, 0, 3, secret)
    (hello,), _ = c.on_message({"t": "challenge", "v": PROTOCOL_VERSION, "nonce": nonce})
    return {**hello, **changes}


def test_a_hello_proved_for_another_nonce_is_refused() -> None:
    """Replaying a hello captured from another connection fails: the proof binds the
    acceptor's fresh nonce."""
    a = acceptor(b"s3cret")
    a.start()
    with pytest.raises(Rejection) as info:
        a.on_message(_hello(b"s3cret", b"\x00" * 32))
    assert isinstance(info.value.error, AuthenticationError)
    assert info.value.reply == {"t": "reject", "kind": "auth", "error": str(info.value.error)}


@pytest.mark.parametrize(("field", "value"), [("rank", 1), ("world", 4), ("group", "h")])
def test_the_proof_binds_ranks_world_and_group(field: str, value: Any) -> None:
    """A valid hello with one bound field changed no longer authenticates."""
    a = acceptor(b"s3cret")
    (challenge,) = a.start()
    with pytest.raises(Rejection) as info:
        a.on_message(_hello(b"s3cret", challenge["nonce"], **{field: value}))
    assert isinstance(info.value.error, AuthenticationError)


def test_the_proof_binds_the_acceptor() -> None:
    """A hello proved for rank 1 does not authenticate at rank 0."""
    a = acceptor(b"s3cret")
    (challenge,) = a.start()
    c = ConnectorHandshake("g", 2, 1, 3, b"s3cret")
    (hello,), _ = c.on_message(challenge)
    with pytest.raises(Rejection) as info:
        a.on_message(hello)
    assert isinstance(info.value.error, AuthenticationError)


@pytest.mark.parametrize(
    ("changes", "phrase"),
    [
        ({"group": "h"}, "does not match this group"),
        ({"world": 4}, "world size 4 != 3"),
        ({"peer": 1}, "meant for rank 1 reached rank 0"),
        ({"rank": 0}, "invalid peer rank 0"),
        ({"rank": 3}, "invalid peer rank 3"),
        ({"v": PROTOCOL_VERSION + 1}, "protocol version"),
    ],
)
def test_group_checks_without_a_secret(changes: Msg, phrase: str) -> None:
    a = acceptor()
    (challenge,) = a.start()
    with pytest.raises(Rejection) as info:
        a.on_message(_hello(None, challenge["nonce"], **changes))
    assert isinstance(info.value.error, RendezvousError)
    assert phrase in str(info.value.error)
    c = ConnectorHandshake("g", 2, 0, 3, None)
    with pytest.raises(RendezvousError, match="rank 0 refused the link"):
        c.on_message(info.value.reply)


def test_admit_refusal_is_sent_back() -> None:
    a = acceptor(admit=lambda peer: f"rank {peer} is already connected")
    (challenge,) = a.start()
    with pytest.raises(Rejection, match="already connected"):
        a.on_message(_hello(None, challenge["nonce"]))


@pytest.mark.parametrize(
    "msg",
    [
        {},
        {"t": "welcome"},
        {"t": "hello"},
        {"t": "hello", "nonce": b"", "mac": b""},
        {"t": "hello", "nonce": b"", "mac": b"", "rank": "1", "world": 3},
        {"t": "hello", "nonce": b"", "mac": b"", "rank": True, "world": 3},
        {"t": "hello", "nonce": b"", "mac": b"", "rank": 2, "world": [3]},
        {"t": "hello", "nonce": "not bytes", "mac": b"", "rank": 2, "world": 3},
    ],
)
def test_malformed_hello_is_a_protocol_error(msg: Msg) -> None:
    with pytest.raises(ProtocolError):
        acceptor().on_message(msg)


def test_connector_rejects_out_of_order_messages() -> None:
    c = ConnectorHandshake("g", 2, 0, 3, None)
    with pytest.raises(ProtocolError):
        c.on_message({"t": "welcome", "rank": 0, "mac": b""})  # before the challenge
    c.on_message({"t": "challenge", "v": PROTOCOL_VERSION, "nonce": b"n"})
    with pytest.raises(ProtocolError):
        c.on_message({"t": "challenge", "v": PROTOCOL_VERSION, "nonce": b"n"})  # twice


def test_connector_checks_who_answered() -> None:
    c = ConnectorHandshake("g", 2, 0, 3, None)
    c.on_message({"t": "challenge", "v": PROTOCOL_VERSION, "nonce": b"n"})
    with pytest.raises(RendezvousError, match="expected rank 0, reached 1"):
        c.on_message({"t": "welcome", "rank": 1, "mac": b""})


def test_connector_refuses_another_protocol_version() -> None:
    c = ConnectorHandshake("g", 2, 0, 3, None)
    with pytest.raises(RendezvousError, match="speaks protocol"):
        c.on_message({"t": "challenge", "v": PROTOCOL_VERSION + 1, "nonce": b"n"})


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_a_lanes_handshake_ends_with_the_connectors_attached(secret: bytes | None) -> None:
    """A lane's hello admitted: the acceptor welcomes it but knows its peer only once the
    connector says it made the connection its link's lane; anything else is refused."""
    acc = AcceptorHandshake("g", 0, 3, secret, lambda peer: "no links", admit_lane=lambda p: None)
    con = ConnectorHandshake("g", 2, 0, 3, secret, lane=True)
    hello, _ = con.on_message(_wire(acc.start()[0]))
    welcome, a_peer = acc.on_message(_wire(hello[0]))
    assert a_peer is None
    assert acc.lane
    assert con.on_message(_wire(welcome[0])) == ([], 0)
    assert acc.on_message(_wire({"t": LANE_ATTACHED})) == ([], 2)
    with pytest.raises(ProtocolError, match="attached"):
        acc.on_message(_wire({"t": "hello"}))
