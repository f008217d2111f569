"""The head-of-line floor (:mod:`aiocollect.bench.hol_floor`): real forked ranks reading
each other's memory and pinging over a real socket pair. Nothing here asserts speed: only
that it runs, checks its result and rejects bad arguments."""

from __future__ import annotations

import pytest

from aiocollect.bench import hol_floor
from aiocollect.transport import cma

needs_pulls = pytest.mark.skipif(
    cma.self_check() is not None, reason="process_vm_readv is unavailable or forbidden here"
)


@needs_pulls
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_floor_round_trips_during_allreduces(n: int) -> None:
    floor = hol_floor.measure(n, 4 * n * (1 << 18), 4, ping=1024)
    assert floor.bulk_seconds > 0
    assert len(floor.rtt_us) >= 1
    assert all(0 < r < 60e6 for r in floor.rtt_us)
    assert all(lag >= 0 for lag in floor.lag_us)


@pytest.mark.parametrize(
    ("n", "nbytes", "ping"), [(1, 1 << 20, 1024), (2, 6, 1024), (2, 0, 1024), (2, 1 << 20, 0)]
)
def test_floor_rejects_bad_arguments(n: int, nbytes: int, ping: int) -> None:
    with pytest.raises(ValueError, match="need 2"):
        hol_floor.measure(n, nbytes, 2, ping=ping)
