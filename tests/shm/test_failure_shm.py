"""Failures only shared memory has: ranks killed while their links are set up leave no
segment, and corrupt bytes in a ring (or after an escape on the link's socket) are a
ProtocolError, never a crash. (A killed or frozen rank over shared memory, as over every
transport: tests/failure/test_kill_stop.py.)"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import abort_payload, run_ranks, spawn_ranks
from aiocollect.transport.shm import ShmLink
from aiocollect.transport.shm_socket import ESCAPE, MAX_ESCAPED
from aiocollect.transport.wire import (
    ABORT,
    HEADER_SIZE,
    PING,
    Header,
    control_header,
    pack_header,
)
from tests.support.shm_leaks import leaked, segments
from tests.support.targets import failure as failure_targets
from tests.support.targets import shm as targets


@pytest.mark.timeout(90)
async def test_sigkill_during_rendezvous_leaves_no_segment() -> None:
    """Ranks killed while their group forms (some links set up, some not)."""
    before = segments()
    job = spawn_ranks(
        4, failure_targets.loop_until_failure, 1024, "ready", timeout=30, transport="shm"
    )
    for rank in range(4):
        job.kill(rank)
    await job.outcomes()
    assert not leaked(before, {job.pid(r) for r in range(4)})


# -- corrupt rings ------------------------------------------------------------------------


def _corrupt(link: ShmLink, how: str) -> None:
    """Write something bad into ``link``'s outgoing ring, as a broken peer would."""
    tx = link._tx
    assert tx is not None
    if how == "magic":
        tx.write(memoryview(b"\xee" * HEADER_SIZE))
    elif how == "length":  # a DATA frame longer than the group's chunk size
        bad = Header(1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 1 << 40)
        tx.write(memoryview(pack_header(bad)))
    elif how == "kind":
        tx.write(memoryview(pack_header(Header(99, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0))))
    elif how == "head":  # the writer's position runs past the reader by more than the ring
        tx.pos += tx.cap + 4096
    else:
        raise AssertionError(how)
    link._publish(tx)


async def _corrupt_then_allreduce(g: ac.Group, how: str) -> tuple[str, str]:
    """Rank 0 corrupts its ring to rank 1, then both allreduce until the group fails."""

    async def corrupt(link: ShmLink) -> None:
        _corrupt(link, how)

    return await targets.on_link_then_allreduce(g, corrupt)


def _check_told(res: list[tuple[str, str]], detector: int | None) -> None:
    """Of two ranks, the detector failed with the ProtocolError (``detector``, or either
    one if None, or both at once); the other got GroupBrokenError naming the detector and
    carrying its message, not a disconnection or a timeout."""
    own = [detail.startswith("ProtocolError: ") for _, detail in res]
    assert any(own), res
    assert detector is None or own[detector], res
    for rank, (kind, detail) in enumerate(res):
        if not own[rank]:
            other = 1 - rank
            why = res[other][1].split(": ", 1)[1]
            assert kind == "GroupBrokenError", res
            assert f"rank {other} aborted the group: {why}" in detail, res


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["magic", "length", "kind", "head"])
async def test_corrupt_ring_is_a_protocol_error(how: str, caplog: pytest.LogCaptureFixture) -> None:
    res = await run_ranks(2, _corrupt_then_allreduce, how, transport="shm", timeout=10)
    # rank 1 finds it (with "head", rank 0's writer may find it first: its position is
    # the implausible one); the other hears who and why through the detector's ABORT
    # (sent on the socket: rings are not trusted once one is corrupt), never a hang
    _check_told(res, detector=None if how == "head" else 1)
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelname == "ERROR"]


async def _corrupt_tail(g: ac.Group) -> str:
    try:
        await g.barrier()  # every rank's group formed (see targets.on_link_then_allreduce)
        if g.rank == 1:  # rank 1 claims to have read more than rank 0 ever wrote
            link = g._fabric.links[0]
            assert isinstance(link, ShmLink)
            assert link.rx is not None
            link.rx.pos += 1 << 40
            link.rx.publish_tail()
        for _ in range(100):
            await g.allreduce(np.ones(1 << 12, np.float32))
    except ac.AiocollectError as exc:
        cause = exc.__cause__ or exc if isinstance(exc, ac.GroupBrokenError) else exc
        return f"{type(exc).__name__}: {type(cause).__name__}: {cause}"
    return "no error"


@pytest.mark.timeout(30)
async def test_corrupt_reader_position_is_a_protocol_error() -> None:
    """Rank 0's writer finds the position implausible, or rank 1's reader does (its own
    copy is corrupt too): whichever looks first fails with ProtocolError, the other rank
    hears of it through the ABORT or the closed link."""
    res = await run_ranks(2, _corrupt_tail, transport="shm", timeout=10)
    _check_corrupt_tail(res)


def _check_corrupt_tail(res: list[str]) -> None:
    """Each rank found the corruption itself or was told by the other who did and why;
    neither is told that a live peer disconnected."""
    assert any("ProtocolError: corrupt shared-memory ring" in r for r in res), res
    for rank, r in enumerate(res):
        other = 1 - rank
        assert "ProtocolError: corrupt shared-memory ring" in r or (
            f"rank {other} aborted the group: corrupt shared-memory ring" in r
        ), res
        assert "PeerDisconnected" not in r, res
        assert "disconnected" not in r, res


@pytest.mark.timeout(90)
@pytest.mark.parametrize("uvloop", [False, True])
async def test_corrupt_reader_position_in_processes(uvloop: bool) -> None:
    """The same in real processes: rank 0's writer (which finds the reader's position
    implausible and can no longer write its ring) reports it on the socket."""
    res = await spawn_ranks(2, _corrupt_tail, timeout=60, uvloop=uvloop, transport="shm")
    _check_corrupt_tail(res)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("uvloop", [False, True])
@pytest.mark.parametrize("how", ["magic", "head"])
async def test_corrupt_ring_in_processes(how: str, uvloop: bool) -> None:
    """Rank 0 writes garbage into its ring to rank 1 (real processes): the rank that finds
    it fails with the ProtocolError, the other gets GroupBrokenError naming it and the
    cause."""
    res = await spawn_ranks(
        2, _corrupt_then_allreduce, how, timeout=60, uvloop=uvloop, transport="shm"
    )
    _check_told(res, detector=None if how == "head" else 1)


@pytest.mark.timeout(30)
async def test_garbage_after_close_does_not_crash(caplog: pytest.LogCaptureFixture) -> None:
    """A peer scribbling in the ring while the link closes: no exception escapes into the
    event loop (asyncio would log "Fatal error: protocol.buffer_updated() call failed")."""

    async def body(g: ac.Group) -> int:
        await g.allreduce(np.ones(8))
        link = g._fabric.links[1 - g.rank]
        assert isinstance(link, ShmLink)
        if g.rank == 0:
            _corrupt(link, "magic")
        return os.getpid()

    await run_ranks(2, body, transport="shm")
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelname == "ERROR"]


def _escaped(how: str) -> bytes:
    """An escape and the frame after it: an ABORT, a PING, or an ABORT too long to be one."""
    payload = abort_payload(0, ac.ProtocolError("injected by hand"))
    if how == "abort":
        frame = control_header(ABORT, len(payload)) + payload
    elif how == "ping":
        frame = control_header(PING, 0)
    else:
        frame = control_header(ABORT, MAX_ESCAPED + 1) + bytes(MAX_ESCAPED + 1)
    return ESCAPE + frame


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["abort", "ping", "huge"])
async def test_escaped_frames_on_the_socket(how: str, caplog: pytest.LogCaptureFixture) -> None:
    """An ABORT after an escape byte, arriving in pieces, breaks the group with the
    sender's failure; anything else after an escape (a PING, an ABORT longer than
    MAX_ESCAPED) is a ProtocolError naming the link, and never an exception escaping into
    the event loop."""
    res = await run_ranks(
        2, targets.bytes_on_the_socket, _escaped(how), (1, 20), transport="shm", timeout=10
    )
    kind, detail = res[1]
    if how == "abort":
        assert kind == "GroupBrokenError", res
        assert "rank 0 aborted the group: injected by hand" in detail, res
    else:
        assert detail.startswith("ProtocolError: "), res
        assert "rank 0" in detail, res
        assert "malformed frame on its socket" in detail, res
    assert res[0][0] != "no error", res
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelname == "ERROR"]


_corrupted: dict[str, asyncio.Event] = {}


async def _abort_over_corrupt_ring(g: ac.Group, key: str) -> str:
    """Rank 1 publishes an impossible reader position (rank 0 does not look at it until
    it writes again); then rank 0 aborts the group, so the ring its ABORT would go into
    is found corrupt while it is being sent."""
    event = _corrupted.setdefault(key, asyncio.Event())
    await g.barrier()
    if g.rank == 1:
        link = g._fabric.links[0]
        assert isinstance(link, ShmLink)
        assert link.rx is not None
        link.rx.ctl[32] = 1 << 40  # the ring's tail word (shm_ring._TAIL)
        event.set()
        try:
            await g.recv(np.empty(4, np.float32), 0)
        except ac.AiocollectError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"
    await event.wait()
    g.abort()
    return "aborted"


@pytest.mark.timeout(30)
async def test_abort_into_a_corrupt_ring_still_reaches_the_peer() -> None:
    """The group fails for another reason (abort) and the ring the ABORT would go into
    turns out corrupt as it is written: the ABORT goes on the socket, and the peer is
    told that rank 0 aborted, not that it disconnected."""
    res = await run_ranks(2, _abort_over_corrupt_ring, "abort", transport="shm", timeout=10)
    assert res[0] == "aborted", res
    assert res[1].startswith("GroupBrokenError: "), res
    assert "rank 0 aborted the group" in res[1], res
    assert "aborted on rank 0" in res[1], res
