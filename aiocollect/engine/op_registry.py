"""OpRegistry: the operations this rank called, by (group id, sequence number).

Every operation a group starts is registered with its fingerprint until it ends, then
remembered among the last ``DONE_MEMORY`` finished. The fabric checks each incoming
frame's fingerprint against it (frames that come before this rank's call wait in
:attr:`OpRegistry.early`); the liveness probe answers a peer's "have you called it?" from
it, and the close handshake compares a digest of it per group with every peer's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from aiocollect.errors import AiocollectError, GroupBrokenError, MismatchError
from aiocollect.fingerprint import describe as describe_fingerprint
from aiocollect.transport.base import Fingerprint, Link
from aiocollect.transport.wire import WORLD_GID

#: A GOODBYE's digests by group id: (operations called, digest, the last few as
#: [seq, *fingerprint]) (engine/closing.py).
Digests = dict[int, tuple[int, int, list[Any]]]

#: Fingerprints of finished operations kept (a peer that disagrees may only send after
#: this rank finished, e.g. when this rank's operation had nothing to receive).
DONE_MEMORY = 4096


class OpRegistry:
    """This rank's (``rank``) operations; a mismatch found on :meth:`register` is passed
    to ``fail`` (the fabric's)."""

    def __init__(self, rank: int, fail: Callable[[BaseException], None]) -> None:
        self.rank = rank
        self._fail = fail
        #: (gid, seq) -> fingerprint of the operations in flight
        self.active: dict[tuple[int, int], Fingerprint] = {}
        #: gid -> the highest sequence number this rank called
        self.started: dict[int, int] = {}
        #: (gid, seq) -> {peer: fingerprint} of frames that came before this rank's call:
        #: one entry per peer however many frames it sends (every frame of an op carries
        #: its fingerprint), counted in the link's staging cap
        #: (transport.mailbox.STAGED_FRAME_COST)
        self.early: dict[tuple[int, int], dict[int, Fingerprint]] = {}
        #: running digest of the fingerprints registered per group, in sequence order: the
        #: close handshake compares them (a mismatch no frame revealed)
        self.digests: dict[int, int] = {}
        #: (gid, seq) -> fingerprint of the last ``DONE_MEMORY`` finished operations
        self.done: OrderedDict[tuple[int, int], Fingerprint] = OrderedDict()
        #: peer -> the digest of its GOODBYE, for the peers that closed the group
        self.closed: dict[int, Digests] = {}

    def register(self, gid: int, seq: int, fp: Fingerprint, ranks: list[int]) -> None:
        """Record this rank's operation at (gid, seq) and check frames that came early
        (one that disagrees breaks the fabric with a MismatchError).

        Args:
            gid: the group's id.
            seq: the operation's sequence number in that group.
            fp: its fingerprint.
            ranks: the group's world ranks (to name a peer by its group rank).
        """
        self.active[(gid, seq)] = fp
        if seq > self.started.get(gid, -1):
            self.started[gid] = seq
        self.digests[gid] = hash((self.digests.get(gid, 0), fp))
        if self.closed:  # a peer closed already: its digest may show this call is wrong
            for closer, digests in self.closed.items():
                err = self._contradicts(closer, digests, gid, seq, fp)
                if err is not None:
                    self._fail(err)
                    return
        early = self.early.pop((gid, seq), None) if self.early else None
        if early is None:
            return
        for peer, theirs in early.items():
            if theirs != fp:
                self._fail(self.mismatch(gid, seq, fp, peer, theirs, ranks))
                return

    def closed_by(self, link: Link) -> AiocollectError:
        """The error for this rank's operations still waiting on ``link`` once its peer
        closed cleanly. The peer's GOODBYE carries the digest of the operations it called
        (:attr:`Link.goodbye_digests`): where it shows that the peer called one of them
        differently, or never called it (it closed after fewer operations), the
        MismatchError naming both calls; else a GroupBrokenError saying the peer closed
        the group. The digest is kept: an operation this rank registers later is checked
        against it too (:meth:`register`).

        Args:
            link: the link whose peer said goodbye.

        Returns:
            The error to fail what still waits on that link with.
        """
        theirs = link.goodbye_digests
        if theirs is not None:
            self.closed[link.peer] = theirs
            for (gid, seq), mine in sorted(self.active.items()):
                err = self._contradicts(link.peer, theirs, gid, seq, mine)
                if err is not None:
                    return err
        return GroupBrokenError(f"rank {link.peer} closed the group")

    def _contradicts(
        self, peer: int, theirs: Digests, gid: int, seq: int, mine: Fingerprint
    ) -> MismatchError | None:
        """The MismatchError if ``peer``'s GOODBYE digest shows that it called operation
        ``seq`` of group ``gid`` otherwise than ``mine``, or never called it."""
        if gid not in theirs and gid != WORLD_GID:
            return None  # a sub-group the peer never used (or is not a member of)
        count, _digest, recent = theirs.get(gid, (0, 0, []))
        where = "" if gid == WORLD_GID else f" of sub-group {gid:#x}"
        if seq >= count:
            return MismatchError(
                f"operation #{seq}{where}: rank {self.rank} called "
                f"{describe_fingerprint(mine)} but rank {peer} closed the group after "
                f"calling {count} collective operations (it never called this one)"
            )
        for entry in recent:
            try:
                their_seq, their_fp = int(entry[0]), tuple(int(x) for x in entry[1:6])
            except (TypeError, ValueError, IndexError):
                continue
            if their_seq == seq and len(their_fp) == 5 and their_fp != mine:
                return MismatchError(
                    f"operation #{seq}{where}: rank {self.rank} called "
                    f"{describe_fingerprint(mine)} but rank {peer} called "
                    f"{describe_fingerprint(their_fp)} (found when rank {peer} closed the "
                    "group)"
                )
        return None

    def unregister(self, gid: int, seq: int) -> None:
        """The operation at (gid, seq) ended: remember its fingerprint among the last
        ``DONE_MEMORY`` finished.

        Args:
            gid: the group's id.
            seq: the operation's sequence number.
        """
        fp = self.active.pop((gid, seq), None)
        if fp is not None:
            # Remember recent fingerprints: a peer that disagrees may only send after this
            # rank finished (e.g. this rank's op had nothing to receive).
            self.done[(gid, seq)] = fp
            if len(self.done) > DONE_MEMORY:
                self.done.popitem(last=False)

    def fingerprint(self, gid: int, seq: int) -> Fingerprint | None:
        """This rank's fingerprint of operation ``seq`` of group ``gid``, if it is in
        flight or among the last ``DONE_MEMORY`` finished."""
        key = (gid, seq)
        return self.active.get(key) or self.done.get(key)

    def mismatch(
        self,
        gid: int,
        seq: int,
        mine: Fingerprint,
        peer: int,
        theirs: Fingerprint,
        ranks: list[int] | None = None,
    ) -> MismatchError:
        """The MismatchError of this rank's ``mine`` against ``peer``'s ``theirs`` at
        (gid, seq), naming the peer by its group rank where ``ranks`` holds it."""
        grank = ranks.index(peer) if ranks and peer in ranks else peer
        where = "" if gid == WORLD_GID else f" of sub-group {gid:#x}"
        return MismatchError(
            f"operation #{seq}{where}: rank {self.rank} called {describe_fingerprint(mine)} "
            f"but rank {grank} called {describe_fingerprint(theirs)}"
        )

    def check_fingerprints(
        self, gid: int, seq: int, fps: dict[int, Fingerprint], ranks: list[int]
    ) -> MismatchError | None:
        """The MismatchError naming this rank's operation ``seq`` and the first peer (world
        rank) in ``fps`` that called another one, if any."""
        mine = self.fingerprint(gid, seq)
        if mine is None:
            return None
        for peer in sorted(fps):
            if fps[peer] != mine:
                return self.mismatch(gid, seq, mine, peer, fps[peer], ranks)
        return None

    def forget(self) -> None:
        """Drop what only a healthy group needs (the fabric broke: a flood of early frames
        leaves no trace)."""
        self.early.clear()
        self.done.clear()
