"""Many ranks per process over real TCP links through a standalone store
(``aiocollect.testing.many``): the group forms and allreduce (4 B, 1 MiB), broadcast,
barrier, alltoall and split are exact on every rank. The large groups run under
``make scale`` (``AIOCOLLECT_SCALE=1``), not ``make test``."""

from __future__ import annotations

import math
import os

import pytest

from aiocollect.collectives.neighbours import neighbours
from aiocollect.testing.many import run_many

LARGE = os.environ.get("AIOCOLLECT_SCALE") == "1"


@pytest.mark.timeout(120)
def test_two_processes_of_six_ranks(capfd: pytest.CaptureFixture[str]) -> None:
    """The checks pass, a rank keeps its neighbours' links, and each process reports its
    steps on standard error as they end."""
    result = run_many(2, 6, timeout=100)
    most = max(len(neighbours(12, r)) for r in range(12))
    assert result.figures["sockets_at_open"] == most
    assert result.figures["links_after_collectives"] == most
    # (a lane only on the links that carried the 1 MiB allreduce's bulk)
    assert most <= result.figures["sockets_after_collectives"] <= 2 * most
    progress = capfd.readouterr().err.splitlines()
    for ranks in ("0-5", "6-11"):
        steps = [line.split(": ")[2].rsplit(" ", 2)[0] for line in progress if f" {ranks}:" in line]
        assert steps == [
            "formed",
            "first allreduce 4 B",
            "allreduce 4 B",
            "first allreduce 1 MiB",
            "allreduce 1 MiB",
            "broadcast",
            "barrier",
            "alltoall",
            "split",
        ], progress


@pytest.mark.scale
@pytest.mark.skipif(not LARGE, reason="make scale (AIOCOLLECT_SCALE=1)")
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(("procs", "per"), [(4, 128), (8, 128), (16, 256)])
def test_large_groups(procs: int, per: int) -> None:
    n = procs * per
    # (4,096 ranks on a small host take long: up to an hour)
    result = run_many(procs, per, timeout=1700 if n <= 1024 else 3500)
    print(f"{n} ranks: {result.figures}, {result.wall_s:.1f} s")
    assert result.figures["links_after_collectives"] <= max(len(neighbours(n, r)) for r in range(n))
    # the target for large groups: at most 2 log2(N) + 8 sockets per rank (lanes included)
    assert result.figures["sockets_after_collectives"] <= 2 * math.log2(n) + 8
