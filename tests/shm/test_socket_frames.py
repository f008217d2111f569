"""Small frames on a shared-memory link's socket (aiocollect.transport.shm, "Small frames
on the socket"): a small frame to a reader that sleeps with everything read goes on the
socket instead of ring + doorbell, and frames still reach the peer in the order they were
sent, whichever way each went.

Real link pairs (both ends in this process, so a burst of sends runs before the reader's
loop takes anything) and real processes; the only fakes are malformed bytes written on a
socket by hand and, for one check, a lower staging limit."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

import pytest

from aiocollect.testing import run_ranks, spawn_ranks
from aiocollect.testing.link_suite import Recorder, frame, payload, shm_pair, within
from aiocollect.transport import mailbox
from aiocollect.transport.shm import ShmLink
from aiocollect.transport.shm_socket import SOCKET_FRAME, SOCKET_FRAME_MAX, SOCKET_FRAMES_AHEAD
from aiocollect.transport.wire import DATA, HEADER_SIZE, Header, Key, pack_header
from tests.support.targets import shm as targets


def _sleeping(link: ShmLink) -> None:
    """The reader of ``link`` never spins: it sleeps as soon as its ring is empty (ranks
    outnumbering cores)."""
    link.policy.spin = 0.0


def _chunks(sizes: list[int], salt: int = 0) -> list[tuple[Key, bytes, bytes]]:
    """Frames of one stream (group 0, op 0, slot 5), chunk i carrying sizes[i] bytes:
    key, header and payload of each."""
    out = []
    for i, n in enumerate(sizes):
        data = payload(n, salt + i)
        key, header = frame(DATA, 5, data, chunk=i)
        out.append((key, header, data))
    return out


def _record(landed: list[int], index: int, _fut: asyncio.Future[None]) -> None:
    landed.append(index)


def _post_all(
    link: ShmLink, chunks: list[tuple[Key, bytes, bytes]], landed: list[int]
) -> list[tuple[asyncio.Future[None], bytearray]]:
    """Post a receive for every chunk; each records its index in ``landed`` as it lands."""
    posted = []
    for i, (key, _, data) in enumerate(chunks):
        buf = bytearray(len(data))
        fut = link.post_recv(key, memoryview(buf))
        fut.add_done_callback(functools.partial(_record, landed, i))
        posted.append((fut, buf))
    return posted


async def _one_frame(a: ShmLink, b: ShmLink, slot: int, data: bytes) -> None:
    """Send ``data`` from ``a`` in a DATA frame of ``slot`` with its receive posted on
    ``b`` first; check that it lands whole."""
    key, header = frame(DATA, slot, data)
    buf = bytearray(len(data))
    fut = b.post_recv(key, memoryview(buf))
    a.send(header, memoryview(data))
    await within(f"the {len(data)}-byte frame of slot {slot}", fut)
    assert bytes(buf) == data


async def _until(what: str, condition: Callable[[], bool]) -> None:
    """Poll this process's own state until ``condition()`` holds (bounded by ``within``):
    both ends of a pair run on this loop, so nothing outside it is waited for."""

    async def poll() -> None:
        # no event says it: staging a parked frame and reading part of a socket frame
        # report nothing to the Recorder
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.002)

    await within(what, poll())


@pytest.mark.timeout(60)
async def test_a_small_frame_to_a_sleeping_reader_goes_on_the_socket() -> None:
    """The reader sleeps with its ring empty: the frame goes on the socket and the ring
    stays untouched (its head does not move); an empty frame and a frame of
    SOCKET_FRAME_MAX bytes go the same way, one byte more goes through the ring."""
    async with shm_pair()(Recorder(), Recorder(), 1 << 20) as (a, b):
        assert isinstance(a, ShmLink)
        assert isinstance(b, ShmLink)
        _sleeping(b)
        assert a._tx is not None
        head = a._tx.pos
        for slot, n in enumerate([4, 0, SOCKET_FRAME_MAX]):
            await _one_frame(a, b, slot, payload(n, slot))
        assert a.frames_on_socket == 3
        assert a._tx.pos == head, "a frame on the socket went into the ring too"
        if a.caps.reference_min and a.caps.reference_min <= SOCKET_FRAME_MAX + 1:
            return  # (that size goes by reference: no ring frame to see)
        await _one_frame(a, b, 9, payload(SOCKET_FRAME_MAX + 1, 7))
        assert a.frames_on_socket == 3
        assert a._tx.pos > head


@pytest.mark.timeout(60)
async def test_a_socket_frame_in_pieces() -> None:
    """A frame on the socket that arrives over several reads (its header cut, then its
    payload) is put together and lands whole. (The frame is written by hand, the
    reader's progress checked between the pieces, so each is a read of its own.)"""
    async with shm_pair()(Recorder(), Recorder(), 1 << 20) as (a, b):
        assert isinstance(a, ShmLink)
        assert isinstance(b, ShmLink)
        assert a.transport is not None
        data = payload(3000, 4)
        key, header = frame(DATA, 3, data)
        buf = bytearray(len(data))
        fut = b.post_recv(key, memoryview(buf))
        wire = SOCKET_FRAME + header + data
        a.transport.write(wire[:10])
        await _until("the frame begun", lambda: b._socket_parser.frame is not None)
        a.transport.write(wire[10 : HEADER_SIZE + 1 + 100])
        await _until("its header read", lambda: b._socket_parser.head is not None)
        assert not fut.done()
        a.transport.write(wire[HEADER_SIZE + 1 + 100 :])
        await within("the frame", fut)
        assert bytes(buf) == data


@pytest.mark.timeout(60)
@pytest.mark.parametrize("posted", [True, False])
async def test_frames_after_socket_frames_keep_their_order(posted: bool) -> None:
    """A small frame goes on the socket; the large frame of the same stream sent right
    after (by reference or through the ring) must wait until the reader has taken it, and
    the small frames after that wait behind the large one. Every chunk lands whole and in
    the order sent, with its receive posted before or after the frames came."""
    async with shm_pair()(Recorder(), Recorder(), 4 << 20) as (a, b):
        assert isinstance(a, ShmLink)
        assert isinstance(b, ShmLink)
        _sleeping(b)
        chunks = _chunks([16, 1 << 20, 16, 200 << 10, 8, 0])
        landed: list[int] = []
        recvs = _post_all(b, chunks, landed) if posted else []
        for _, header, data in chunks:  # one burst: the reader's loop takes nothing yet
            a.send(header, memoryview(data))
        assert a.frames_on_socket == 1, "only the first frame may go on the socket"
        if not posted:  # every frame arrives and is staged first
            total = sum(len(data) for _, _, data in chunks)
            await _until("every chunk staged", lambda: b.early_bytes == total)
            recvs = _post_all(b, chunks, landed)
        await within("every chunk", asyncio.gather(*(fut for fut, _ in recvs)))
        for (_, buf), (_, _, data) in zip(recvs, chunks, strict=True):
            assert bytes(buf) == data
        if posted:
            assert landed == list(range(len(chunks)))
        await within("the writer to drain", a.drained())
        # with everything taken, the next small frame goes on the socket again
        await _one_frame(a, b, 6, payload(32, 50))
        assert a.frames_on_socket == 2


@pytest.mark.timeout(60)
async def test_a_burst_goes_on_the_socket_up_to_the_limit_then_the_ring() -> None:
    """A burst of small frames before the reader takes any: the first SOCKET_FRAMES_AHEAD go on
    the socket, the rest wait for the ring until the reader has counted those taken; all
    land, in order, with the right bytes."""
    async with shm_pair()(Recorder(), Recorder(), 1 << 20) as (a, b):
        assert isinstance(a, ShmLink)
        assert isinstance(b, ShmLink)
        _sleeping(b)
        count = SOCKET_FRAMES_AHEAD + 36
        chunks = _chunks([40 + i for i in range(count)])
        landed: list[int] = []
        recvs = _post_all(b, chunks, landed)
        for _, header, data in chunks:
            a.send(header, memoryview(data))
        assert a.frames_on_socket == SOCKET_FRAMES_AHEAD
        assert a.write_buffer_size() > 0, "the frames after the limit wait for the ring"
        await within("every frame", asyncio.gather(*(fut for fut, _ in recvs)))
        for (_, buf), (_, _, data) in zip(recvs, chunks, strict=True):
            assert bytes(buf) == data
        assert landed == list(range(count))
        await within("the writer to drain", a.drained())


@pytest.mark.timeout(60)
async def test_a_reader_with_full_staging_stops_the_socket_frames(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frames nobody has posted receives for: once staging is full the reader counts no
    more socket frames taken, so the writer stops at SOCKET_FRAMES_AHEAD and queues the rest for
    the ring (where the paused reader leaves them) instead of piling them into staging;
    posting the receives lets everything through, whole and in order. (The staging limit
    is lowered so that a few frames fill it.)"""
    monkeypatch.setattr(mailbox, "STAGING_LIMIT", 4096)
    async with shm_pair()(Recorder(), Recorder(), 1 << 20) as (a, b):
        assert isinstance(a, ShmLink)
        assert isinstance(b, ShmLink)
        _sleeping(b)
        chunks = _chunks([1000] * (3 * SOCKET_FRAMES_AHEAD))
        for _, header, data in chunks[:8]:  # fills staging (4 KiB) on the socket
            a.send(header, memoryview(data))
        await _until("the first frames staged", lambda: b.early_bytes == 8 * 1000)
        for _, header, data in chunks[8:]:
            a.send(header, memoryview(data))
        assert a.frames_on_socket == SOCKET_FRAMES_AHEAD  # (the reader counted none of them)
        await _until(
            "the socket's frames staged", lambda: b.early_bytes >= SOCKET_FRAMES_AHEAD * 1000
        )
        assert b.early_bytes == SOCKET_FRAMES_AHEAD * 1000, "frames went on after staging was full"
        assert a.write_buffer_size() > 0
        landed: list[int] = []
        recvs = _post_all(b, chunks, landed)
        await within("every frame", asyncio.gather(*(fut for fut, _ in recvs)))
        for (_, buf), (_, _, data) in zip(recvs, chunks, strict=True):
            assert bytes(buf) == data
        await within("the writer to drain", a.drained())


def _malformed(how: str) -> bytes:
    """A byte that is no doorbell, frame or escape; or a socket frame above SOCKET_FRAME_MAX."""
    if how == "byte":
        return b"\x07"
    h = Header(DATA, 1, 0, 1, 99, 0, 0, 0, -1, SOCKET_FRAME_MAX + 1, SOCKET_FRAME_MAX + 1)
    return SOCKET_FRAME + pack_header(h) + bytes(SOCKET_FRAME_MAX + 1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("how", "says"),
    [("byte", "sent byte 0x07 on its socket"), ("huge", f"(at most {SOCKET_FRAME_MAX})")],
)
async def test_malformed_socket_bytes_break_the_group(
    how: str, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A byte that is neither a doorbell, a frame nor an escape, or a socket frame larger
    than SOCKET_FRAME_MAX, is a ProtocolError naming the link: the group breaks on both ranks,
    and no exception escapes into the event loop."""
    cuts = (1, HEADER_SIZE // 2)  # (the frame arrives in pieces)
    res = await run_ranks(
        2, targets.bytes_on_the_socket, _malformed(how), cuts, transport="shm", timeout=10
    )
    kind, detail = res[1]
    assert kind != "no error", res
    assert detail.startswith("ProtocolError: "), res
    assert "rank 0" in detail, res
    assert says in detail, res
    assert res[0][0] != "no error", res
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelname == "ERROR"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("uvloop", [False, True])
async def test_socket_and_ring_frames_mixed_in_processes(
    uvloop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four processes over auto with sleeping readers (as where ranks outnumber cores):
    small and large allreduces, broadcasts and tagged send/recv in flight together, every
    result checked exactly; both ways were used (frames on the socket and by reference
    or through the ring)."""
    monkeypatch.setenv("AIOCOLLECT_SHM_SPIN_US", "0")  # the children inherit it
    res = await spawn_ranks(
        4, targets.socket_and_ring, 12, timeout=200, uvloop=uvloop, transport="auto"
    )
    assert [ok for ok, _, _ in res] == [True] * 4, res
    assert all(on_socket > 0 for _, on_socket, _ in res), res
    assert all(through_ring > 0 for _, _, through_ring in res), res
