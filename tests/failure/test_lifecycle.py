"""Lifecycle: opening and closing leaks nothing; abort, graceful close and cancellation
behave as the contract says on every rank; timeouts name the right ranks; a new group can
follow a broken one on the same store.

Ranks run in-process over TCP unless noted; peers that must be "slow" wait on a store key
(never a sleep), so every ordering below is forced, not hoped for.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.store import MemoryStore, Store, TCPStoreServer, open_store
from aiocollect.testing import free_port, links_settled, run_ranks, spawn_ranks
from tests.support.targets import failure as targets

pytestmark = pytest.mark.timeout(120)

GROUP_TIMEOUT = 60.0  # long: a prompt failure below is never a timeout in disguise
PROMPT = 1.0  # "promptly": the contract's ABORT relay, one round trip on loopback
SLACK = 5.0  # generous bound for work that merely has to finish on a noisy machine
#: Open/close cycles of the leak tests. A leak in every cycle shows in the first (the counts
#: must come back exactly); the cycles are for one that happens now and then. ``make test``
#: runs 100 on each loop; ``make stress`` (AIOCOLLECT_STRESS=full) 500.
CYCLES = 500 if os.environ.get("AIOCOLLECT_STRESS") == "full" else 100


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tasks() -> int:
    return len(asyncio.all_tasks())


async def _settled(baseline: tuple[int, int], limit: float = SLACK) -> tuple[int, int]:
    """fd and task counts once closing sockets have finished closing (asyncio closes a
    transport a loop iteration or a peer FIN after close()); waits at most ``limit`` s for
    them to fall to ``baseline``."""
    deadline = time.monotonic() + limit
    while True:
        gc.collect()
        now = (_fds(), _tasks())
        if _within(now, baseline) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.01)


def _within(now: tuple[int, int], baseline: tuple[int, int]) -> bool:
    """No more fds and no more tasks than at the start (fewer is fine: the baseline may
    still have held a socket of the warm-up round that was closing)."""
    return now[0] <= baseline[0] and now[1] <= baseline[1]


async def _allreduce_one(g: ac.Group) -> float:
    buf = np.array([g.rank + 1.0, 2.0])
    await g.allreduce(buf)
    return float(buf[0])


async def _run(
    n: int,
    body: Callable[[ac.Group, Store], Awaitable[Any]],
    *,
    name: str,
    store: Store | None = None,
    **options: Any,
) -> list[Any]:
    """Open an n-rank TCP group in-process and run ``body(group, store)`` on every rank;
    exceptions are returned, not raised. The group is left to ``body`` to close (else it
    is aborted)."""
    store = store or MemoryStore(name)
    options.setdefault("timeout", GROUP_TIMEOUT)

    groups: list[ac.Group] = []

    async def one(rank: int) -> Any:
        g = await ac.open_group(rank, n, store=store, transport="tcp", name=name, **options)
        groups.append(g)
        try:
            return await body(g, store)
        finally:
            if not g.closed:
                g.abort()

    out = list(await asyncio.gather(*(one(r) for r in range(n)), return_exceptions=True))
    await links_settled(groups)
    return out


# == no leaks ================================================================================


@pytest.mark.both_loops
@pytest.mark.timeout(300)
async def test_open_close_cycles_leak_no_fds_or_tasks() -> None:
    """CYCLES open/allreduce/close cycles of a two-rank TCP group on one loop: the process
    ends with exactly the file descriptors and tasks it started with."""
    await run_ranks(2, _allreduce_one, transport="tcp", timeout=GROUP_TIMEOUT)  # warm up
    baseline = await _settled((_fds(), _tasks()))
    for _ in range(CYCLES):
        assert await run_ranks(2, _allreduce_one, transport="tcp", timeout=GROUP_TIMEOUT) == [
            3.0,
            3.0,
        ]
    final = await _settled(baseline)
    assert _within(final, baseline), f"(fds, tasks): {baseline} before, {final} after"


async def test_cycles_with_tcp_store_and_secret_leak_nothing() -> None:
    """The same with the embedded TCP store (a server and client connections per cycle)
    and authentication. Each cycle takes a fresh port for its store: one port reused for
    all cycles lies free between them, and a listener of a test running beside this one
    (bound to port 0) once got it, so rank 0 dialled that listener as if it were a running
    store (CI at 13f9c5e: "store message of 939524096 bytes exceeds the limit")."""

    async def cycle() -> None:
        store = f"tcp://127.0.0.1:{free_port()}"
        assert await run_ranks(
            2, _allreduce_one, transport="tcp", store=store, secret="s", timeout=GROUP_TIMEOUT
        ) == [3.0, 3.0]

    await cycle()
    baseline = await _settled((_fds(), _tasks()))
    for _ in range(100):
        await cycle()
    final = await _settled(baseline)
    assert _within(final, baseline), f"(fds, tasks): {baseline} before, {final} after"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("transport", "uvloop"), [("auto", True), ("auto", False), ("tcp", True), ("tcp", False)]
)
async def test_no_connection_outlives_aclose(transport: str, uvloop: bool) -> None:
    """Four real processes close their group and at once their event loop (warnings are
    errors there): every link has ended when ``aclose`` returns, so uvloop closes (it
    refused with EBUSY while a link's half-closed connection waited for its peer's end)."""
    res = await spawn_ranks(
        4, targets.open_after_close, timeout=100, transport=transport, uvloop=uvloop
    )
    assert res == [[]] * 4


async def test_failure_cycles_leak_nothing(unique_name: str) -> None:
    """Groups that end broken (one rank aborts while the other waits in an allreduce)
    release everything too."""

    async def body(g: ac.Group, store: Store) -> str:
        if g.rank == 0:
            await store.wait([f"{g.name}/waiting"], timeout=SLACK)
            g.abort()
            return "aborted"
        handle = g.allreduce(np.ones(4))
        await store.set(f"{g.name}/waiting", b"1")
        with pytest.raises(ac.GroupBrokenError):
            await handle
        await g.aclose()
        return "broken"

    async def cycle(i: int) -> None:
        assert await _run(2, body, name=f"{unique_name}-{i}") == ["aborted", "broken"]

    await cycle(-1)
    baseline = await _settled((_fds(), _tasks()))
    for i in range(100):
        await cycle(i)
    final = await _settled(baseline)
    assert _within(final, baseline), f"(fds, tasks): {baseline} before, {final} after"


# == abort ===================================================================================


async def test_abort_returns_at_once_and_fails_everyone_promptly(unique_name: str) -> None:
    """abort() is synchronous and immediate; this rank's pending handles fail with
    GroupBrokenError, and so do the peers' — by the ABORT frame, not a timeout."""
    n = 3
    aborted_at: list[float] = []

    async def body(g: ac.Group, store: Store) -> dict[str, Any]:
        if g.rank == 0:
            pending: list[asyncio.Future[Any]] = [
                g.allreduce(np.ones(1 << 16)),  # the peers never call it
                g.recv(np.zeros(4), 1, tag=3),
            ]  # never sent
            await store.wait([f"posted/{r}" for r in range(1, n)], timeout=SLACK)
            t0 = time.monotonic()
            g.abort()
            aborted_at.append(time.monotonic())
            results = await asyncio.wait_for(
                asyncio.gather(*pending, return_exceptions=True),
                SLACK,
            )
            with pytest.raises(ac.UsageError, match="closed"):
                g.barrier()
            g.abort()  # idempotent
            await g.aclose()  # a no-op after abort
            return {"abort_s": aborted_at[0] - t0, "errors": [type(e).__name__ for e in results]}
        handle = g.recv(np.zeros(4), 0, tag=9)  # pending when rank 0 aborts
        await store.set(f"posted/{g.rank}", b"1")
        with pytest.raises(ac.GroupBrokenError) as info:
            await handle
        return {"after_abort_s": time.monotonic() - aborted_at[0], "message": str(info.value)}

    out = await _run(n, body, name=unique_name)
    assert out[0]["abort_s"] < 0.5, out[0]  # synchronous: waits for no peer and no I/O
    assert out[0]["errors"] == ["GroupBrokenError", "GroupBrokenError"]
    for peer in out[1:]:
        assert peer["after_abort_s"] < PROMPT, peer
        assert "rank 0 aborted" in peer["message"], peer


async def test_abort_in_the_middle_of_a_large_allreduce(unique_name: str) -> None:
    """Aborting while chunks are moving on every link: everyone fails promptly."""
    n = 3
    aborted_at: list[float] = []

    async def body(g: ac.Group, store: Store) -> float:
        handle = g.allreduce(np.ones(4 << 20, np.float32), algorithm="ring")
        if g.rank == 0:
            # abort mid-transfer: only the link counters tell that chunks are moving
            while not g.statistics()["links"][2]["bytes_received"]:  # noqa: ASYNC110
                await asyncio.sleep(0)  # let our own reader run: data is moving
            g.abort()
            aborted_at.append(time.monotonic())
        with pytest.raises(ac.GroupBrokenError):
            await handle
        return time.monotonic() - aborted_at[0]

    out = await _run(n, body, name=unique_name)
    assert all(isinstance(s, float) and s < PROMPT for s in out), out


# == graceful close ==========================================================================


async def test_aclose_waits_for_operations_in_flight(
    unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 starts two operations and closes at once; its aclose() waits for them, which
    need rank 1, which only starts after rank 0 began closing. Nobody sees an error."""
    caplog.set_level(logging.INFO, "aiocollect")
    data = np.arange(1 << 18, dtype=np.float64)

    async def body(g: ac.Group, store: Store) -> dict[str, Any]:
        big, small = data.copy() * (g.rank + 1), np.full(7, g.rank, np.int32)
        if g.rank == 0:
            handles = [g.allreduce(big), g.broadcast(small, root=1)]
            closing = asyncio.ensure_future(g.aclose())
            await asyncio.sleep(0)
            assert not closing.done()
            await store.set("rank0-closing", b"1")
            await asyncio.wait_for(closing, SLACK)
            assert all(h.done() and h.exception() is None for h in handles)  # type: ignore[attr-defined]
        else:
            await store.wait(["rank0-closing"], timeout=SLACK)
            await g.allreduce(big)
            await g.broadcast(small, root=1)
            await g.aclose()
        return {
            "big_ok": bool((big == data * 3).all()),
            "small": small.tolist(),
            "broken": g.statistics()["broken"],
        }

    out = await _run(2, body, name=unique_name)
    for res in out:
        assert res == {"big_ok": True, "small": [1] * 7, "broken": False}, out
    noise = [
        r.message for r in caplog.records if r.levelno >= logging.INFO and "broken" in r.message
    ]
    assert not noise, noise


async def test_aclose_timeout_cancels_what_cannot_finish(unique_name: str) -> None:
    """aclose(timeout=) gives up on operations that cannot complete (the peer never calls
    them): they are cancelled, aclose() itself returns without raising."""

    async def body(g: ac.Group, store: Store) -> str:
        if g.rank == 0:
            handle = g.allreduce(np.ones(8))
            t0 = time.monotonic()
            await g.aclose(timeout=0.5)
            assert time.monotonic() - t0 < SLACK
            assert handle.cancelled()
            await store.set("closed", b"1")
            return "closed"
        await store.wait(["closed"], timeout=SLACK)
        await g.aclose()
        return "closed"

    assert await _run(2, body, name=unique_name) == ["closed", "closed"]


# == cancellation ============================================================================


async def test_cancel_with_data_in_flight_breaks_the_group_everywhere(unique_name: str) -> None:
    """Rank 0 cancels a large allreduce once its first chunks left; rank 1 (in the same
    allreduce) and rank 2 (slow: it had not called it yet) get GroupBrokenError promptly."""
    n = 3
    cancelled_at: list[float] = []

    async def body(g: ac.Group, store: Store) -> dict[str, Any]:
        buf = np.ones(4 << 20, np.float32)
        if g.rank == 2:
            await store.wait(["go"], timeout=SLACK)
            try:
                await g.allreduce(buf)  # raises at the call or from the handle
            except ac.GroupBrokenError as exc:
                return {"s": time.monotonic() - cancelled_at[0], "error": exc}
            return {"error": None}
        handle = g.allreduce(buf, algorithm="ring")
        if g.rank == 1:
            with pytest.raises(ac.GroupBrokenError) as info:
                await handle
            return {"s": time.monotonic() - cancelled_at[0], "error": info.value}
        # cancel mid-transfer: only the link counters tell that chunks have left
        while not g.statistics()["links"][1]["bytes_sent"]:  # noqa: ASYNC110
            await asyncio.sleep(0)  # our own task runs until its first chunks left
        handle.cancel()
        cancelled_at.append(time.monotonic())
        await store.set("go", b"1")
        with pytest.raises(asyncio.CancelledError):
            await handle
        with pytest.raises(ac.GroupBrokenError) as later:
            g.barrier()
        return {"s": 0.0, "error": later.value}

    out = await _run(n, body, name=unique_name)
    for rank, res in enumerate(out):
        assert isinstance(res, dict), (rank, res)
        assert isinstance(res["error"], ac.GroupBrokenError), (rank, res)
        assert res["s"] < PROMPT, (rank, res)
        assert "cancelled on rank 0 with data in flight" in str(res["error"]), (rank, res)


async def test_cancel_before_any_byte_moved_keeps_the_group(unique_name: str) -> None:
    """Every rank cancels the same operation right after calling it (before its task ran;
    a ring allreduce runs as a Task, whose first step is on the next loop pass): nothing
    moved, nothing breaks, and the next operation works (its sequence number is the next
    one on every rank). A one-frame operation sends in the call: test_small_path."""

    async def body(g: ac.Group, store: Store) -> list[float]:
        handle = g.allreduce(np.ones(1000), algorithm="ring")
        handle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle
        assert not g.statistics()["broken"]
        buf = np.full(1000, g.rank + 1.0)
        await g.allreduce(buf)
        await g.aclose()
        return [float(buf[0]), g.statistics()["ops"]["allreduce_completed"]]

    assert await _run(2, body, name=unique_name) == [[3.0, 1], [3.0, 1]]


async def test_cancel_only_on_one_rank_leaves_the_peer_waiting_until_its_deadline(
    unique_name: str,
) -> None:
    """Rank 0 cancels before any byte moved: its group stays usable, but rank 1's matching
    operation (it did send) waits for rank 0 until its deadline, then names it — and that
    timeout breaks the group on both ranks (rank 0's pending operation fails with the
    PeerTimeout rank 1 relayed)."""

    async def body(g: ac.Group, store: Store) -> Any:
        if g.rank == 0:  # (a ring allreduce: a Task, started on the next loop pass)
            handle = g.allreduce(np.ones(16), algorithm="ring")
            handle.cancel()
            with pytest.raises(asyncio.CancelledError):
                await handle
            assert not g.statistics()["broken"]
            await store.set("cancelled", b"1")
            with pytest.raises(ac.PeerTimeout) as info:
                await g.recv(np.zeros(1), 1, tag=1)  # pending until rank 1's ABORT
            return info.value
        await store.wait(["cancelled"], timeout=SLACK)
        t0 = time.monotonic()
        with pytest.raises(ac.PeerTimeout) as timeout:
            await g.allreduce(np.ones(16), algorithm="ring", timeout=1.0)
        return time.monotonic() - t0, timeout.value

    relayed, (elapsed, timeout) = await _run(2, body, name=unique_name)
    assert timeout.ranks == [0], timeout
    assert "ranks [0] sent nothing" in str(timeout), timeout
    assert 1.0 <= elapsed < SLACK, elapsed
    assert isinstance(relayed, ac.PeerTimeout), relayed
    assert "rank 1 aborted the group" in str(relayed), relayed
    assert relayed.ranks == [0], relayed


async def test_cancelled_recv_keeps_its_place_in_the_message_order(unique_name: str) -> None:
    """A recv(src=...) cancelled before its message arrived does not break the group; it
    still took its place in the (source, tag) order, so the message sent for it is never
    delivered and the next recv gets the next message. (recv(src=None) claims a message
    only once one arrives: cancelling it skips nothing.)"""

    async def body(g: ac.Group, store: Store) -> Any:
        if g.rank == 0:
            handle = g.recv(np.zeros(1), 1, tag=5)
            await asyncio.sleep(0)  # posted
            handle.cancel()
            with pytest.raises(asyncio.CancelledError):
                await handle
            anyone = g.recv(np.zeros(1), None, tag=6)
            await asyncio.sleep(0)
            anyone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await anyone
            assert not g.statistics()["broken"]
            await store.set("cancelled", b"1")
            first, second = np.zeros(1), np.zeros(1)
            await g.recv(first, 1, tag=5)
            await g.recv(second, None, tag=6)
            await g.barrier()
            await g.aclose()
            return float(first[0]), float(second[0])
        await store.wait(["cancelled"], timeout=SLACK)
        for value in (1.0, 2.0):
            await g.send(np.array([value]), 0, tag=5)
        await g.send(np.array([3.0]), 0, tag=6)
        await g.barrier()
        await g.aclose()
        return None

    assert (await _run(2, body, name=unique_name))[0] == (2.0, 3.0)


# == timeouts ================================================================================


async def test_per_call_timeout_overrides_the_group_default(unique_name: str) -> None:
    """Shorter than the group's: PeerTimeout at the call's deadline naming the silent rank.
    Longer than the group's: the operation may outlast the group default."""

    async def short(g: ac.Group, store: Store) -> Any:
        if g.rank == 0:
            t0 = time.monotonic()
            with pytest.raises(ac.PeerTimeout) as info:
                await g.allreduce(np.ones(8), timeout=0.5)
            await store.set("timed-out", b"1")
            return time.monotonic() - t0, info.value
        await store.wait(["timed-out"], timeout=SLACK)  # never calls the allreduce
        with pytest.raises(ac.GroupBrokenError) as broken:
            g.barrier()
        return broken.value

    (elapsed, exc), later = await _run(2, short, name=unique_name)  # group default: 60 s
    assert 0.5 <= elapsed < SLACK, elapsed
    assert exc.ranks == [1], exc
    assert exc.rank == 1, exc
    assert "after 0.5 s: ranks [1] have not called it" in str(exc), exc
    assert isinstance(later.__cause__, ac.PeerTimeout), later.__cause__

    async def long(g: ac.Group, store: Store) -> float:
        buf = np.full(8, g.rank + 1.0)
        if g.rank == 1:
            await asyncio.sleep(1.5)  # a slow rank, beyond the group default of 0.5 s
        await g.allreduce(buf, timeout=30)
        await g.aclose()
        return float(buf[0])

    assert await _run(2, long, name=unique_name + "-long", timeout=0.5) == [3.0, 3.0]


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_collective_called_on_one_rank_only(n: int, unique_name: str) -> None:
    """PeerTimeout at the deadline naming the ranks that never joined; the others learn of
    it through the ABORT (GroupBrokenError caused by the same PeerTimeout)."""
    deadline = 1.0

    async def body(g: ac.Group, store: Store) -> Any:
        if g.rank == 0:
            t0 = time.monotonic()
            with pytest.raises(ac.PeerTimeout) as info:
                await g.allreduce(np.ones(1 << 16, np.float32))
            await store.set("failed", b"1")
            return time.monotonic() - t0, info.value
        await store.wait(["failed"], timeout=SLACK)
        with pytest.raises(ac.GroupBrokenError) as broken:
            await g.barrier()
        return broken.value

    out = await _run(n, body, name=unique_name, timeout=deadline)
    elapsed, exc = out[0]
    assert deadline <= elapsed < deadline + SLACK, elapsed
    assert exc.ranks == list(range(1, n)), str(exc)
    assert f"ranks {list(range(1, n))} have not called it" in str(exc), str(exc)
    for later in out[1:]:
        assert isinstance(later.__cause__, ac.PeerTimeout), later.__cause__


# == recovery ================================================================================


async def test_new_group_with_a_new_name_after_a_failure() -> None:
    """One rank aborts instead of joining an allreduce; the survivors see GroupBrokenError;
    then every rank opens a new group (new name) on the same TCP store and works. (A rank
    that aborted just after its call may already have sent its frame: a one-frame
    operation sends in the call, and the star allreduce of three ranks can then complete
    on the others before the ABORT arrives.)"""
    n = 3
    async with TCPStoreServer("127.0.0.1", 0) as server:
        url = f"tcp://127.0.0.1:{server.port}"

        async def rank(r: int) -> float:
            first = await ac.open_group(
                r, n, store=url, transport="tcp", name="first", timeout=GROUP_TIMEOUT
            )
            if r == 2:
                first.abort()
            else:
                with pytest.raises(ac.GroupBrokenError):
                    await first.allreduce(np.ones(64))
            async with ac.open_group(
                r, n, store=url, transport="tcp", name="second", timeout=GROUP_TIMEOUT
            ) as second:
                value = await _allreduce_one(second)
            first.abort()
            return value

        assert await asyncio.gather(*(rank(r) for r in range(n))) == [6.0] * n


async def test_new_group_on_the_embedded_store_of_a_broken_group(unique_name: str) -> None:
    """The embedded store lives as long as rank 0's group, broken or not, so the ranks can
    form the next group on the same URL before closing the broken one (abort() closed rank
    1's own store connection; it simply reconnects)."""
    url = f"tcp://127.0.0.1:{free_port()}"

    async def rank(r: int) -> float:
        first = await ac.open_group(
            r, 2, store=url, transport="tcp", name=unique_name, timeout=GROUP_TIMEOUT
        )
        if r == 1:
            first.abort()
        else:
            with pytest.raises(ac.GroupBrokenError):  # rank 1's ABORT arrives
                await first.allreduce(np.ones(64))
        async with ac.open_group(
            r, 2, store=url, transport="tcp", name=unique_name + "-again", timeout=GROUP_TIMEOUT
        ) as g:
            value = await _allreduce_one(g)
        await first.aclose()
        return value

    assert await asyncio.gather(rank(0), rank(1)) == [3.0, 3.0]


async def reopen_after_kill(g: ac.Group, ready_key: str, victim: int) -> dict[str, Any]:
    """Spawned rank body: allreduce until the victim is killed, then the survivors form a
    new group (new name, new ranks) on the same store. The loss reaches a survivor as the
    PeerDisconnected of the allreduce in flight, or, where that allreduce completed just
    before the failure arrived (the root's result, then its ABORT, in one read), as the
    GroupBrokenError of the next one, caused by it (docs/api.md)."""
    buf = np.ones(1024)
    done = 0
    try:
        while True:
            await g.allreduce(buf)
            done += 1
            if done == 3:
                await g.store.set(f"{ready_key}/{g.rank}", b"1")
    except (ac.PeerDisconnected, ac.GroupBrokenError) as exc:
        cause = exc.__cause__ if isinstance(exc, ac.GroupBrokenError) else exc
        if not isinstance(cause, ac.PeerDisconnected):
            raise
        first_error = f"{type(cause).__name__}: {cause}"
    survivors = [r for r in range(g.world_size) if r != victim]
    async with ac.open_group(
        survivors.index(g.rank), len(survivors), store=g.store, name="after-kill", timeout=30
    ) as again:
        return {"error": first_error, "value": await _allreduce_one(again)}


async def test_survivors_of_a_killed_rank_form_a_new_group() -> None:
    n, victim = 3, 1
    job = spawn_ranks(n, reopen_after_kill, "ready", victim, timeout=80)
    store, _ = await open_store(job.store, rank=1, timeout=60)
    try:
        await store.wait([f"ready/{r}" for r in range(n)], timeout=60)
    finally:
        await store.close()
    job.kill(victim)
    outcomes = await job.outcomes()
    assert outcomes[victim][0] == "died"
    for rank in (0, 2):
        status, res = outcomes[rank][0], outcomes[rank][1]
        assert status == "ok", outcomes[rank]
        assert f"rank {victim}" in res["error"], res
        assert res["value"] == 3.0, res
