"""A host cut off mid-job (its interface down: no FIN, no RST, what a power loss or a
pulled cable looks like) across hosts built from network namespaces: every rank, those on
the lost host and those with no link to it included, gets an error naming a rank on the
other side, within seconds whatever the operation's timeout (docs/failures.md, *A host
that vanishes*)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from aiocollect.testing import hosts

pytestmark = [pytest.mark.timeout(120)]

MODULE = "aiocollect.testing.hosts_rank"
#: What every rank must take to raise, the default settings' bound (about 4 s) with slack
#: for a loaded 2-core machine.
NOTICE = 7.0


async def _event(proc: asyncio.subprocess.Process, name: str, timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    async with asyncio.timeout(timeout):
        while line := await proc.stdout.readline():
            event: dict[str, Any] = json.loads(line)
            if event.get("event") == name:
                return event
    raise AssertionError(f"exited ({await proc.wait()}) before {name!r}")


async def _cut(
    host_of: list[int], lost: int, timeout: float, wait: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Run ``cut TIMEOUT`` on every rank, take host ``lost`` down once all are ready:
    (each rank's ready event, its error event, when the host went down)."""
    with hosts.Hosts(host_of) as hs:
        procs = [await hs.start(r, MODULE, ["cut", str(timeout)]) for r in range(len(host_of))]
        try:
            ready = await asyncio.gather(*(_event(p, "ready", 60) for p in procs))
            down_at = time.time()
            hs.link_down(lost)
            errors = await asyncio.gather(*(_event(p, "error", wait) for p in procs))
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                await p.wait()
    for err in errors:  # shown with -s or on failure
        print(f"rank {err['rank']}: +{err['at'] - down_at:.2f} s {err['message']}")
    return list(ready), list(errors), down_at


@pytest.mark.parametrize(
    ("host_of", "cut", "unlinked"),
    [(hosts.placement(3, 2, "blocked"), 2, []), ([0, 1, 2, 3, 4, 5], 3, [0])],
    ids=["3-hosts-of-2", "6-hosts-of-1"],
)
async def test_a_vanished_host_is_noticed_in_seconds(
    host_of: list[int], cut: int, unlinked: list[int]
) -> None:
    """Host ``cut`` goes silent under the default 300 s timeout: every rank raises within
    ``NOTICE`` seconds, naming a rank it can no longer reach (the lost host's ranks: one
    of the others; the others: one of the lost host's), the ranks with no link to the
    lost host (``unlinked``: six ranks in a ring and their neighbours) too."""
    lost = {r for r, h in enumerate(host_of) if h == cut}
    ready, errors, down_at = await _cut(host_of, cut, 300.0, NOTICE + 10)
    for rank, err in enumerate(errors):
        kind = err["cause"] if err["type"] == "GroupBrokenError" else err["type"]
        assert kind == "PeerDisconnected", (rank, err)
        assert err["at"] - down_at <= NOTICE, (rank, err["at"] - down_at, err)
        assert (err["peer"] in lost) != (rank in lost), (rank, err)
        assert "unreachable" in err["message"], (rank, err)
    assert [ev["rank"] for ev in ready if not lost & {*ev["links"], ev["rank"]}] == unlinked


async def test_a_live_host_that_does_not_read_is_not_lost() -> None:
    """A rank whose process reads nothing for twice the silence bound (its event loop
    blocked while its peer on another host sends 32 MiB: the receive window closes) is
    still there: its host's kernel answers the window probes, and the send completes."""
    with hosts.Hosts([0, 1]) as hs:
        results = await hs.run(MODULE, ["stall", "7"], timeout=60)
    # (rank 1 sleeps 7 s from its own start; rank 0 may start its clock a little later)
    assert results[1]["took"] >= 7, results
    assert results[0]["took"] >= 6.5, results


DEADLINE = 3.0
SLACK = 5.0  # liveness probe, ABORT relay, a loaded 2-core machine


async def test_a_short_timeout_still_bounds_the_wait() -> None:
    """With a 3 s operation timeout the deadline comes first: every rank gets an error
    within the deadline and some slack."""
    host_of = hosts.placement(3, 2, "blocked")
    _, errors, down_at = await _cut(host_of, 2, DEADLINE, DEADLINE + SLACK + 5)
    for rank, err in enumerate(errors):
        kind = err["cause"] if err["type"] == "GroupBrokenError" else err["type"]
        assert kind in ("PeerTimeout", "PeerDisconnected"), (rank, err)
        assert err["at"] - down_at <= DEADLINE + SLACK, (rank, err)
