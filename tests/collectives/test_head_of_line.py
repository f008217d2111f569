"""Small frames overtake queued bulk frames on a TCP link (head-of-line blocking), bulk
bytes handed to the transport stay near ``stream_send.BULK_CAP``, and the frames of one stream
keep their order. Real links over loopback (``run_ranks`` with ``transport="tcp"``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks
from aiocollect.transport import sockets, stream_send
from aiocollect.transport.base import SendMark
from aiocollect.transport.wire import HEADER, MAGIC, P2P

pytestmark = pytest.mark.timeout(120)

BIG = 32 * 1024 * 1024  # bytes per rank of the allreduce


def _watch(link: Any) -> dict[str, Any]:
    """Wrap ``link.send`` to record the transport's buffer after each bulk write and
    whether small frames went out while bulk frames were queued."""
    seen: dict[str, Any] = {"max_transport": 0, "overtook": 0}
    real = link.send

    def send(header: bytes, payload: Any) -> SendMark:
        queued = bool(link._bulk)
        before = len(link._bulk)
        mark = real(header, payload)
        if len(payload) < stream_send.BULK_MIN and queued and len(link._bulk) == before:
            seen["overtook"] += 1
        seen["max_transport"] = max(seen["max_transport"], link.transport.get_write_buffer_size())
        return mark  # type: ignore[no-any-return]

    link.send = send
    return seen


async def _pings_during_allreduce(
    g: ac.Group, ahead: asyncio.Event | None = None
) -> dict[str, Any]:
    """Rank 0 sends 1 KiB pings (rank 1 answers each) while the allreduce runs; a ping
    of -1 ends them. With ``ahead``, the pings start once it is set (bulk frames held),
    else on the loop's next turn."""
    seen = _watch(g._fabric.links[1 - g.rank])
    data = np.full(BIG // 4, g.rank + 1, dtype=np.float32)
    # the ring: the cap is about bulk frames queued on a link, which the ring sends (the
    # default over shared memory with pulls, the pull allreduce, sends none)
    bulk = asyncio.ensure_future(g.allreduce(data, algorithm="ring"))
    msg = np.empty(256, dtype=np.float32)
    pings = 0
    during = 0
    if ahead is None:
        await asyncio.sleep(0)  # the allreduce's first sends are queued
    else:
        await ahead.wait()
    if g.rank == 0:
        while not bulk.done() and pings < 20:
            msg.fill(pings)
            await g.send(msg, 1, tag=3)
            await g.recv(msg, 1, tag=3)
            assert np.all(msg == pings + 0.5)
            pings += 1
            during += not bulk.done()  # this round trip ended with the allreduce running
        msg.fill(-1)
        await g.send(msg, 1, tag=3)
    else:
        while True:
            await g.recv(msg, 0, tag=3)
            if msg[0] == -1:
                break
            msg += 0.5
            await g.send(msg, 0, tag=3)
            pings += 1
    await bulk
    assert np.all(data == 3.0)
    return {**seen, "pings": pings, "during": during}


async def test_small_send_recv_completes_while_a_large_allreduce_is_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Small kernel buffers, so that the sender queues in user space at once.
    monkeypatch.setattr(sockets, "LOCAL_SOCKET_BUFFER", 256 * 1024)
    res = await run_ranks(2, _pings_during_allreduce, transport="tcp", timeout=100)
    for r in res:
        # bulk bytes in the transport: at most the cap plus one frame (header, 1 MiB chunk)
        assert r["max_transport"] <= stream_send.BULK_CAP + (1 << 20) + 4096, r
    assert res[0]["pings"] >= 1, res
    assert res[1]["pings"] == res[0]["pings"], res
    assert any(r["overtook"] for r in res), res


def _header(seq: int, slot: int, chunk: int, length: int) -> bytes:
    return HEADER.pack(MAGIC, P2P, 0, 0, 0, 0, chunk, seq, slot, 0, length, length)


async def _stream_order(g: ac.Group) -> list[str]:
    link = g._fabric.links[1 - g.rank]
    big = 1024 * 1024  # the largest frame a link accepts (the chunk size)
    small = 1024
    frames = [(f"a{i}", 900, 1, i, big) for i in range(8)]
    frames += [
        ("a8", 900, 1, 8, small),  # same stream as the a's: must stay behind them
        ("b", 901, 2, 0, small),
    ]  # another stream: may overtake
    if g.rank == 1:
        order: list[str] = []
        futs = []
        for name, seq, slot, chunk, n in frames:
            buf = memoryview(bytearray(n))
            fut = link.post_recv((P2P, 0, seq, slot, chunk), buf)  # type: ignore[arg-type]
            fut.add_done_callback(
                lambda _f, name=name, buf=buf: order.append(  # type: ignore[misc]
                    name if bytes(buf[:8]) == name.encode().ljust(8, b".") else name + "!"
                )
            )
            futs.append(fut)
        await g.barrier()
        await asyncio.gather(*futs)
        return order
    await g.barrier()
    queued = []
    payloads = []
    for name, seq, slot, chunk, n in frames:
        payload = bytearray(n)
        payload[:8] = name.encode().ljust(8, b".")
        payloads.append(payload)
        link.send(_header(seq, slot, chunk, n), memoryview(payload))
        queued.append(
            any(h[2] == P2P and bytes(p[:2]) == name.encode()[:2] for h, p, _ in link._bulk)  # type: ignore[attr-defined]
        )
    assert queued[8], "a frame of a stream with queued bulk frames went ahead of them"
    assert not queued[9], "a small frame of another stream waited behind bulk frames"
    await link.drained()
    return []


async def test_frames_of_one_stream_keep_their_order_others_overtake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sockets, "LOCAL_SOCKET_BUFFER", 256 * 1024)
    res = await run_ranks(2, _stream_order, transport="tcp", timeout=60)
    order = res[1]
    assert not any(o.endswith("!") for o in order), order
    assert [o for o in order if o.startswith("a")] == [f"a{i}" for i in range(9)]
    assert order.index("b") < order.index("a7"), order


@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_round_trips_complete_during_bulk_allreduces_in_processes(transport: str) -> None:
    """Real processes (the measurement of ``aiocollect.bench.hol_ranks`` on a small scale): 1 KiB
    round trips between ranks 0 and 1 complete while allreduces of 16 MiB run, and every
    allreduce is correct (``hol_rank`` checks nothing itself: the group would break)."""
    from aiocollect.bench.hol_ranks import hol_rank
    from aiocollect.testing import spawn_ranks

    res = await spawn_ranks(
        2, hol_rank, 16 << 20, 4, 1024, 20, timeout=100, transport=transport, uvloop=True
    )
    report = res[0]
    assert report["idle_rtt_us"]["n"] == 20
    assert report["loaded_rtt_us"]["n"] >= 1, report
    assert report["busbw_gbps_alone"] > 0
    assert report["busbw_gbps_with_pings"] > 0


def _watch_shm(link: Any, holds: asyncio.Event) -> dict[str, Any]:
    """Like ``_watch`` for a shared-memory link: the bulk bytes ahead in the ring (unread,
    queued for it, or referenced and not pulled) after each frame, and small frames that
    went ahead of held bulk frames; ``holds`` is set once the link holds a frame."""
    seen: dict[str, Any] = {"max_ahead": 0, "overtook": 0, "held": 0}
    real = link.send

    def send(header: bytes, payload: Any) -> SendMark:
        held = len(link._held)
        mark = real(header, payload)
        seen["held"] = max(seen["held"], len(link._held))
        if link._held:
            holds.set()
        if len(payload) < stream_send.BULK_MIN and held and len(link._held) == held:
            seen["overtook"] += 1
        seen["max_ahead"] = max(seen["max_ahead"], link._bulk_ahead())
        return mark  # type: ignore[no-any-return]

    link.send = send
    return seen


@dataclass
class _Behind:
    """Rank 1 falls behind rank 0: it reads nothing (``paused``) until rank 0's link holds
    a bulk frame (``held``)."""

    paused: asyncio.Event = field(default_factory=asyncio.Event)
    held: asyncio.Event = field(default_factory=asyncio.Event)


async def _shm_pings(g: ac.Group, behind: _Behind) -> dict[str, Any]:
    """``_pings_during_allreduce`` with rank 1 behind: its link leaves every frame in the
    ring (the pause its staging cap sets, ``_rx_paused``) until rank 0 holds bulk frames,
    which it then does whatever the load (its allreduce sends two frames or more ahead of
    any receive, and the first fills the cap); rank 0's first ping goes out then, ahead
    of them, before rank 1 reads on (``_staging_relieved``: on the loop's next turn)."""
    link = g._fabric.links[1 - g.rank]
    assert link.shm  # type: ignore[attr-defined]
    seen = _watch_shm(link, behind.held)
    if g.rank == 1:
        link._rx_paused = True  # type: ignore[attr-defined]
        behind.paused.set()
        # bounded: rank 0 failing before it holds anything must not hang the test
        await asyncio.wait_for(behind.held.wait(), 60)
        link._staging_relieved()
    else:
        await asyncio.wait_for(behind.paused.wait(), 60)
    res = await _pings_during_allreduce(g, behind.held)
    return {**res, **seen}


@pytest.mark.parametrize("pull", ["", "0"])
async def test_shm_bulk_ahead_is_capped_and_small_frames_overtake(
    pull: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over shared memory (pulls on and off) with the cap set, a 32 MiB allreduce keeps at
    most the cap plus one frame ahead in the ring, holds the rest while the peer is behind
    (made so: ``_shm_pings``), and the pings go ahead of it."""
    monkeypatch.setenv("AIOCOLLECT_SHM_PULL", pull)
    monkeypatch.setenv("AIOCOLLECT_SHM_BULK_CAP", str(stream_send.BULK_CAP))  # off by default
    res = await run_ranks(2, _shm_pings, _Behind(), transport="shm", timeout=100)
    for r in res:
        assert r["max_ahead"] <= stream_send.BULK_CAP + (1 << 20) + 4096, repr(r)
    assert res[0]["held"], res  # (a rank whose peer keeps up holds nothing)
    assert res[0]["pings"] >= 1, res
    assert res[1]["pings"] == res[0]["pings"], res
    assert res[0]["overtook"], res


async def _shm_default(g: ac.Group) -> int:
    link = g._fabric.links[1 - g.rank]
    seen = _watch_shm(link, asyncio.Event())
    data = np.ones((8 << 20) // 4, dtype=np.float32)
    await g.allreduce(data)
    assert np.all(data == 2.0)
    return int(seen["held"])


async def test_shm_holds_nothing_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIOCOLLECT_SHM_BULK_CAP", raising=False)
    assert await run_ranks(2, _shm_default, transport="shm", timeout=60) == [0, 0]
