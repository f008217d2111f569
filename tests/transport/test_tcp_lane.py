"""The small-frame lane of a TCP link (transport/tcp_link.py), with real processes over
loopback: a link that carries only small frames has none, its first bulk frame (sent by
either rank) brings it up and the next small frame takes it, messages of one (source,
tag) arrive in order whichever connection each took, small ones overtake bulk ones of
other tags, losing the lane breaks the link on both ranks, an ABORT on the lane ends a
receive whose frame is arriving on the link's own connection, ``AIOCOLLECT_TCP_LANES=1``
turns it off, TLS links have one too, a lane that cannot be made (or finds no descriptor
to spare) leaves its link on one connection, and a group whose descriptor limit fits one
connection per link but not two forms and works."""

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
from aiocollect.transport.stream_send import BULK_MIN
from aiocollect.transport.tcp_link import TcpLink, lanes_enabled
from aiocollect.transport.tcp_listener import SocketListener
from aiocollect.transport.wire import HEADER_SIZE
from tests.support.procs import run_script

if TYPE_CHECKING:
    from aiocollect.group import Group

#: Message sizes sent on one tag, in this order: small and bulk interleaved.
SIZES = [1024, 4 << 20, 8, 300_000, 0, 2 << 20, 60_000, 1]


def _lane_of(group: Group, peer: int) -> Any:
    link = group._fabric.links[peer]
    assert isinstance(link, TcpLink)
    return link._lane


async def _until_laned(group: Group, peer: int) -> bool:
    """Whether the link to ``peer`` has its lane within 5 s (it comes once the link first
    carried bulk; the rank that accepted it learns of it last)."""
    for _ in range(500):
        if _lane_of(group, peer) is not None:
            return True
        await asyncio.sleep(0.01)
    return False


async def _bulk(group: Group) -> None:
    """An allreduce of 1 MiB: every link of the ring carries bulk frames."""
    await group.allreduce(np.ones(1 << 18, np.float32))


async def ordered_rank(group: Group) -> dict[str, Any]:
    """Both ranks report whether their link had a lane after small frames only and once
    it carried bulk; then rank 1 sends SIZES on tag 5 (then a large message on tag 1 and
    a small one on tag 2); rank 0 receives them and checks each."""
    peer = 1 - group.rank
    await group.barrier()
    await group.allreduce(np.ones(4, np.float32))
    await group.barrier()
    report: dict[str, Any] = {"small_only": _lane_of(group, peer) is not None}
    await _bulk(group)
    # (with lanes off, no lane is waited for: none comes)
    report["laned"] = await _until_laned(group, peer) if lanes_enabled() else False
    assert report["laned"] or _lane_of(group, peer) is None
    await group.barrier()
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
    assert not any(r["small_only"] for r in reports), reports
    assert reports[0]["small_first"], reports


async def lane_lost_rank(group: Group) -> str:
    """Rank 0 resets its link's lane while both ranks wait for a message: each must fail
    within seconds (the link breaks as if its one connection were lost)."""
    peer = 1 - group.rank
    await _bulk(group)
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
            await _bulk(g)
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
    """Ranks in one process (TCP and TLS): no link has a lane after small operations;
    once an allreduce of 1 MiB ran, every link (all three are on its ring) has its lane,
    messages of a tag arrive in order, and the group closes cleanly (its GOODBYEs came on
    both)."""
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
            await g.barrier()
            await g.allreduce(np.ones(4, np.float32))
            assert all(_lane_of(g, p) is None for p in range(n) if p != rank)
            await g.barrier()  # (no rank sends bulk before every rank looked)
            await _bulk(g)
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


#: Elements per peer of an alltoall whose every block is a bulk frame (128 KiB).
BLOCK = 16384


async def _lazy_alltoall(n: int, name: str) -> list[ac.Group]:
    """Open ``n`` ranks in this process over TCP with links on demand, run an alltoall of
    128 KiB blocks (which links every pair at once, each link carrying bulk) and check
    every rank's result; the groups, open."""
    store = MemoryStore(name)

    async def one(rank: int) -> ac.Group:
        g = await ac.open_group(
            rank, n, store=store, transport="tcp", name=name, links="lazy", timeout=30
        )
        x = np.repeat(np.arange(n, dtype=np.int64) + n * rank, BLOCK)
        out = await g.alltoall(x)
        assert (out == np.repeat(np.arange(n) * n + rank, BLOCK)).all(), rank
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
    """Twelve ranks in one process link every pair at once (an alltoall of bulk blocks
    over links on demand): every result is exact, every link gets its lane, none breaks,
    and nothing is logged at WARNING."""
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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sender", [0, 1])
async def test_the_first_bulk_frame_brings_the_lane_up(sender: int) -> None:
    """Two ranks in one process (rank 1 connected the link, rank 0 accepted it): frames
    below 64 KiB leave the link on one connection; the first frame of 64 KiB, sent by
    either rank, brings its lane up on both, and the next small frame takes it."""
    unique_name = f"lane-first-bulk-{uuid.uuid4().hex[:12]}"
    store = MemoryStore(unique_name)

    async def one(rank: int) -> list[int]:
        async with ac.open_group(
            rank, 2, store=store, transport="tcp", name=unique_name, links="eager", timeout=30
        ) as g:
            peer = 1 - rank
            link = g._fabric.links[peer]
            assert isinstance(link, TcpLink)
            for tag, n in enumerate((BULK_MIN - 1, BULK_MIN)):
                await g.barrier()
                assert _lane_of(g, peer) is None, f"a lane before a frame of {n} B"
                if rank == sender:
                    await g.send(np.full(n, 1, np.uint8), peer, tag=tag)
                else:
                    buf = np.empty(n, np.uint8)
                    await g.recv(buf, peer, tag=tag)
                    assert (buf == 1).all()
            assert await _until_laned(g, peer)
            await g.barrier()
            on_lane: list[int] = []
            lane_write = link._lane_write

            def counted(data: bytes) -> None:
                on_lane.append(len(data))
                lane_write(data)

            link._lane_write = counted
            if rank == 1 - sender:  # (the other way now: a small reply)
                await g.send(np.full(8, 2, np.uint8), peer, tag=5)
            else:
                buf = np.empty(8, np.uint8)
                await g.recv(buf, peer, tag=5)
                assert (buf == 2).all()
            return on_lane

    written = await asyncio.gather(*(one(r) for r in range(2)))
    assert written[1 - sender][:1] == [HEADER_SIZE + 8], written  # (then its GOODBYE)


@pytest.mark.timeout(60)
async def test_a_lane_that_cannot_be_dialed_leaves_its_link(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every lane connect is refused: the links carry bulk and small frames on their one
    connection, every result is exact, no link breaks, and it is said at DEBUG only."""

    async def refused(
        self: SocketListener, record: dict[str, Any], handshaker: Any, link: TcpLink
    ) -> Any:
        raise ConnectionRefusedError(111, "refused")

    monkeypatch.setattr(SocketListener, "connect_lane", refused)
    caplog.set_level(logging.DEBUG, logger="aiocollect")
    n = 3
    unique_name = f"lane-refused-{uuid.uuid4().hex[:12]}"
    store = MemoryStore(unique_name)

    async def one(rank: int) -> None:
        async with ac.open_group(
            rank, n, store=store, transport="tcp", name=unique_name, links="eager", timeout=30
        ) as g:
            for _ in range(2):
                x = np.full(1 << 18, rank + 1.0, np.float32)
                await g.allreduce(x)
                assert (x == n * (n + 1) / 2).all()
            y = np.full(4, rank + 1.0)
            await g.allreduce(y)
            assert (y == n * (n + 1) / 2).all()
            assert all(_lane_of(g, p) is None for p in range(n) if p != rank)
            _unbroken([g])

    await asyncio.gather(*(one(r) for r in range(n)))
    assert not _warnings(caplog)
    assert any("no small-frame lane" in r.getMessage() for r in caplog.records)


FD_SCRIPT = """
import asyncio, logging, resource
import numpy as np
import aiocollect as ac
from aiocollect import _fdlimit
from aiocollect.store import MemoryStore

logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
N = 8

async def main() -> None:
    ends = N * (N - 1)  # (both ends of every link are in this process)
    limit = _fdlimit.open_count() + _fdlimit.SPARE + ends + N + 24  # (N listeners)
    assert limit < _fdlimit.open_count() + _fdlimit.SPARE + 2 * ends  # (not two per link)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    store = MemoryStore("fd-lanes")
    groups = await asyncio.gather(*(
        ac.open_group(r, N, store=store, transport="tcp", name="fd-lanes", links="eager",
                      timeout=30)
        for r in range(N)
    ))
    for size in (1 << 18, 4):
        xs = [np.full(size, r + 1.0, np.float32) for r in range(N)]
        await asyncio.gather(*(g.allreduce(x) for g, x in zip(groups, xs)))
        assert all((x == N * (N + 1) / 2).all() for x in xs)
    assert _fdlimit.open_count() <= limit
    lanes = sum(link._lane is not None for g in groups for link in g._fabric.links.values())
    await asyncio.gather(*(g.aclose() for g in groups))
    print("ok" if lanes else "no lane", lanes, flush=True)

asyncio.run(main())
"""


@pytest.mark.timeout(60)
async def test_a_limit_that_fits_one_connection_per_link_forms_and_works() -> None:
    """Eight ranks in one process, the full mesh, under a descriptor limit that fits one
    connection per link but not two: the group forms (the checks count one descriptor per
    link), a 1 MiB allreduce (bulk on the ring) and a small one are exact, and the lanes
    taken (some, in the room beyond ``_fdlimit.SPARE``) stay within the limit."""
    text = await run_script(FD_SCRIPT, 50)
    lines = text.strip().splitlines()
    assert lines, text
    assert lines[-1].startswith("ok"), text
    assert not [line for line in lines if line.startswith("LOG")], text
