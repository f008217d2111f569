"""Shared-memory tests: nothing of ours may be left behind when a test or the session ends.

Every test checks (tests/support/shm_leaks.py) that this process (the in-process ranks of
``run_ranks``) holds no segment's descriptor or mapping it did not hold before, and that no
``aiocollect-*`` file appeared in ``/dev/shm``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from aiocollect.transport.shm_ring import unavailable
from tests.support.shm_leaks import SHM_DIR, held, leaked, nothing_left, segments

if unavailable() is not None:  # pragma: no cover - the CI machines are Linux x86-64
    pytest.skip(f"shared memory unavailable: {unavailable()}", allow_module_level=True)


@pytest.fixture(scope="session", autouse=True)
def no_segments_left() -> Iterator[None]:
    before = segments()
    yield
    left = leaked(before)
    assert not left, f"shared-memory files left in {SHM_DIR}: {sorted(left)}"
    assert not held(), f"segments still held at the end of the session: {sorted(held())}"


@pytest.fixture(autouse=True)
def no_segments_left_by_test() -> Iterator[None]:
    with nothing_left():
        yield
