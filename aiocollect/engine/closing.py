"""Closing out: the close handshake, the links' end, and what ABORT and GOODBYE carry.

A group that closes cleanly says GOODBYE to every peer with a digest of the operations
it called per group (:meth:`Closer.goodbye`), waits for theirs and compares
(:meth:`Closer.farewell`: a difference is a mismatch no frame revealed), closes its links
and waits for them to end (:meth:`Closer.links_gone`), resetting what is left. A group
that breaks tells its peers why in an ABORT frame (:func:`encode_abort`, rebuilt by
:func:`decode_abort`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import msgpack

from aiocollect import errors
from aiocollect.errors import GroupBrokenError, MismatchError, ProtocolError
from aiocollect.fingerprint import describe as describe_fingerprint
from aiocollect.transport.wire import GOODBYE, WORLD_GID, control_header

if TYPE_CHECKING:
    from aiocollect.engine.fabric import Fabric

#: Fingerprints of the last operations per group a GOODBYE carries (to name the operation
#: when the close handshake finds that ranks disagreed).
GOODBYE_RECENT = 16


class Closer:
    """The close handshake and the links' end of ``fabric``."""

    def __init__(self, fabric: Fabric) -> None:
        self._fabric = fabric
        self._registry = fabric.registry
        self._waiters: list[asyncio.Future[None]] = []

    def goodbye(self) -> None:
        """Tell every peer this rank closes cleanly: a GOODBYE carrying the digest of the
        operations this rank called (links stay open: see :meth:`farewell`)."""
        self._fabric.closing = True
        payload = self.goodbye_payload()
        for link in list(self._fabric.links.values()):
            if not link.closed:
                with contextlib.suppress(errors.AiocollectError):
                    link.send(control_header(GOODBYE, len(payload)), payload)

    async def farewell(self, timeout: float) -> MismatchError | None:
        """After :meth:`goodbye`: wait up to ``timeout`` seconds until every peer said
        goodbye too, disconnected, or the fabric broke (an ABORT), then compare the peers'
        digests with this rank's. Returns the MismatchError if two ranks called different
        operations (the caller breaks the fabric with it), else None; peers still silent
        at the timeout are not compared (they compare ours when they close)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self._fabric.failure is None and not all(
            link.goodbye_received or link.closed for link in self._fabric.links.values()
        ):
            left = end - loop.time()
            if left <= 0:
                break
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except TimeoutError:
                break
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
        if self._fabric.failure is not None:
            return None
        for peer, link in sorted(self._fabric.links.items()):
            theirs = link.goodbye_digests
            if theirs is not None:
                err = self.compare_digests(peer, theirs)
                if err is not None:
                    return err
        return None

    def close_links(self) -> None:
        """Close every link gracefully (flush, half-close), and end the bulk worker."""
        self._fabric.closing = True
        if self._fabric.bulk is not None:
            self._fabric.bulk.close()
        self._fabric.liveness.cancel_exit_waits()
        for link in list(self._fabric.links.values()):
            link.close()
        self.release()

    async def links_gone(self, timeout: float, grace: float) -> None:
        """After :meth:`close_links`: wait for every link to end, then reset those that
        have not, so that no connection outlives the group's close (an event loop closed
        right after would find them open: uvloop then refuses to close, EBUSY, where
        warnings are errors, and asyncio warns of unclosed transports). A peer that said
        goodbye closes its end as soon as it reads ours, so this waits up to ``timeout``
        when every peer did and ``grace`` otherwise (after a failure, or a peer gone or
        still silent: time for what was flushed, an ABORT above all, to be read)."""
        links = list(self._fabric.links.values())
        if not links:
            return
        said = self._fabric.failure is None and all(link.goodbye_received for link in links)
        waits = [asyncio.ensure_future(link.wait_closed()) for link in links]
        try:
            await asyncio.wait(waits, timeout=max(0.0, timeout if said else min(grace, timeout)))
        finally:
            for link, waiting in zip(links, waits, strict=True):
                if not waiting.done():
                    waiting.cancel()
                    link.abort()

    def wake(self) -> None:
        """Wake :meth:`farewell` to look again (a GOODBYE came, a link ended, the fabric
        broke)."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def goodbye_payload(self) -> bytes:
        """This rank's GOODBYE: per group, the operations called, their digest and the
        fingerprints of the last ``GOODBYE_RECENT`` finished."""
        recent: dict[int, list[list[int]]] = {}
        for gid, seq in reversed(self._registry.done):
            entries = recent.setdefault(gid, [])
            if len(entries) < GOODBYE_RECENT:
                entries.append([seq, *self._registry.done[(gid, seq)]])
        groups = {
            gid: [self._registry.started[gid] + 1, digest, recent.get(gid, [])]
            for gid, digest in self._registry.digests.items()
        }
        return bytes(msgpack.packb(groups, use_bin_type=True))

    def compare_digests(
        self, peer: int, theirs: dict[int, tuple[int, int, list[Any]]]
    ) -> MismatchError | None:
        """The MismatchError if ``peer``'s GOODBYE shows other operations than this rank
        called, in a group both are members of (the world group, and sub-groups both have
        used)."""
        for gid in sorted(set(theirs) | {0}):
            if gid not in self._registry.digests and gid != 0:
                continue
            count, digest, recent = theirs.get(gid, (0, 0, []))
            mine_count = self._registry.started.get(gid, -1) + 1
            if (count, digest) == (mine_count, self._registry.digests.get(gid, 0)):
                continue
            where = "" if gid == WORLD_GID else f" of sub-group {gid:#x}"
            for entry in recent:
                try:
                    seq, theirs_fp = int(entry[0]), tuple(int(x) for x in entry[1:6])
                except (TypeError, ValueError, IndexError):
                    continue
                mine = self._registry.done.get((gid, seq))
                if mine is not None and len(theirs_fp) == 5 and mine != theirs_fp:
                    return MismatchError(
                        f"operation #{seq}{where}: rank {self._registry.rank} called "
                        f"{describe_fingerprint(mine)} but rank {peer} called "
                        f"{describe_fingerprint(theirs_fp)}"
                        " (found when the group closed)"
                    )
            if count != mine_count:
                return MismatchError(
                    f"the group closed{where} after rank {self._registry.rank} called {mine_count} "
                    f"collective operations but rank {peer} called {count}"
                )
            return MismatchError(
                f"the group closed{where} after {count} collective operations, but ranks "
                f"{self._registry.rank} and {peer} called different ones (the operation is "
                f"older than the last {GOODBYE_RECENT} each remembers)"
            )
        return None

    def abort_links(self) -> None:
        """Reset every link now (nothing flushed)."""
        self._fabric.closing = True
        self._fabric.liveness.cancel_exit_waits()
        for link in list(self._fabric.links.values()):
            link.abort()
        self.release()

    def release(self) -> None:
        """Close what the algorithms keep for the fabric's life (``Fabric.resources``)."""
        resources = list(self._fabric.resources.values())
        self._fabric.resources.clear()
        for resource in resources:
            resource.close()


_ABORT_CLASSES: dict[str, type[errors.AiocollectError]] = {
    "MismatchError": errors.MismatchError,
    "PeerTimeout": errors.PeerTimeout,
    "PeerDisconnected": errors.PeerDisconnected,
    "ProtocolError": errors.GroupBrokenError,
}


def decode_goodbye(payload: bytes) -> dict[int, tuple[int, int, list[Any]]] | None:
    """A GOODBYE's digests by group id (None if it carries none or is malformed: the
    close then compares nothing with that peer)."""
    if not payload:
        return None
    try:
        groups = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        return {int(gid): (int(v[0]), int(v[1]), list(v[2])) for gid, v in groups.items()}
    except Exception:
        return None


def encode_abort(rank: int, exc: BaseException) -> bytes:
    relayed = getattr(exc, "abort_info", None)
    if isinstance(relayed, dict):
        return bytes(msgpack.packb(relayed, use_bin_type=True))
    info: dict[str, Any] = {"rank": rank, "type": type(exc).__name__, "message": str(exc)}
    if getattr(exc, "raised", None):
        info["raised"] = True  # the message names the user's exception: relay it as is
    if isinstance(exc, errors.PeerTimeout):
        info["ranks"] = list(exc.ranks)
    elif isinstance(exc, errors.PeerError) and exc.rank is not None:
        info["ranks"] = [exc.rank]
    return bytes(msgpack.packb(info, use_bin_type=True))


def decode_abort(peer: int, payload: bytes) -> BaseException:
    """Rebuild the failure a peer reported in its ABORT frame."""
    try:
        info = msgpack.unpackb(payload, raw=False)
        kind, message = str(info["type"]), str(info["message"])
        origin = int(info["rank"])
        ranks = [int(r) for r in info.get("ranks", [])]
    except Exception:
        return ProtocolError(f"rank {peer} sent a malformed ABORT frame")
    text = (
        message
        if info.get("raised") is True and message.startswith(f"rank {origin} ")
        else f"rank {origin} aborted the group: {message}"
    )
    cls = _ABORT_CLASSES.get(kind, GroupBrokenError)
    exc: errors.AiocollectError
    if cls is errors.PeerTimeout:
        exc = errors.PeerTimeout(text, ranks)
    elif cls is errors.PeerDisconnected:
        exc = errors.PeerDisconnected(text, ranks[0] if ranks else origin)
    else:
        exc = cls(text)
    exc.abort_info = info  # type: ignore[attr-defined]
    return exc
