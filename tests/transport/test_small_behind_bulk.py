"""A small send/recv round trip stays short while bulk allreduces run: what lies ahead of a
small frame on its way (the send queue, the kernel's socket buffers, a shared-memory ring,
one-sided pulls, a step of local work holding the loop) is bounded.

Two ranks, each a fresh interpreter (``spawn_ranks``), over ``tcp`` and ``auto``, on plain
asyncio and on uvloop; rank 0 exchanges 1 KiB with rank 1, one request at a time, while both
run back-to-back 16 MiB allreduces (the measurement of ``python -m aiocollect.bench.hol``,
:func:`aiocollect.bench.hol_ranks.hol_rank`). The bound is on the median round trip under
load, which a busy host moves far less than the tail.

The library does not meet this bound yet on this two-core host under load: 3.6-5.3 ms over
``tcp`` with its small-frame lane, 5-7 ms over ``auto`` at load average 5
(docs/benchmarks.md, *Parameter-server responsiveness*), so ``make test`` leaves these
cases out and ``make test-responsiveness`` (``AIOCOLLECT_RESPONSIVENESS=1``) runs them, on
a host with nothing else running: with more runnable processes than cores the round trip
is the scheduler's whatever the library does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from aiocollect.bench.hol_ranks import hol_rank
from aiocollect.testing.spawn import SpawnedRanks

pytestmark = pytest.mark.skipif(
    os.environ.get("AIOCOLLECT_RESPONSIVENESS") != "1",
    reason="a target not met yet: make test-responsiveness (AIOCOLLECT_RESPONSIVENESS=1)",
)

#: The median 1 KiB round trip under 16 MiB allreduces may not exceed this (ms).
P50_BOUND_MS = 2.5
#: Bulk allreduces per phase, and their size: about a second of bulk on this host.
ALLREDUCES = 10
SIZE = 16 * 1024 * 1024


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "auto"])
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_small_round_trip_within_bound_under_bulk(
    transport: str, loop: str, spawned: Callable[..., SpawnedRanks]
) -> None:
    ranks = spawned(
        2,
        hol_rank,
        *(SIZE, ALLREDUCES, 1024, 20),
        transport=transport,
        uvloop=loop == "uvloop",
        timeout=80,
    )
    report: dict[str, Any] = (await ranks)[0]
    loaded = report["loaded_rtt_us"]
    assert loaded["n"] >= 5, report
    assert loaded["p50"] <= P50_BOUND_MS * 1e3, (
        f"median 1 KiB round trip {loaded['p50'] / 1e3:.1f} ms during {SIZE >> 20} MiB "
        f"allreduces over {transport} on {loop} (bound {P50_BOUND_MS} ms): {loaded}"
    )
