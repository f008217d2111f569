"""The segment allreduce (collectives/segment.py): the default for allreduces from
``select.SEGMENT_MIN`` to ``SEGMENT_MAX`` where the rendezvous records say every rank
reads the others' memory (the default transport on one host). Real processes on both
loops, exact results for several ops and dtypes, odd sizes, sizes on both sides of every
switch, several operations in flight, a peer killed in the middle; in one process, no
segment is left mapped once the group closed (the directory's fixtures check it)."""

from __future__ import annotations

import os
import time

import pytest

from aiocollect.collectives import registry, segment, select
from aiocollect.testing import run_ranks, spawn_ranks
from aiocollect.transport.shm_slots import HEADER_BYTES, REGIONS, SlotSegment
from tests.support.targets import segment as targets

pytestmark = pytest.mark.timeout(120)


def test_the_automatic_choice() -> None:
    choose = registry.ALLREDUCE.choose
    for n in (2, 3, 4, 8):
        assert choose(None, select.SEGMENT_MIN, n, pulls=True).name == "segment"
        assert choose(None, select.SEGMENT_MAX, n, pulls=True).name == "segment"
        assert choose(None, select.SEGMENT_MAX + 4, n, pulls=True).name == "pull"
        assert choose(None, select.SEGMENT_MIN, n).name != "segment"  # no pulls predicted
    assert choose(None, select.SEGMENT_MIN - 4, 2, pulls=True).name == "ring"
    assert select.SEGMENT_MAX <= segment.SLOT_BYTES


def test_a_peer_maps_what_the_owner_wrote() -> None:
    """A slot segment is a sealed memfd of its reserved size; another mapping of it (here
    in the same process, through /proc like a peer) sees the owner's bytes, and the owner's
    descriptor closes once handed over."""
    own = SlotSegment.create(64 * 1024)
    try:
        assert own.fd is not None
        peer = SlotSegment.attach(os.getpid(), own.fd, 64 * 1024, own.token)
        own.region(1, 16)[:] = 7
        assert peer.region(1, 16).tolist() == [7] * 16
        assert own.bytes.size == HEADER_BYTES + REGIONS * 64 * 1024
        peer.close()
        own.handed_over()
        assert own.fd is None
    finally:
        own.close()


@pytest.mark.parametrize("uvloop", [False, True], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("n", [2, 4])
async def test_in_processes_over_the_default_transport(n: int, uvloop: bool) -> None:
    """auto: the automatic choice takes the segment allreduce between its thresholds;
    2 of each op and dtype in flight at each size, exact, identical on every rank."""
    res = await spawn_ranks(n, targets.exact_mix, 2, False, timeout=100, uvloop=uvloop)
    first = res[0]["chosen"]
    assert first[0] != "segment", first
    assert first[-1] == "pull", first
    assert first[1:-1] == ["segment"] * 3, first
    assert len({r["digest"] for r in res}) == 1
    assert res[0]["resources"] == ["('segment', 0)"]


async def test_forced_over_shm_with_three_ranks() -> None:
    """``algorithm="segment"`` over the shm transport: every size, the small and odd ones
    (fewer elements than ranks) included, and past the region (the pull allreduce)."""
    res = await spawn_ranks(3, targets.exact_mix, 2, True, timeout=100, transport="shm")
    assert len({r["digest"] for r in res}) == 1


async def test_in_one_process_leaves_nothing_mapped() -> None:
    """In-process ranks over shared memory: exact results; closing the group unmaps every
    segment and closes every descriptor (checked by the directory's fixtures)."""
    res = await run_ranks(2, targets.exact_mix, 2, True, transport="shm")
    assert len({r["digest"] for r in res}) == 1


@pytest.mark.parametrize("uvloop", [False, True], ids=["asyncio", "uvloop"])
async def test_a_peer_killed_in_the_middle(uvloop: bool) -> None:
    """Rank 1 of three dies (SIGKILL) in the reduce-scatter, after it announced its
    region: both survivors fail within seconds, neither hangs."""
    start = time.monotonic()
    job = spawn_ranks(3, targets.dies_in_the_fold, 1 << 18, timeout=60, uvloop=uvloop)
    outcomes = await job.outcomes()
    assert outcomes[1][0] == "died", outcomes
    for r in (0, 2):
        assert outcomes[r][0] == "ok", outcomes
        got = outcomes[r][1]
        assert got["error"] in ("PeerDisconnected", "GroupBrokenError"), got
        assert got["seconds"] < 10, got
    assert time.monotonic() - start < 60


@pytest.mark.parametrize(
    ("fault", "why"),
    [
        ("length", "announced a 4008-byte region"),
        ("descriptor", "cannot map the slot segment of rank 1"),
        ("token", "another token than offered"),
        ("region", "region 7 of 4000 bytes"),
    ],
)
async def test_a_lying_written_frame_breaks_the_group_not_the_process(fault: str, why: str) -> None:
    """Rank 1's written frame names another length, a descriptor it does not hold, another
    token or a region past its segment: its peers fail with ProtocolError naming it (the
    group breaks on every rank), and every process returns normally."""
    res = await spawn_ranks(3, targets.bad_record, fault, timeout=60)
    assert all(r != "no error" for r in res), res
    assert any(r.startswith("ProtocolError") and why in r and "rank 1" in r for r in res), res


async def test_a_peer_that_breaks_after_writing_is_not_called_a_liar() -> None:
    """Rank 1's group breaks right after its written frames went out, releasing its
    segment: its peers cannot map it, and report rank 1's abort (not ProtocolError)."""
    res = await spawn_ranks(3, targets.breaks_after_writing, timeout=60)
    assert not any(r.startswith("ProtocolError") for r in res), res
    assert all(r != "no error" for r in res), res
    assert all("rank 1 gave up" in res[r] for r in (0, 2)), res
