"""The descriptor check counts what a link holds (aiocollect/_fdlimit.py): two where the
listener offers small-frame lanes (TCP, TLS), one where it does not (shared memory, unix),
so a group whose links hold one descriptor is not refused at half the links it fits."""

from __future__ import annotations

import resource

import pytest

from aiocollect import _fdlimit


def test_the_count_is_per_descriptor_a_link_holds() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 0:
        pytest.skip("no descriptor limit to check against")  # (RLIM_INFINITY)
    now = _fdlimit.open_count()
    assert now is not None
    room = soft - now - _fdlimit.SPARE  # descriptors the check may still hand out
    assert _fdlimit.too_few(room, per=1) is None
    short = _fdlimit.too_few(room // 2 + 1, per=2)
    assert short is not None
    assert "2 each (a TCP link and its small-frame lane)" in short
    assert _fdlimit.too_few(room // 2 + 1, per=1) is None
    assert "one each" in (_fdlimit.too_few(room + 1, per=1) or "")
