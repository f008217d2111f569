"""Store records of elastic membership (see :mod:`aiocollect.elastic` for the protocol):
liveness of the processes named in them, msgpack records, counters, join-ticket proofs."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import msgpack

from aiocollect import _auth
from aiocollect.errors import RendezvousError
from aiocollect.rendezvous.owner import Owner
from aiocollect.store.base import Store

__all__ = [
    "counter",
    "dead",
    "dead_among",
    "owner_at",
    "owners_at",
    "pack",
    "ticket_mac",
    "unpack",
]

#: Seconds to read owner records found present (:func:`owners_at`): they exist, so this
#: only bounds a slow store (a store loaded by hundreds of regrouping ranks took over
#: the 2 s a read of one such record was given).
OWNER_READ = 10.0
#: Seconds a process's death check (:func:`dead_among`) is reused by the other ranks of
#: this process that ask.
DEAD_FRESH = 0.05
_looked: dict[Owner, tuple[float, bool]] = {}


def dead(owner: Owner) -> bool:
    """Whether ``owner``'s process is certainly gone: exited, or a zombie nobody has reaped
    yet (its pid still answers a signal)."""
    alive = owner.alive()
    if alive is not True:
        return alive is False
    try:
        with open(os.path.join("/proc", str(owner.pid), "stat"), "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def dead_among(owners: Mapping[str, Owner]) -> list[str]:
    """The keys of ``owners`` whose process is certainly gone (:func:`dead`), each process
    looked at once however many of the members it hosts, and at most once per
    ``DEAD_FRESH`` seconds in this process however many of its ranks ask (many ranks per
    process each watch every other member while a generation forms)."""
    now = time.monotonic()
    gone = set()
    for owner in set(owners.values()):
        seen = _looked.get(owner)
        if seen is None or now - seen[0] > DEAD_FRESH:
            if len(_looked) > 4096:
                _looked.clear()
            seen = _looked[owner] = (now, dead(owner))
        if seen[1]:
            gone.add(owner)
    return [i for i, owner in owners.items() if owner in gone]


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


async def owners_at(store: Store, keys: Mapping[str, str]) -> dict[str, Owner]:
    """The owner records at ``keys`` (member -> key) that exist now, by member: two
    store requests however many members (one per member made a regroup of hundreds of
    ranks a quadratic number of requests).

    Raises: RendezvousError: a malformed record. StoreError: the store failed."""
    members = list(keys)
    present = await store.check([keys[i] for i in members])
    found = [i for i, ok in zip(members, present, strict=True) if ok]
    if not found:
        return {}
    raws = await store.multi_get([keys[i] for i in found], timeout=OWNER_READ)
    return {i: Owner.unpack(raw, keys[i]) for i, raw in zip(found, raws, strict=True)}


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
