"""Group: a set of ranks that run collectives together, and its sub-groups.

The class puts together the group's parts (group/core.py: sequence numbers, handles,
close and abort; group/p2p.py, collectives.py, blocks.py, objects.py: the methods) and
adds what makes groups: ``split`` into sub-groups, and the elastic generation
(``aiocollect.elastic``, which attaches its state to a world group).
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import numpy as np

from aiocollect._buffers import Array
from aiocollect.collectives import bruck
from aiocollect.engine.op import Op
from aiocollect.errors import ProtocolError, UsageError
from aiocollect.fingerprint import pack
from aiocollect.group.blocks import Blocks
from aiocollect.group.collectives import InPlace
from aiocollect.group.core import GroupCore
from aiocollect.group.objects import ObjectCollectives
from aiocollect.group.p2p import PointToPoint
from aiocollect.types import Collective

#: The root field of split's fingerprint: an object collective that is neither
#: ``allgather_object`` (-1) nor one with a root (>= 0), so that a rank calling split
#: where its peers call either gets MismatchError.
SPLIT_ROOT = -2


class Group(InPlace, Blocks, ObjectCollectives, PointToPoint):
    """A set of ranks that run collectives together. Obtain one with ``open_group``.

    Every collective method checks its arguments (raising UsageError before anything is
    sent), takes the next sequence number at call time and returns a handle to await;
    several may run at once, and ranks must call a group's collectives in the same order.

    Attributes:
        rank: this process's rank in the group.
        world_size: the number of ranks.
        name: the group's name (sub-groups: the parent's, a dot and the color).
        timeout: the default deadline of every operation in seconds, or None.
        chunk_bytes: the size of the pieces large messages are pipelined in.
        store: the store the group formed through (None for a sub-group).
    """

    #: The elastic settings (``aiocollect.elastic.generations.ElasticState``) of an elastic group.
    _elastic: Any = None

    # -- elastic groups (aiocollect.elastic) -----------------------------------------------

    def attach_elastic(self, state: Any) -> None:
        """Make this world group a generation of an elastic job (called by
        ``aiocollect.elastic``, never by users).

        Args:
            state: its ``aiocollect.elastic.generations.ElasticState``, which ``regroup`` and
                ``joiners`` delegate to.
        """
        self._elastic = state

    @property
    def generation(self) -> int:
        """How many regroups formed this group (0: the group ``open_group`` formed)."""
        root: Any = self
        while root._parent is not None:  # a sub-group belongs to its world group's
            root = root._parent
        return 0 if root._elastic is None else int(root._elastic.generation)

    async def regroup(self, *, min_size: int = 1, timeout: float | None = None) -> Group:
        """Collective of the live members of an elastic group (healthy or broken): form
        and return the next generation, of the members that call it (relative order kept)
        and the processes waiting in ``join_group`` (in arrival order). Members known dead
        are not waited for; silent ones are dropped after ``timeout``. This generation,
        its sub-groups and in-flight handles end with GroupBrokenError.

        Args:
            min_size: the fewest members the next generation may have.
            timeout: seconds to wait for the members (default: the group's).

        Returns:
            The next generation's world group.

        Raises:
            UsageError: not an elastic world group, or already regrouped.
            RendezvousError: fewer than ``min_size`` members, or this rank was left out.
            StoreError: the store failed.
        """
        if self._elastic is None:  # sub-groups have none either
            raise UsageError("regroup() needs the world group of open_group(..., elastic=True)")
        result: Group = await self._elastic.regroup(self, min_size=min_size, timeout=timeout)
        return result

    async def joiners(self) -> int:
        """How many processes wait in ``join_group`` for this elastic group (not a
        collective: reads the store).

        Returns:
            The number of processes waiting.

        Raises:
            UsageError: not an elastic group.
            StoreError: the store failed.
        """
        if self._elastic is None:
            raise UsageError("joiners() needs a group of open_group(..., elastic=True)")
        return int(await self._elastic.joiners(self))

    # -- sub-groups ------------------------------------------------------------------------

    def split(
        self, color: int | None, *, key: int = 0, timeout: float | None = None
    ) -> asyncio.Task[Group | None]:
        """Collective: ranks passing the same ``color`` form a new Group, ordered by
        ``key`` then rank. Sub-groups share this group's links, have their own sequence
        numbers, run concurrently with it and close with it.

        Args:
            color: an int in [0, 2**63) naming the sub-group, or None to opt out.
            key: an int in [-2**63, 2**63) that orders the ranks within the sub-group
                (ties: by rank).
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).

        Returns:
            A Task that gives the new sub-group, or None where ``color`` is None.

        Raises:
            UsageError: from the call: a bad color, key or timeout, or the group is
                closed.
            ProtocolError: (the handle) a peer sent a malformed color and key; the group
                is then broken everywhere.
            MismatchError: (the handle) the ranks called different collectives.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
        """
        if color is not None and (
            isinstance(color, bool) or not isinstance(color, int) or not 0 <= color < 1 << 63
        ):
            raise UsageError(f"color must be an int in [0, 2**63) or None, got {color!r}")
        if isinstance(key, bool) or not isinstance(key, int) or not -(1 << 63) <= key < 1 << 63:
            raise UsageError(f"key must be an int in [-2**63, 2**63), got {key!r}")
        split_seq = self._seq
        mine = np.array([-1 if color is None else color, key], dtype=np.int64)
        fp = pack(Collective.OBJECT, mine, count=0, root=SPLIT_ROOT)

        async def gather(o: Op) -> Array:
            return await bruck.allgather_rows(o, mine)

        task = self._start("split", fp, gather, timeout)
        root: GroupCore = self
        while root._parent is not None:
            root = root._parent

        async def make() -> Group | None:
            entries = await task
            colors = entries[:, 0]
            if (colors < -1).any():
                # a malformed color from a peer: break the group like in an op
                r = int(np.argmax(colors < -1))
                raise self._fabric.cause(
                    ProtocolError(
                        f"split (op #{split_seq}): rank {r} sent a malformed color and key"
                    )
                )
            if color is None:
                return None
            same = np.flatnonzero(colors == color)  # (in rank order: ties by rank)
            order = same[np.argsort(entries[same, 1], kind="stable")]
            ranks = [self._ranks[r] for r in order.tolist()]
            gid = zlib.crc32(f"{self._gid}/{split_seq}/{color}".encode()) or 1
            child = Group(
                self._fabric,
                gid,
                ranks,
                timeout=self.timeout,
                chunk_bytes=self.chunk_bytes,
                name=f"{self.name}.{color}",
                parent=root,
            )
            root._children.append(child)
            await child.link_neighbours(self.timeout if timeout is None else timeout)
            return child

        return asyncio.get_running_loop().create_task(make())
