"""What the frames a shared-memory link sent wait for before the caller's memory is free
(sans-IO): the send marks and the payloads sent by reference.

A frame that went straight into the ring (or on the socket) is free at once. Otherwise
its *mark* ``(q, r)`` says what it waits for: its bytes are in the ring once ``q`` bytes
ever queued for the ring have been written there, and its payload is free once ``r``
references have been pulled by the reader (both count in order). A payload sent by
reference stays referenced here, untouched, until the reader reports it pulled
(``Ring.pulled``, read by the link and handed to :meth:`SendLedger.let_go`).
"""

from __future__ import annotations

from collections import deque

from aiocollect.errors import ProtocolError
from aiocollect.transport.base import DRAIN, SendMark


class SendLedger:
    """The send marks and references of one shared-memory link.

    Attributes (the link reads them; it updates ``queue_out`` as it writes queued bytes
    into the ring, everything else through the methods):
        refs: payloads sent by reference and not pulled yet, with their sizes, in order.
        ref_bytes: the bytes of those payloads.
        refs_sent: references ever sent.
        queue_in: bytes ever queued for the ring.
        queue_out: of those, bytes ever written into the ring.
        waits: the marks that waiters (``Link.wait_released``) wait for now.
    """

    __slots__ = ("queue_in", "queue_out", "ref_bytes", "refs", "refs_sent", "waits")

    def __init__(self) -> None:
        self.refs: deque[tuple[memoryview, int]] = deque()
        self.ref_bytes = 0
        self.refs_sent = 0
        self.queue_in = 0
        self.queue_out = 0
        self.waits: list[SendMark] = []

    def by_reference(self, view: memoryview, nbytes: int) -> int:
        """Keep ``view`` (``nbytes``) until the reader has pulled it; returns its number
        among the references (what a mark's ``r`` counts)."""
        self.refs.append((view, nbytes))
        self.ref_bytes += nbytes
        self.refs_sent += 1
        return self.refs_sent

    def queued(self, nbytes: int, ref: int) -> SendMark:
        """``nbytes`` more are queued for the ring: the mark of the frame they end (whose
        reference, if any, is number ``ref``; 0: none)."""
        self.queue_in += nbytes
        return (self.queue_in, ref)

    @property
    def refs_let_go(self) -> int:
        """References sent whose payloads the reader has pulled (counted in order)."""
        return self.refs_sent - len(self.refs)

    def let_go(self, pulled: int) -> bool:
        """The reader reports ``pulled`` references pulled in all: let go of their
        payloads. Returns True when this let go of the last one held.

        Raises:
            ProtocolError: ``pulled`` went back, or exceeds the references sent.
        """
        refs = self.refs
        before = self.refs_sent - len(refs)
        if pulled == before:
            return False
        if not before < pulled <= self.refs_sent:
            raise ProtocolError(
                f"corrupt shared-memory ring: {pulled} pulls reported after "
                f"{before}, with {self.refs_sent} references sent"
            )
        for _ in range(pulled - before):
            self.ref_bytes -= refs.popleft()[1]
        return not refs

    def in_ring(self, mark: tuple[int, int]) -> bool:
        """Whether the bytes of ``mark``'s frame have all been written into the ring."""
        return self.queue_out >= mark[0]

    def released(self, mark: tuple[int, int]) -> bool:
        """Whether ``mark`` is released as far as this ledger knows (without asking the
        ring for new pulls)."""
        return self.queue_out >= mark[0] and mark[1] <= self.refs_sent - len(self.refs)

    def drop(self) -> None:
        """Let go of every reference (the link ended, or its ring failed)."""
        self.refs.clear()
        self.ref_bytes = 0

    @staticmethod
    def merge(mark: SendMark, prev: SendMark) -> SendMark:
        """``mark`` merged with ``prev``: what waits for both (None: nothing;
        :data:`~aiocollect.transport.base.DRAIN`: the link's drain)."""
        if prev is None or mark == prev:
            return mark
        if mark is None:
            return prev
        if mark == DRAIN or prev == DRAIN:
            return DRAIN
        return (max(mark[0], prev[0]), max(mark[1], prev[1]))
