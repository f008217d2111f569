"""Shared-memory tests: nothing of ours may be left in /dev/shm when the session ends."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from aiocollect.transport.shm_ring import (
    PREFIX,
    SEGMENT_DIR,
    pid_alive,
    segment_pid,
    unavailable,
)

if unavailable() is not None:  # pragma: no cover - the CI machines are Linux x86-64
    pytest.skip(f"shared memory unavailable: {unavailable()}", allow_module_level=True)


def segments() -> set[str]:
    """Names of aiocollect segments in /dev/shm (of any process)."""
    return {n for n in os.listdir(SEGMENT_DIR) if n.startswith(PREFIX)}


def leaked(before: set[str], pids: set[int] | None = None) -> set[str]:
    """Segments that appeared since ``before`` and belong to ``pids`` or, without pids, to
    this process or a process that has exited (other test runs on the machine may hold
    live ones during their link setup)."""
    out = set()
    for name in segments() - before:
        pid = segment_pid(name)
        if pid is None:
            continue
        if pids is not None:
            if pid in pids:
                out.add(name)
            continue
        if pid == os.getpid() or not pid_alive(pid):
            out.add(name)
    return out


@pytest.fixture(scope="session", autouse=True)
def no_segments_left() -> Iterator[None]:
    before = segments()
    yield
    left = leaked(before)
    assert not left, f"shared-memory segments left in {SEGMENT_DIR}: {sorted(left)}"


@pytest.fixture(autouse=True)
def no_segments_left_by_test() -> Iterator[None]:
    before = segments()
    yield
    left = leaked(before)
    assert not left, f"this test left shared-memory segments: {sorted(left)}"
