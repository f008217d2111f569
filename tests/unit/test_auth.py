"""HMAC challenge-response primitives shared by store connections and peer links."""

from __future__ import annotations

import pytest

from aiocollect import _auth


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        (b"", None),
        ("s", b"s"),
        (b"s", b"s"),
        ("é", "é".encode()),
        (bytearray(b"x"), b"x"),
    ],
)
def test_as_secret(value: object, expected: bytes | None) -> None:
    assert _auth.as_secret(value) == expected  # type: ignore[arg-type]


def test_nonces_are_fresh() -> None:
    nonces = {_auth.new_nonce() for _ in range(100)}
    assert len(nonces) == 100
    assert all(len(n) == _auth.NONCE_BYTES for n in nonces)


def test_proof_checks_and_binds_everything() -> None:
    a, b = _auth.new_nonce(), _auth.new_nonce()
    mac = _auth.proof(b"k", b"connector", a, b, b"ctx")
    assert _auth.check(b"k", mac, b"connector", a, b, b"ctx")
    for args in [
        (b"other", b"connector", a, b, b"ctx"),  # secret
        (b"k", b"acceptor", a, b, b"ctx"),  # role: no reflection
        (b"k", b"connector", b, a, b"ctx"),  # nonce order
        (b"k", b"connector", a, b, b"ctx2"),
    ]:  # context
        assert not _auth.check(args[0], mac, *args[1:])
    assert not _auth.check(b"k", mac[:-1], b"connector", a, b, b"ctx")
