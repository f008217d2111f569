"""The small-frame lane of a TCP link (transport/tcp_link.py), with real processes over
loopback: it is set up with the link, messages of one (source, tag) arrive in order
whichever connection each took, small ones overtake bulk ones of other tags, losing the
lane breaks the link on both ranks, an ABORT on the lane ends a receive whose frame is
arriving on the link's own connection, ``AIOCOLLECT_TCP_LANES=1`` turns it off, and TLS
links have one too."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import struct
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.errors import AiocollectError
from aiocollect.store import MemoryStore
from aiocollect.testing.certs import Certs
from aiocollect.testing.spawn import SpawnedRanks
from aiocollect.transport import tcp
from aiocollect.transport.tcp_link import TcpLink
from aiocollect.transport.tcp_listener import SocketListener

if TYPE_CHECKING:
    from aiocollect.group import Group

#: Message sizes sent on one tag, in this order: small and bulk interleaved.
SIZES = [1024, 4 << 20, 8, 300_000, 0, 2 << 20, 60_000, 1]


def _lane_of(group: Group, peer: int) -> Any:
    link = group._fabric.links[peer]
    assert isinstance(link, TcpLink)
    return link._lane


async def _until_laned(group: Group, peer: int) -> bool:
    """Whether the link to ``peer`` has its lane within 5 s (it comes right after the
    link; the rank that accepted it learns of it last)."""
    for _ in range(500):
        if _lane_of(group, peer) is not None:
            return True
        await asyncio.sleep(0.01)
    return False


async def ordered_rank(group: Group) -> dict[str, Any]:
    """Rank 1 sends SIZES on tag 5 (then a large message on tag 1 and a small one on tag
    2); rank 0 receives them and checks each; both report whether the link is laned."""
    peer = 1 - group.rank
    await group.barrier()
    laned = await _until_laned(group, peer)
    await group.barrier()
    report: dict[str, Any] = {"laned": laned}
    if group.rank == 1:
        for i, n in enumerate(SIZES):
            await group.send(np.full(n, i, np.uint8), 0, tag=5)
        big = group.send(np.full(64 << 20, 9, np.uint8), 0, tag=1)
        await group.send(np.full(16, 7, np.uint8), 0, tag=2)
        await big
    else:
        for i, n in enumerate(SIZES):
            buf = np.empty(n, np.uint8)
            await group.recv(buf, 1, tag=5)
            assert (buf == i).all(), f"message {i} ({n} bytes) out of order or corrupted"
        big_buf = np.empty(64 << 20, np.uint8)
        small_buf = np.empty(16, np.uint8)
        big_recv = group.recv(big_buf, 1, tag=1)
        await group.recv(small_buf, 1, tag=2)
        report["small_first"] = not big_recv.done()
        await big_recv
        assert (big_buf == 9).all()
        assert (small_buf == 7).all()
    await group.barrier()
    return report


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lanes", ["2", "1"])
async def test_messages_of_a_tag_in_order_small_ones_overtake(
    lanes: str, spawned: Callable[..., SpawnedRanks], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOCOLLECT_TCP_LANES", lanes)
    reports = await spawned(2, ordered_rank, transport="tcp", timeout=50)
    assert [r["laned"] for r in reports] == [lanes == "2"] * 2, reports
    assert reports[0]["small_first"], reports


async def lane_lost_rank(group: Group) -> str:
    """Rank 0 resets its link's lane while both ranks wait for a message: each must fail
    within seconds (the link breaks as if its one connection were lost)."""
    peer = 1 - group.rank
    await group.barrier()
    assert await _until_laned(group, peer)
    await group.barrier()
    pending = group.recv(np.empty(4, np.uint8), peer, tag=3, timeout=30)
    if group.rank == 0:
        await asyncio.sleep(0.05)  # (both receives posted: the reset is what ends them)
        lane = _lane_of(group, peer)
        lane.transport.abort()
    try:
        async with asyncio.timeout(10):
            await pending
    except AiocollectError as exc:
        return type(exc).__name__
    except TimeoutError:
        return "hung"
    return "received"


@pytest.mark.timeout(60)
async def test_losing_the_lane_breaks_the_link(spawned: Callable[..., SpawnedRanks]) -> None:
    outcomes = await spawned(2, lane_lost_rank, transport="tcp", timeout=50).outcomes()
    results = [o if isinstance(o, str) else type(o).__name__ for o in outcomes]
    assert all(r not in ("hung", "received") for r in results), results


@pytest.mark.timeout(60)
async def test_abort_on_the_lane_ends_a_receive_mid_bulk() -> None:
    """Two ranks in one process, their link laned. Rank 1 receives 64 MiB from rank 0 and
    stops reading the link's own connection while a frame of it is arriving (bulk waiting
    in the kernel's buffers, as behind a slow network); rank 0 then aborts the group. Its
    ABORT comes on the lane, beside the frame that rank 1's receive is reading: that
    receive fails at once (not at its 30 s deadline) with the relayed failure."""
    unique_name = f"lane-abort-{uuid.uuid4().hex[:12]}"
    store = MemoryStore(unique_name)
    paused = asyncio.Event()

    async def one(rank: int) -> BaseException | str:
        async with ac.open_group(
            rank, 2, store=store, transport="tcp", name=unique_name, links="eager", timeout=30
        ) as g:
            assert await _until_laned(g, 1 - rank)
            await g.barrier()
            if rank == 0:
                sending = g.send(np.ones(64 << 20, np.uint8), 1, tag=1)
                await paused.wait()
                g.abort(RuntimeError("gave up mid-bulk"))
                with pytest.raises(AiocollectError):
                    await sending
                return "aborted"
            pending = g.recv(np.empty(64 << 20, np.uint8), 0, tag=1)
            link = g._fabric.links[0]
            assert isinstance(link, TcpLink)
            assert link.transport is not None
            for _ in range(1 << 20):  # loop passes until a frame of it is arriving
                if link._frame_recv is not None:
                    break
                await asyncio.sleep(0)
            assert link._frame_recv is not None
            link.transport.pause_reading()
            paused.set()
            try:
                async with asyncio.timeout(5):
                    await pending
            except AiocollectError as exc:
                return exc
            except TimeoutError:
                return "hung"
            finally:
                link.transport.resume_reading()
            return "received"

    _, outcome = await asyncio.gather(*(one(r) for r in range(2)))
    assert isinstance(outcome, ac.GroupBrokenError), repr(outcome)
    assert "gave up mid-bulk" in str(outcome), outcome


def test_descriptor_count_includes_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiocollect import _fdlimit

    monkeypatch.setenv("AIOCOLLECT_TCP_LANES", "1")
    assert _fdlimit.descriptors_per_link() == 1
    monkeypatch.delenv("AIOCOLLECT_TCP_LANES")
    assert _fdlimit.descriptors_per_link() == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "tls"])
async def test_in_process_ranks_lane_their_links(transport: str, certs: Certs) -> None:
    """Ranks in one process (TCP and TLS): every link has its lane, messages of a tag
    arrive in order, and the group closes cleanly (its GOODBYEs came on both)."""
    n = 3
    unique_name = f"lane-{uuid.uuid4().hex[:12]}"
    store = MemoryStore(unique_name)

    async def one(rank: int) -> list[bool]:
        async with ac.open_group(
            rank,
            n,
            store=store,
            transport=transport,
            name=unique_name,
            ssl=certs.config(rank) if transport == "tls" else None,
            links="eager",
            timeout=30,
        ) as g:
            laned = [await _until_laned(g, p) for p in range(n) if p != rank]
            dst, src = (rank + 1) % n, (rank - 1) % n
            sends = [g.send(np.full(k, i, np.uint8), dst, tag=4) for i, k in enumerate(SIZES)]
            for i, k in enumerate(SIZES):
                buf = np.empty(k, np.uint8)
                await g.recv(buf, src, tag=4)
                assert (buf == i).all(), f"message {i} ({k} bytes) out of order or corrupted"
            await asyncio.gather(*sends)
            return laned

    results = await asyncio.gather(*(one(r) for r in range(n)))
    assert all(all(r) for r in results), results


async def _lazy_alltoall(n: int, name: str) -> list[ac.Group]:
    """Open ``n`` ranks in this process over TCP with links on demand, run an alltoall
    (which links every pair at once) and check every rank's result; the groups, open."""
    store = MemoryStore(name)

    async def one(rank: int) -> ac.Group:
        g = await ac.open_group(
            rank, n, store=store, transport="tcp", name=name, links="lazy", timeout=30
        )
        out = await g.alltoall(np.arange(n, dtype=np.int64) + n * rank)
        assert (out == np.arange(n) * n + rank).all(), (rank, out)
        return g

    return list(await asyncio.gather(*(one(r) for r in range(n))))


def _unbroken(groups: list[ac.Group]) -> None:
    """Every rank's links are all open (none broke)."""
    for g in groups:
        for link in _stream_links(g):
            peer = link.peer
            assert not link.closed, f"rank {g.rank}: the link to {peer} closed"
            assert not link.lost, f"rank {g.rank}: the link to {peer} broke"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What was logged at WARNING or above (a lane given up must say nothing there; nor
    may a future's exception go unretrieved)."""
    gc.collect()  # (an unretrieved future's exception is logged when it is collected)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.timeout(60)
async def test_a_lane_given_up_after_the_welcome_leaves_its_link(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Links on demand: the lanes dialed to rank 0 are given up right after rank 0
    welcomed them, as a lane connect that timed out then: rank 1's reset, the others'
    closed. Rank 0 never took them, so no link breaks, not even once a lane closed by its
    peer has lingered (shortened here to 0.2 s); those links carry on over their one
    connection, the others are laned, every result is exact, and nothing is logged at
    WARNING."""
    n = 4
    real = SocketListener.connect_lane

    async def giving_up(
        self: SocketListener, record: dict[str, Any], handshaker: Any, link: TcpLink
    ) -> Any:
        lane = await real(self, record, handshaker, link)
        if record["rank"] == 0:
            if link.peer == 0 and self.setup.rank == 1:  # (a reset, not a close)
                assert lane.transport is not None
                sock = lane.transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            lane.abort()
            raise TimeoutError
        return lane

    monkeypatch.setattr(SocketListener, "connect_lane", giving_up)
    monkeypatch.setattr(tcp, "LINGER", 0.2)
    caplog.set_level(logging.DEBUG, logger="aiocollect")
    groups = await _lazy_alltoall(n, f"lane-given-up-{uuid.uuid4().hex[:12]}")
    try:
        for g in groups[1:]:  # (those of rank 0 are laned where rank 0 dialed them)
            laned = [await _until_laned(g, p) for p in range(1, n) if p != g.rank]
            assert all(laned), (g.rank, laned)
        ends = [asyncio.ensure_future(link.gone.wait()) for link in _stream_links(groups[0])]
        done, _ = await asyncio.wait(ends, timeout=1.0)  # (five times the linger)
        for end in ends:
            end.cancel()
        assert not done, "a link of rank 0 ended"
        x = [np.full(1, g.rank, np.int64) for g in groups]
        await asyncio.gather(*(g.allreduce(v) for g, v in zip(groups, x, strict=True)))
        assert all(v[0] == n * (n - 1) // 2 for v in x)
        _unbroken(groups)
    finally:
        await asyncio.gather(*(g.aclose() for g in groups))
    assert not _warnings(caplog)
    assert any("no small-frame lane" in r.getMessage() for r in caplog.records)


def _stream_links(group: ac.Group) -> list[TcpLink]:
    links = list(group._fabric.links.values())
    assert all(isinstance(link, TcpLink) for link in links)
    return links  # type: ignore[return-value]


@pytest.mark.timeout(60)
async def test_lazy_alltoall_lanes_every_link(caplog: pytest.LogCaptureFixture) -> None:
    """Twelve ranks in one process link every pair at once (an alltoall over links on
    demand): every result is exact, every link gets its lane, none breaks, and nothing is
    logged at WARNING."""
    n = 12
    caplog.set_level(logging.WARNING)
    groups = await _lazy_alltoall(n, f"lane-lazy-{uuid.uuid4().hex[:12]}")
    try:
        for g in groups:
            laned = [await _until_laned(g, p) for p in range(n) if p != g.rank]
            assert all(laned), (g.rank, laned)
        await asyncio.gather(*(g.barrier() for g in groups))
        _unbroken(groups)
    finally:
        await asyncio.gather(*(g.aclose() for g in groups))
    assert not _warnings(caplog)
