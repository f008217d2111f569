"""Point to point: a group's ``send`` and ``recv``.

Messages are matched by (source, tag) in order: each side counts its messages per peer
and tag, and the n-th ``send`` to a rank with a tag meets that rank's n-th ``recv`` from
this one with that tag. A message of one frame runs as a one-frame operation
(engine/small.py), a larger one as a Task sending it in chunks.
"""

from __future__ import annotations

import asyncio

from aiocollect._buffers import Array, Buffer, as_array
from aiocollect.collectives.checks import check_rank, check_tag
from aiocollect.collectives.plan import Plan
from aiocollect.engine.op import Op
from aiocollect.engine.small import Small
from aiocollect.errors import UsageError
from aiocollect.fingerprint import Fingerprint
from aiocollect.group.core import GroupCore
from aiocollect.transport.wire import P2P, Key


def _flat(arr: Array) -> Array:
    return arr.reshape(-1)


class PointToPoint(GroupCore):
    """``send`` and ``recv`` of :class:`~aiocollect.Group`."""

    def send(
        self, buf: Buffer, dst: int, *, tag: int = 0, timeout: float | None = None
    ) -> asyncio.Future[None]:
        """Send ``buf`` to rank ``dst``; messages are matched by (source, tag) in order.

        Args:
            buf: the message (any contiguous buffer; not written).
            dst: the receiving group rank (not this one).
            tag: a non-negative int below 2**63 the receiver matches on.
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).

        Returns:
            A handle (an ``asyncio.Future``) that completes with None once the message
            has left ``buf`` and the receiver took it.

        Raises:
            UsageError: from the call: a bad buffer, ``dst`` out of range or this rank,
                a bad tag or timeout, or the group is closed.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) the peer's connection was lost.
        """
        arr = as_array(buf, "buf", writable=False)
        dst = check_rank(dst, self.world_size, "dst")
        if dst == self.rank:
            raise UsageError("send to self: dst must differ from this rank")
        tag = check_tag(tag)
        fp, small = self._p2p_plan("send", arr, dst, -1, tag)
        counter = self._next_send(dst, tag)
        if small is not None:
            return self._quick(small, _flat(arr), None, None, timeout, counter)

        async def body(op: Op) -> None:
            await self._link_peer(dst, timeout)
            for c, part in enumerate(op.chunks(_flat(arr)) or [_flat(arr)]):
                await op.send(dst, tag, c, part)

        return self._start("send", fp, body, timeout, p2p=(counter, tag))

    def recv(
        self, buf: Buffer, src: int | None = None, *, tag: int = 0, timeout: float | None = None
    ) -> asyncio.Future[int]:
        """Receive into ``buf`` from ``src`` (None: any rank).

        Args:
            buf: a writable buffer of the message's dtype and size.
            src: the sending group rank (not this one), or None for the first message
                with ``tag`` from any rank.
            tag: the tag the sender used.
            timeout: seconds before the handle fails with PeerTimeout (default: the
                group's).

        Returns:
            A handle (an ``asyncio.Future``) that completes with the source's group rank
            once ``buf`` holds the message.

        Raises:
            UsageError: from the call: a bad buffer, ``src`` out of range or this rank,
                a group of one rank, a bad tag or timeout, or the group is closed.
            MismatchError: (the handle) the message has another dtype or size.
            GroupBrokenError: from the call or the handle: the group is broken.
            PeerTimeout: (the handle) no progress before the deadline.
            PeerDisconnected: (the handle) the peer's connection was lost.
        """
        arr = as_array(buf, "buf", writable=True)
        if src is not None:
            src = check_rank(src, self.world_size, "src")
            if src == self.rank:
                raise UsageError("recv from self: src must differ from this rank")
        if self.world_size == 1:
            raise UsageError("recv in a group of one rank can never complete")
        tag = check_tag(tag)
        if src is not None:
            fp, small = self._p2p_plan("recv", arr, -1, src, tag)
            counter = self._next_recv(src, tag)
            if small is not None:
                return self._quick(small, _flat(arr), None, src, timeout, counter)
        else:
            fp, counter = self._p2p_fingerprint(arr), -1

        async def body(op: Op) -> int:
            if src is not None:
                await self._link_peer(src, timeout)
            source, seq = (src, counter) if src is not None else await self._match_any(tag)
            for c, part in enumerate(op.chunks(_flat(arr)) or [_flat(arr)]):
                op.recv(source, tag, c, part, expect=fp, seq=seq)
            return source

        return self._start("recv", fp, body, timeout, p2p=(max(counter, 0), tag))

    def _p2p_plan(
        self, kind: str, arr: Array, dst: int, src: int, tag: int
    ) -> tuple[Fingerprint, Small | None]:
        """send's or recv's plan for ``arr`` (fingerprint, and one-frame program to
        ``dst`` or from ``src`` for a message of one frame), remembered per (dtype, size,
        peer, tag)."""
        key = (kind, arr.dtype, arr.size, dst, src, tag)
        plan = self._plan(key)
        if plan is None:
            plan = self._planner.p2p(kind, arr, dst, src, tag)
            if plan.small is not None or arr.nbytes > self.chunk_bytes:
                self._remember(key, plan)  # (else planned again once the link is made)
        return plan.fp, plan.small

    async def _link_peer(self, peer: int, timeout: float | None) -> None:
        """Make the link to group rank ``peer`` if it does not exist yet.

        Raises:
            PeerTimeout: not linked within ``timeout`` seconds (default: the group's).
            PeerDisconnected: the peer could not be reached.
        """
        world = self._ranks[peer]
        if world not in self._fabric.links:
            await self._fabric.ensure((world,), self.timeout if timeout is None else timeout)

    def _p2p_fingerprint(self, arr: Array) -> Fingerprint:
        """send's and recv's fingerprint of ``arr``, remembered per (dtype, size)."""
        key = ("p2p", arr.dtype, arr.size)
        plan = self._plan(key)
        if plan is None:
            plan = self._remember(key, Plan(self._planner.p2p_fingerprint(arr), None))
        return plan.fp

    async def _match_any(self, tag: int) -> tuple[int, int]:
        """Claim the first pending message with ``tag`` from any rank."""
        fabric = self._fabric
        while True:
            for peer in range(self.world_size):
                if peer == self.rank:
                    continue
                seq = self._recv_counters[(peer, tag)]
                link = fabric.links.get(self._ranks[peer])  # (None: not linked yet)
                if link is not None and link.has_frame(Key(P2P, self._gid, seq, tag, 0)):
                    return peer, self._next_recv(peer, tag)
            await fabric.p2p_arrival()
