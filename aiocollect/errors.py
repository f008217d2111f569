"""The aiocollect exception tree.

Every error raised by aiocollect derives from :class:`AiocollectError`. Each class's docstring
says who caused it and what the caller can do about it.
"""

from __future__ import annotations

from collections.abc import Iterable


class AiocollectError(Exception):
    """Base of every error raised by aiocollect."""


class UsageError(AiocollectError, ValueError):
    """This rank passed a bad argument (rank, root, shape, dtype, op, buffer) or used a
    closed group. Raised synchronously by the call, before any byte is sent and before a
    sequence number is taken, so the group stays usable. Fix the call."""


class MismatchError(AiocollectError):
    """Ranks called different collectives, or the same one with different sizes, dtypes,
    ops or roots, at the same sequence number. Raised on every rank involved; the group is
    broken afterwards. Fix the program so every rank issues the same sequence of calls."""


class PeerError(AiocollectError):
    """A peer failed. ``rank`` is the failing peer's rank in the group (or None when
    unknown). The group is broken; open a new one to continue.

    Args:
        message: what happened, naming the peer.
        rank: the failing peer's rank in the group, or None when unknown.
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class PeerDisconnected(PeerError):
    """A peer's link closed or was reset while the group was in use (the process died,
    the network dropped it, or it aborted)."""


class PeerTimeout(PeerError, TimeoutError):
    """No progress before the deadline. ``ranks`` lists the peers that were not heard from
    (``rank`` is the first of them). Either a peer is frozen or slow, or ranks did not call
    the same collectives; raise ``timeout=`` if the work is legitimately slow.

    Args:
        message: what timed out.
        ranks: the peers not heard from (kept sorted, without repeats).
    """

    def __init__(self, message: str, ranks: Iterable[int] = ()) -> None:
        ranks = sorted(set(ranks))
        super().__init__(message, ranks[0] if ranks else None)
        self.ranks = ranks


class GroupBrokenError(AiocollectError):
    """The group can no longer be used because of an earlier failure, a cancellation with
    data in flight, or ``abort()``. ``__cause__`` holds the first failure. Open a new group
    (with a new name) on the same store to continue."""


class RendezvousError(AiocollectError):
    """The group could not form (bad handshake, inconsistent world sizes, ...)."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """Not every rank arrived before the rendezvous deadline. ``missing`` lists the ranks
    that never arrived: check that they were started with the same store and group name.

    Args:
        message: what timed out.
        missing: the ranks that never arrived (kept sorted, without repeats).
    """

    def __init__(self, message: str, missing: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.missing = sorted(set(missing))


class AuthenticationError(AiocollectError):
    """A secret was required and the other side did not prove it (or we could not prove
    ours). Check that every rank and the store share the same ``secret``."""


class StoreError(AiocollectError):
    """The store backend failed (connection refused or lost, I/O error, bad URL)."""


class StoreTimeout(StoreError, TimeoutError):
    """A key did not appear in the store before the deadline. ``keys`` lists the missing
    keys.

    Args:
        message: what timed out.
        keys: the keys that did not appear.
    """

    def __init__(self, message: str, keys: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.keys = list(keys)


class ProtocolError(AiocollectError):
    """Malformed or unexpected bytes arrived from the network. The offending link is closed;
    if it belonged to a group, the group is broken."""


class InternalError(AiocollectError):
    """An exception that is not an aiocollect error escaped an operation: a bug in
    aiocollect (or the process ran out of memory). ``__cause__`` is the original. The group
    is broken on every rank, as after any failure (the peers get GroupBrokenError); please
    report it with the traceback."""


__all__ = [
    "AiocollectError",
    "AuthenticationError",
    "GroupBrokenError",
    "InternalError",
    "MismatchError",
    "PeerDisconnected",
    "PeerError",
    "PeerTimeout",
    "ProtocolError",
    "RendezvousError",
    "RendezvousTimeout",
    "StoreError",
    "StoreTimeout",
    "UsageError",
]
