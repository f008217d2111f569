"""Python values as collectives: a group's ``broadcast_object``, ``allgather_object`` and
``gather_object``.

A value is serialised on the calling rank (``aiocollect.objects``: exactly, without
pickle unless ``allow_pickle``), so a value that cannot travel raises UsageError from the
call, before anything is sent; the bytes travel as variable-size collectives
(collectives/objects.py) and are decoded on the receiving ranks.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from aiocollect import objects
from aiocollect.collectives import objects as object_collectives
from aiocollect.collectives.checks import check_rank
from aiocollect.engine.op import Op
from aiocollect.fingerprint import pack
from aiocollect.group.core import GroupCore
from aiocollect.types import Collective


class ObjectCollectives(GroupCore):
    """The object collectives of :class:`~aiocollect.Group`."""

    def broadcast_object(
        self,
        obj: Any = None,
        *,
        root: int = 0,
        allow_pickle: bool = False,
        timeout: float | None = None,
    ) -> asyncio.Task[Any]:
        """Send ``root``'s value to every rank; every rank gets an equal value of the same
        types (see :mod:`aiocollect.objects` for what travels without pickle).

        Args:
            obj: the value (read on the root only).
            root: the sending group rank.
            allow_pickle: whether values that cannot travel exactly otherwise may be
                pickled (the same on every rank: unpickling runs the sender's code).
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).

        Returns:
            A Task that gives the value on every rank.

        Raises:
            UsageError: from the call, before anything is sent: a bad root or timeout, a
                closed group, or on the root a value that cannot travel exactly without
                pickle (and ``allow_pickle`` is False) or is larger than
                ``objects.MAX_OBJECT_BYTES`` serialised.
            ProtocolError: (the handle, on a receiving rank) the bytes that arrived are not
                a value a real rank could have sent; the group is then broken everywhere.
            MismatchError: (the handle) the ranks called different collectives.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
        """
        root = check_rank(root, self.world_size, "root")
        payload = objects.dumps(obj, allow_pickle) if self.rank == root else b""
        fp = pack(Collective.OBJECT, None, count=0, root=root)

        async def body(o: Op) -> Any:
            return await object_collectives.broadcast(o, obj, payload, root, allow_pickle)

        return self._start("broadcast_object", fp, body, timeout)

    def allgather_object(
        self, obj: Any, *, allow_pickle: bool = False, timeout: float | None = None
    ) -> asyncio.Task[list[Any]]:
        """Every rank's value, in rank order, on every rank (each an equal value of the
        same types as the one sent).

        Args:
            obj: this rank's value.
            allow_pickle: as for :meth:`broadcast_object`.
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).

        Returns:
            A Task that gives the list of values, one per rank.

        Raises:
            UsageError: from the call, before anything is sent (see broadcast_object).
            ProtocolError: (the handle) a rank's bytes are not a value a real rank could
                have sent; the group is then broken everywhere.
            MismatchError: (the handle) the ranks called different collectives.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
        """
        return self._objects("allgather_object", obj, None, allow_pickle, timeout)

    def gather_object(
        self, obj: Any, *, root: int = 0, allow_pickle: bool = False, timeout: float | None = None
    ) -> asyncio.Task[list[Any] | None]:
        """Every rank's value, in rank order, on ``root`` (None elsewhere).

        Args:
            obj: this rank's value.
            root: the group rank that gets the values.
            allow_pickle: as for :meth:`broadcast_object`.
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).

        Returns:
            A Task that gives the list of values on ``root``, None elsewhere.

        Raises:
            UsageError: from the call, before anything is sent (see broadcast_object).
            ProtocolError: (the handle, on the root, which decodes) a rank's bytes are not
                a value a real rank could have sent; the group is then broken everywhere.
            MismatchError: (the handle) the ranks called different collectives.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
        """
        root = check_rank(root, self.world_size, "root")
        return self._objects("gather_object", obj, root, allow_pickle, timeout)

    def _objects(
        self, kind: str, obj: Any, root: int | None, allow_pickle: bool, timeout: float | None
    ) -> asyncio.Task[Any]:
        """Serialise ``obj`` and start the gather of every rank's value, decoded on every
        rank (``root`` None) or on ``root`` only."""
        payload = np.frombuffer(objects.dumps(obj, allow_pickle), np.uint8)
        fp = pack(Collective.OBJECT, payload, count=0, root=-1 if root is None else root)

        async def body(o: Op) -> list[Any] | None:
            return await object_collectives.gather(o, payload, kind, root, allow_pickle)

        return self._start(kind, fp, body, timeout)
