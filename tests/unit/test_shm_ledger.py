"""The send ledger of shared-memory links (transport/shm_ledger.py), with no event loop:
marks, references let go in order, implausible pull counts, merging marks."""

from __future__ import annotations

import pytest

from aiocollect.errors import ProtocolError
from aiocollect.transport.base import DRAIN
from aiocollect.transport.shm_ledger import SendLedger


def test_references_are_let_go_in_order() -> None:
    ledger = SendLedger()
    a, b = memoryview(bytearray(10)), memoryview(bytearray(20))
    assert ledger.by_reference(a, 10) == 1
    assert ledger.by_reference(b, 20) == 2
    assert (ledger.ref_bytes, ledger.refs_let_go) == (30, 0)
    assert ledger.let_go(0) is False  # nothing new
    assert ledger.let_go(1) is False  # one still held
    assert (ledger.ref_bytes, ledger.refs_let_go) == (20, 1)
    assert ledger.let_go(2) is True  # the last one
    assert (ledger.ref_bytes, ledger.refs_let_go, len(ledger.refs)) == (0, 2, 0)


@pytest.mark.parametrize("pulled", [1, 3])
def test_an_implausible_pull_count_is_a_protocol_error(pulled: int) -> None:
    ledger = SendLedger()
    ledger.by_reference(memoryview(b"x"), 1)
    ledger.by_reference(memoryview(b"y"), 1)
    ledger.let_go(2)
    with pytest.raises(ProtocolError, match="corrupt shared-memory ring"):
        ledger.let_go(pulled)  # went back (1), or more than were sent (3)


def test_a_mark_is_released_once_in_the_ring_and_pulled() -> None:
    ledger = SendLedger()
    ref = ledger.by_reference(memoryview(b"abc"), 3)
    mark = ledger.queued(50, ref)
    assert mark == (50, 1)
    assert not ledger.in_ring(mark)
    assert not ledger.released(mark)
    ledger.queue_out = 50  # (the link wrote the queued bytes into the ring)
    assert ledger.in_ring(mark)
    assert not ledger.released(mark)
    ledger.let_go(1)
    assert ledger.released(mark)
    ledger.drop()
    assert (ledger.ref_bytes, len(ledger.refs)) == (0, 0)


def test_merge() -> None:
    merge = SendLedger.merge
    assert merge(None, None) is None
    assert merge((1, 2), None) == (1, 2)
    assert merge(None, (1, 2)) == (1, 2)
    assert merge((5, 1), (3, 4)) == (5, 4)
    assert merge(DRAIN, (3, 4)) == DRAIN
    assert merge((3, 4), DRAIN) == DRAIN
