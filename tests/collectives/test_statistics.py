"""Group.statistics(): a Statistics dataclass whose fields count what really moved, and that
still reads like the dict it replaced."""

from __future__ import annotations

import json

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


async def _stats(g: ac.Group) -> tuple[ac.Statistics, ac.Statistics]:
    before = g.statistics()
    await g.allreduce(np.ones(1000, np.float32), algorithm="ring")
    await g.broadcast(np.ones(10, np.int64), root=0)
    return before, g.statistics()


async def test_statistics_is_a_dataclass_that_reads_like_a_dict() -> None:
    results = await run_ranks(3, _stats)
    for rank, (before, after) in enumerate(results):
        assert isinstance(after, ac.Statistics)
        assert (after.rank, after.world_size) == (rank, 3)
        assert after.ops["allreduce_started"] == after.ops["allreduce_completed"] == 1
        assert after.ops["broadcast_completed"] == 1
        assert after.in_flight == 0
        assert not after.broken
        assert not after.closed
        assert sorted(after.links) == [p for p in range(3) if p != rank]
        for peer, link in after.links.items():
            assert isinstance(link, ac.LinkStatistics)
            # the ring sends this rank's share to its successor: real bytes, real frames
            assert link.bytes_sent >= before.links[peer].bytes_sent
        nxt = (rank + 1) % 3
        assert after.links[nxt].bytes_sent - before.links[nxt].bytes_sent >= 2 * 4 * 1000 // 3
        assert after.links[nxt].frames_sent > before.links[nxt].frames_sent
        # dict-like access, as before the dataclass
        assert after["ops"] is after.ops
        assert after["links"][nxt]["bytes_sent"] == after.links[nxt].bytes_sent
        assert "broken" in after
        assert "nonsense" not in after
        with pytest.raises(KeyError, match="nonsense"):
            after["nonsense"]
        assert list(after) == [
            "rank",
            "world_size",
            "ops",
            "in_flight",
            "links",
            "broken",
            "closed",
            "topology",
            "same_host",
            "cross_host",
        ]
        plain = after.as_dict()
        assert plain["links"][nxt] == dict(after.links[nxt])
        json.dumps({k: v for k, v in plain.items() if k != "links"})
