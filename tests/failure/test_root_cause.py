"""Errors that lead to the root cause: ABORT carries the aborting rank's exception, the
ExceptionGroup of run_ranks/spawn_ranks names the rank that failed first, open_group() used
without await says so."""

from __future__ import annotations

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks, spawn_ranks
from tests.failure import mismatch_targets

pytestmark = pytest.mark.timeout(60)


async def test_peers_see_what_the_aborting_rank_raised() -> None:
    with pytest.raises(ExceptionGroup) as info:
        await run_ranks(4, mismatch_targets.raise_on_rank, 2, transport="tcp", timeout=20)
    group = info.value
    assert str(group).startswith("rank 2 failed first: KeyError: 'missing'"), str(group)
    assert "4 of 4 ranks failed" in str(group)
    for failed in group.exceptions:
        cause = failed.__cause__
        if failed.rank == 2:  # type: ignore[attr-defined]
            assert isinstance(cause, KeyError)
            continue
        assert isinstance(cause, ac.GroupBrokenError), repr(cause)
        assert "rank 2 raised KeyError: 'missing'" in str(cause), str(cause)
        assert "aborted the group" not in str(cause).split("raised")[0], str(cause)


@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_spawned_ranks_name_the_first_failure(transport: str) -> None:
    with pytest.raises(ExceptionGroup) as info:
        await spawn_ranks(3, mismatch_targets.raise_on_rank, 1, timeout=40,
                          transport=transport, group_timeout=20)
    group = info.value
    assert str(group).startswith("rank 1 failed first: KeyError: 'missing'"), str(group)
    others = [f for f in group.exceptions if f.rank != 1]  # type: ignore[attr-defined]
    assert others, str(group)
    for failed in others:
        assert "rank 1 raised KeyError: 'missing'" in str(failed), str(failed)


async def test_open_group_without_await_says_so() -> None:
    opener = ac.open_group(0, 1, store="memory://no-await", name="no-await")
    with pytest.raises(AttributeError, match="await open_group"):
        opener.allreduce(np.ones(1))  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        opener.nonsense  # type: ignore[attr-defined]  # noqa: B018
    group = await opener
    await group.aclose()
