"""Store records of elastic membership (see :mod:`aiocollect.elastic` for the protocol):
liveness of the processes named in them, msgpack records, counters, join-ticket proofs."""

from __future__ import annotations

import os
from typing import Any

import msgpack

from aiocollect import _auth
from aiocollect.errors import RendezvousError
from aiocollect.rendezvous.owner import Owner
from aiocollect.store.base import Store

__all__ = ["counter", "dead", "owner_at", "pack", "ticket_mac", "unpack"]


def dead(owner: Owner) -> bool:
    """Whether ``owner``'s process is certainly gone: exited, or a zombie nobody has reaped
    yet (its pid still answers a signal)."""
    if owner.alive() is not True:
        return owner.alive() is False
    try:
        with open(os.path.join("/proc", str(owner.pid), "stat"), "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def pack(value: Any) -> bytes:
    """msgpack ``value`` (bytes kept as bytes)."""
    return bytes(msgpack.packb(value, use_bin_type=True))


def unpack(raw: bytes, what: str) -> Any:
    """Raises: RendezvousError: ``raw`` (the record ``what``) is not msgpack."""
    try:
        return msgpack.unpackb(raw, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        raise RendezvousError(f"malformed elastic record {what!r} in the store") from None


async def owner_at(store: Store, key: str) -> Owner | None:
    """The owner record at ``key``, None if there is none yet.

    Raises: RendezvousError: a malformed record."""
    if not (await store.check([key]))[0]:
        return None
    return Owner.unpack(await store.get(key, timeout=0), key)


def ticket_mac(secret: bytes, name: str, t: int, owner: bytes) -> bytes:
    """The proof a joiner stores with ticket ``t`` of group ``name``: it knows ``secret``."""
    return _auth.proof(secret, b"elastic-join", name.encode(), str(t).encode(), owner)


async def counter(store: Store, key: str) -> int:
    """The store counter ``key`` (0 if missing).

    Raises: RendezvousError: not a number."""
    if not (await store.check([key]))[0]:
        return 0
    try:
        return int(await store.get(key, timeout=0))
    except ValueError:
        raise RendezvousError(f"malformed elastic counter {key!r} in the store") from None
