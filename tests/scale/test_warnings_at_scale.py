"""At scale, a no-progress warning stays a line: 64 ranks in one process, 56 of them call
an allreduce late, and the warnings of the 8 that wait name at most 8 ranks of each list
and how many more (engine/watchdog.py); the allreduce then completes exactly."""

from __future__ import annotations

import re

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks
from tests.support.stall_warnings import StallWarnings

pytestmark = pytest.mark.timeout(60)

N = 64
EARLY = 8  # ranks 0..7 call at once; the others when a warning has come


@pytest.mark.one_loop  # (in-memory links: nothing loop-specific)
async def test_a_stall_warning_names_a_few_ranks_and_a_count(stall_warnings: StallWarnings) -> None:
    async def body(g: ac.Group) -> int:
        await g.barrier()
        if g.rank >= EARLY:
            await stall_warnings.wait_for("have not called it")
        buf = np.ones(4, np.int64)
        await g.allreduce(buf, algorithm="star")  # (rank 0 waits on every rank)
        return int(buf[0])

    assert await run_ranks(N, body, timeout=30) == [N] * N
    absent = [m for m in stall_warnings.messages if "have not called it" in m]
    assert absent, stall_warnings.messages
    for message in stall_warnings.messages:
        for listed in re.findall(r"ranks (\[[\d, ]*\])", message):
            assert listed.count(",") <= 7, message  # at most 8 ranks shown per list
    assert re.search(
        r"ranks \[8, 9, 10, 11, 12, 13, 14, 15\] and 48 more have not called", absent[0]
    )
