"""Early frames (sent before the receiver posted a receive) are staged only up to a bound;
beyond it the link stops reading and the sender waits in TCP flow control. Nothing is lost:
once the receive is posted, everything arrives intact."""

from __future__ import annotations

import pytest

from aiocollect.testing import run_ranks
from aiocollect.transport import base
from tests.helpers import send_past_staging

pytestmark = pytest.mark.timeout(120)


async def test_staging_is_bounded_and_nothing_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    limit = 4 * 1024 * 1024
    monkeypatch.setattr(base, "STAGING_LIMIT", limit)
    size = limit  # int64 elements: 8x the staging limit in bytes
    res = await run_ranks(
        2, send_past_staging, limit, size, transport="tcp", chunk_bytes=256 * 1024
    )
    assert limit < res[0] <= limit + 256 * 1024
