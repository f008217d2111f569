"""copy_into: large local copies (an allgather's own block) in steps, with the event loop
turning in between, and exact results."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aiocollect.engine import reduce


@pytest.mark.timeout(30)
async def test_large_copy_lets_the_loop_run_between_steps() -> None:
    src = np.arange(3 * reduce.COPY_STEP // 8 + 5, dtype=np.float64)
    dst = np.zeros_like(src)
    seen: list[float] = []

    def probe() -> None:  # what another callback sees while the copy is under way
        seen.append(float(dst[-1]))

    asyncio.get_running_loop().call_soon(probe)
    await reduce.copy_into(dst, src)
    np.testing.assert_array_equal(dst, src)
    assert seen == [0.0]  # it ran after the first step, before the last one


@pytest.mark.timeout(30)
async def test_small_copy_is_one_step() -> None:
    src = np.arange(100, dtype=np.int32)
    dst = np.zeros_like(src)
    ran: list[bool] = []
    asyncio.get_running_loop().call_soon(lambda: ran.append(True))
    await reduce.copy_into(dst, src)
    assert ran == []  # no yield
    np.testing.assert_array_equal(dst, src)
