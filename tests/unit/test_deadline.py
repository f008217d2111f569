"""Deadlines on the monotonic clock."""

from __future__ import annotations

import time

from aiocollect._deadline import Deadline


def test_no_deadline() -> None:
    d = Deadline.after(None)
    assert d.remaining() is None
    assert not d.expired()
    assert d.loop_time(5.0) is None


def test_remaining_never_negative() -> None:
    d = Deadline(time.monotonic() - 1)
    assert d.remaining() == 0.0
    assert d.expired()


def test_remaining_counts_down() -> None:
    d = Deadline.after(100)
    rem = d.remaining()
    assert rem is not None
    assert 99 < rem <= 100
    assert not d.expired()
    loop_at = d.loop_time(1000.0)
    assert loop_at is not None
    assert 1099 < loop_at <= 1100
