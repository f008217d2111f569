"""One phase of a composed operation: the operation seen by a subset of its ranks.

A two-level collective runs whole algorithms (ring, tree, recursive doubling) over parts
of its group: the ranks of one host, one leader per host. A :class:`Phase` is an
:class:`~aiocollect.engine.op.Op` over such a subset, addressed by its own ranks (0 to
``len(members) - 1``), whose frames carry the operation's sequence number and fingerprint
in a slot range of their own (``base`` added to every slot the algorithm uses), and whose
receives and sends count as the whole operation's: ``finish``, the deadline's silent
peers, cancellation and ``moved_data`` of the operation see them all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiocollect._buffers import Array
from aiocollect.engine.op import Op
from aiocollect.transport.base import Fingerprint

#: Bits of a frame's slot below a phase's base: the slots one algorithm may use.
PHASE_SHIFT = 32


class Phase(Op):
    """``parent`` over its group ranks ``members`` (this rank among them), its slots
    offset by ``base`` (a multiple of ``1 << PHASE_SHIFT``, different per phase that
    shares a pair of ranks)."""

    __slots__ = ("base", "members")

    def __init__(self, parent: Op, members: Sequence[int], base: int) -> None:
        super().__init__(
            parent.fabric,
            parent.gid,
            parent.seq,
            parent.fp,
            [parent.ranks[m] for m in members],
            list(members).index(parent.rank),
            parent.chunk_bytes,
            parent.kind,
        )
        self.members = list(members)
        self.base = base
        # The same lists as the parent's: its finish, abandon and deadline see them.
        self.pending = parent.pending
        self._sent = parent._sent

    def recv(
        self,
        peer: int,
        slot: int,
        chunk: int,
        dest: Array,
        expect: Fingerprint | None = None,
        seq: int | None = None,
    ) -> asyncio.Future[None]:
        """``Op.recv`` in this phase's slots; recorded under the peer's rank in the
        parent operation."""
        fut = super().recv(peer, slot + self.base, chunk, dest, expect, seq)
        p, key, f = self.pending[-1]
        self.pending[-1] = (self.members[p], key, f)
        return fut

    def send_now(self, peer: int, slot: int, chunk: int, src: Array, seq: int | None = None) -> int:
        """``Op.send_now`` in this phase's slots."""
        return super().send_now(peer, slot + self.base, chunk, src, seq)
