"""The descriptor checks (aiocollect/_fdlimit.py) count one descriptor per link, so a group
whose links fit with one connection each is never refused for the small-frame lanes of its
TCP links; a lane is taken only while a descriptor is to spare beyond ``SPARE``, and the
first lane refused is said once, at DEBUG."""

from __future__ import annotations

import logging
import resource

import pytest

from aiocollect import _fdlimit


def _room() -> int:
    """Descriptors the checks may still hand out in this process."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 0:
        pytest.skip("no descriptor limit to check against")  # (RLIM_INFINITY)
    now = _fdlimit.open_count()
    assert now is not None
    return soft - now - _fdlimit.SPARE


def test_the_count_is_one_descriptor_per_link() -> None:
    room = _room()
    assert _fdlimit.too_few(room) is None
    short = _fdlimit.too_few(room + 1)
    assert short is not None
    assert "one each" in short


def test_a_lane_is_taken_only_while_a_descriptor_is_to_spare(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiocollect.fdlimit")
    monkeypatch.setattr(_fdlimit, "_lanes_short_said", False)
    room = _room()
    assert _fdlimit.lane_fits()
    assert _fdlimit.reserve_lane()
    _fdlimit.release(1)
    assert _fdlimit.reserve(room) is None  # (links being made take the room)
    try:
        assert not _fdlimit.reserve_lane()
        assert not _fdlimit.reserve_lane()
    finally:
        _fdlimit.release(room)
    said = [r for r in caplog.records if "keep one connection" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].levelno == logging.DEBUG
    monkeypatch.setattr(_fdlimit, "open_count", lambda: 10**9)  # (beyond any limit)
    assert not _fdlimit.lane_fits()
