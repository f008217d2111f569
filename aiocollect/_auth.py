"""HMAC challenge-response primitives shared by store connections and peer links.

Each side sends a random nonce; each proves knowledge of the secret by returning
``HMAC-SHA256(secret, role || own_nonce || peer_nonce || context)``. Roles differ, so a
proof cannot be reflected back to its sender.
"""

from __future__ import annotations

import hashlib
import hmac
import os

NONCE_BYTES = 32


def as_secret(secret: bytes | str | None) -> bytes | None:
    """Normalise a user secret (``str`` is UTF-8 encoded; empty means none)."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    return bytes(secret) or None


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(
    secret: bytes, role: bytes, nonce_a: bytes, nonce_b: bytes, context: bytes = b""
) -> bytes:
    """The MAC a party with ``role`` sends, binding both nonces and the context."""
    msg = b"%d:%s|%s|%s|%s" % (len(role), role, nonce_a, nonce_b, context)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def check(
    secret: bytes, mac: bytes, role: bytes, nonce_a: bytes, nonce_b: bytes, context: bytes = b""
) -> bool:
    """Constant-time check of a peer's proof."""
    return hmac.compare_digest(mac, proof(secret, role, nonce_a, nonce_b, context))
