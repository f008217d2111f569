"""The head-of-line floor (:mod:`aiocollect.bench.hol_floor`): real forked ranks reading
each other's memory and pinging over a real socket pair. Nothing here asserts speed: only
that it runs, checks its result and rejects bad arguments."""

from __future__ import annotations

import numpy as np
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


@pytest.mark.parametrize(("n", "allreduces"), [(2, 3), (3, 40), (4, 200)])
def test_expected_value_is_the_float32_fold(n: int, allreduces: int) -> None:
    """The closed form the ranks check against folds in float32 as they do: exact for
    powers of two, rounded like the ranks' adds otherwise, inf past float32's range."""
    got = hol_floor._expected(n, allreduces)
    assert got.dtype == np.float32
    if n == 2:
        assert got == np.float32(2.0**allreduces)
    elif n == 4:
        assert np.isinf(got)  # 4**200 overflows float32 (as the ranks' sums do)
    else:
        assert got == pytest.approx(3.0**allreduces, rel=1e-4)
