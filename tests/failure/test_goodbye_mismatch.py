"""A rank still waiting when its peers close learns the real cause: the peers called the
operation differently, or called fewer operations (their GOODBYE's digest shows it), and it
raises the MismatchError that names both calls, not "rank N closed the group"."""

from __future__ import annotations

from typing import Any

import pytest

from aiocollect.testing import spawn_ranks
from tests.support.targets import mismatch as mismatch_targets

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ["tcp", "auto"]
LOOPS = [pytest.param(False, id="asyncio"), pytest.param(True, id="uvloop")]


def _kind(outcome: tuple[Any, ...]) -> tuple[str, str]:
    """(error class, message) a rank learned: from its operation, or from aclose."""
    if outcome[0] == "error":  # the operation returned; aclose raised in the child
        return outcome[1], outcome[2]
    assert outcome[0] == "ok", outcome
    res = outcome[1]
    if res["error"] == "GroupBrokenError" and res.get("cause") == "MismatchError":
        return "MismatchError", res["message"]
    return str(res["error"]), res.get("message", "")


@pytest.mark.parametrize("uvloop", LOOPS)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_waiting_rank_names_the_other_root(transport: str, uvloop: bool) -> None:
    """Rank 3 broadcasts from root 1, ranks 0-2 from root 0: ranks 0-2 finish and close;
    rank 3, still waiting on rank 1, raises MismatchError naming both roots."""
    ranks = spawn_ranks(
        4, mismatch_targets.wrong_root, 3, 1, 8, timeout=40, transport=transport, uvloop=uvloop
    )
    outcomes = await ranks.outcomes()
    kind, message = _kind(outcomes[3])
    assert kind == "MismatchError", outcomes[3]
    assert "root=1" in message, message
    assert "root=0" in message, message


@pytest.mark.parametrize("uvloop", LOOPS)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_peer_that_closes_after_fewer_operations(transport: str, uvloop: bool) -> None:
    """Rank 1 closes after one broadcast; ranks 0 and 2 wait on a second one rooted at rank
    1: they raise MismatchError saying rank 1 closed after fewer operations."""
    ranks = spawn_ranks(
        3, mismatch_targets.fewer_operations, 1, timeout=40, transport=transport, uvloop=uvloop
    )
    outcomes = await ranks.outcomes()
    for rank in (0, 2):
        kind, message = _kind(outcomes[rank])
        assert kind == "MismatchError", (rank, outcomes[rank])
        assert "rank 1" in message, message
