"""The Task-free path for one-frame allreduces (engine/small.py): results, handle type,
deadline, cancellation and failure, over the in-process memory transport and real TCP."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.engine import watchdog
from aiocollect.testing import run_ranks
from aiocollect.transport.base import SendMark

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("transport", "n"),
    [
        ("memory", 2),
        ("memory", 3),
        ("memory", 4),
        ("memory", 8),
        ("tcp", 2),
        ("tcp", 3),
        ("tcp", 4),
    ],
)
@pytest.mark.parametrize(
    "op", [ac.ReduceOp.SUM, ac.ReduceOp.MAX, ac.ReduceOp.PROD, ac.ReduceOp.AVG, np.logaddexp]
)
async def test_results_match_numpy_and_are_identical_on_every_rank(
    transport: str, n: int, op: Any
) -> None:
    count = 37

    async def body(g: ac.Group) -> tuple[bool, np.ndarray[Any, Any]]:
        rng = np.random.default_rng(g.rank)
        buf = rng.uniform(0.5, 1.5, count).astype(np.float64)
        handle = g.allreduce(buf, op=op)
        task_free = not isinstance(handle, asyncio.Task)
        await handle
        return task_free, buf

    results = await run_ranks(n, body, transport=transport)
    inputs = [np.random.default_rng(r).uniform(0.5, 1.5, count) for r in range(n)]
    if op is ac.ReduceOp.AVG:
        want = np.mean(inputs, axis=0)
    elif op is np.logaddexp:
        want = np.logaddexp.reduce(inputs, axis=0)
    else:
        want = {ac.ReduceOp.SUM: np.sum, ac.ReduceOp.MAX: np.max, ac.ReduceOp.PROD: np.prod}[op](  # type: ignore[operator]
            inputs, axis=0
        )
    for task_free, got in results:
        assert task_free  # it took the schedule path
        np.testing.assert_allclose(got, want, rtol=1e-12)
        assert got.tobytes() == results[0][1].tobytes()  # bit-identical across ranks


async def test_integers_and_many_in_flight_keep_their_order() -> None:
    async def body(g: ac.Group) -> list[np.ndarray[Any, Any]]:
        bufs = [np.full(5, g.rank * 10 + i, np.int64) for i in range(200)]
        await asyncio.gather(*(g.allreduce(b) for b in bufs))
        return bufs

    for bufs in await run_ranks(4, body, transport="tcp"):
        for i, b in enumerate(bufs):
            assert (b == sum(r * 10 + i for r in range(4))).all()


async def test_the_schedule_and_the_task_paths_interleave() -> None:
    """Small (schedule) and large (task) allreduces started back to back, same order."""

    async def body(g: ac.Group) -> list[float]:
        small = [np.full(3, float(g.rank + i)) for i in range(20)]
        large = [np.full(300_000, float(g.rank - i)) for i in range(3)]
        handles = []
        for i in range(20):
            handles.append(g.allreduce(small[i]))
            if i % 7 == 0:
                handles.append(g.allreduce(large[i // 7]))
        await asyncio.gather(*handles)
        return [float(b[0]) for b in small + large]

    for got in await run_ranks(2, body, transport="tcp"):
        assert got == [float(1 + 2 * i) for i in range(20)] + [float(1 - 2 * i) for i in range(3)]


async def test_deadline_names_the_rank_that_never_called() -> None:
    async def body(g: ac.Group) -> Any:
        if g.rank == 1:  # never calls the allreduce; hears rank 0's relayed timeout
            with pytest.raises(ac.PeerTimeout):
                await g.recv(np.zeros(1), 0, tag=1)
            return None
        with pytest.raises(ac.PeerTimeout) as info:
            await g.allreduce(np.ones(4), timeout=0.5)
        return info.value

    err, _ = await run_ranks(2, body, transport="tcp", timeout=30.0)
    assert err.ranks == [1], err
    assert "have not called it" in str(err), err


#: The one-frame path over TCP, the Task path over the default transport: the deadline heap
#: and its ticker are the group's, the same over every link; the link only carries the
#: relayed timeout to rank 1, which each transport does in one of the two cases.
@pytest.mark.parametrize(("size", "transport"), [(4, "tcp"), (1 << 20, "auto")])
async def test_a_far_deadline_expires_on_time(transport: str, size: int) -> None:
    """A deadline ``WATCH_AT_TICK`` or more away goes on the deadline heap by the group's
    progress ticker, not by the call (design.md, *Deadlines*): operations that finish
    never touch the heap, and one that does not still fails at its deadline, not before,
    and promptly after."""
    timeout = 2.5
    assert timeout >= watchdog.WATCH_AT_TICK

    async def body(g: ac.Group) -> Any:
        for _ in range(50):  # the group's default timeout: 300 s away
            await g.allreduce(np.ones(size // 4, np.float32))
        heap_after_done = g._watchdog.heap_size
        await g.barrier()
        if g.rank == 1:  # never calls it; hears rank 0's relayed timeout
            with pytest.raises(ac.PeerTimeout):
                await g.recv(np.zeros(1), 0, tag=1)
            return heap_after_done, None
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(ac.PeerTimeout) as info:
            await g.allreduce(np.ones(size // 4, np.float32), timeout=timeout)
        return heap_after_done, (loop.time() - start, info.value)

    (heap0, (elapsed, err)), (heap1, _) = await run_ranks(
        2, body, transport=transport, timeout=30.0
    )
    assert heap0 == heap1 == 0
    assert timeout <= elapsed < timeout + 5.0, elapsed
    assert err.ranks == [1], err


@pytest.mark.parametrize("size", [4, 1 << 20])  # the one-frame path, the Task path
async def test_a_far_deadline_holds_once_the_group_broke(size: int) -> None:
    """An operation that its group's failure did not end (nothing of it in the links'
    mailboxes when they failed) still ends at its far deadline, with that failure: the
    progress ticker puts the deadline on the heap even once the group is broken."""
    timeout = 2.5
    assert timeout >= watchdog.WATCH_AT_TICK
    ended = asyncio.Event()

    async def body(g: ac.Group) -> Any:
        await g.barrier()
        if g.rank == 1:  # never calls it, and stays until rank 0's ended
            await ended.wait()
            return None
        loop = asyncio.get_running_loop()
        start = loop.time()
        handle = g.allreduce(np.ones(size // 4, np.float32), timeout=timeout)
        for _ in range(10):  # (the Task's first steps: its receive posted)
            await asyncio.sleep(0)
        broke = ac.GroupBrokenError("broken beside the operation")
        g._fabric.failure = broke  # a failure that missed the operation
        try:
            async with asyncio.timeout(timeout + 5.0):
                with pytest.raises(ac.GroupBrokenError) as info:
                    await handle
        finally:
            ended.set()
        assert info.value is broke
        return loop.time() - start

    elapsed, _ = await run_ranks(2, body, transport="tcp", timeout=30.0)
    assert timeout <= elapsed < timeout + 2.0, elapsed


@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_first_frame_leaves_in_the_call_so_cancelling_then_breaks(transport: str) -> None:
    """A one-frame operation runs its first step in the call (design.md, *Sent in the
    call*): its frame has left when the handle is returned, so cancelling it right away
    breaks the group on every rank (the peer's matching call may still complete with that
    frame, if it reads it before the ABORT; its next one fails). (One that receives first
    moves nothing until its frame lands: a posted recv cancelled before that leaves the
    group usable, below.)"""

    async def body(g: ac.Group) -> Any:
        await g.barrier()
        in_call = None
        if g.rank == 0:  # rank 1 calls only after the cancel: this one cannot finish
            before = g.statistics()["links"][1]["frames_sent"]
            late = g.allreduce(np.ones(4))
            in_call = g.statistics()["links"][1]["frames_sent"] - before
            late.cancel()
            with pytest.raises(asyncio.CancelledError):
                await late
            await g.store.set("cancelled", b"1")
            with pytest.raises(ac.GroupBrokenError):  # at the call
                await g.allreduce(np.ones(4))
        else:
            await g.store.wait(["cancelled"], timeout=20.0)
            # Rank 0's frame left in its call, ahead of its ABORT: where this rank reads it
            # first (a shared-memory ring is read in order), its allreduce completes with
            # the whole sum; else it raises. Either way the ABORT then breaks the group.
            x = np.ones(4)
            with contextlib.suppress(ac.GroupBrokenError):
                await g.allreduce(x)
                assert (x == 2).all(), x
            with pytest.raises(ac.GroupBrokenError):  # rank 0 never calls it
                await g.barrier()
        return in_call, g.statistics()["broken"]

    assert await run_ranks(2, body, transport=transport, timeout=30.0) == [
        (1, True),
        (None, True),
    ]


async def test_peer_loss_fails_the_pending_allreduce() -> None:
    async def body(g: ac.Group) -> Any:
        if g.rank == 1:
            g.abort()
            return None
        with pytest.raises(ac.AiocollectError):
            await g.allreduce(np.ones(4), timeout=20.0)
        return g.statistics()["broken"]

    assert (await run_ranks(2, body, transport="tcp", timeout=30.0))[0] is True


@pytest.mark.parametrize("chunk_bytes", [None, 1024], ids=["schedule", "task-path"])
async def test_the_reduction_waits_for_its_own_frame_to_leave(
    monkeypatch: pytest.MonkeyPatch, chunk_bytes: int | None
) -> None:
    """Both recursive-doubling paths (one frame: the schedule; 1 KiB chunks: the Task
    running doubling.recursive_doubling). Fault injection: a link that holds rank 1's
    frames in "user space" for 0.2 s (and copies the payload only when it finally sends
    it, as a socket does) while rank 0's go at once. Rank 1 then has rank 0's data long
    before its own frame left; reducing into its buffer at that point would send rank 0 a
    partly reduced buffer."""
    from aiocollect.transport.memory import MemoryLink

    def send(self: MemoryLink, header: bytes, payload: Any) -> SendMark:
        other, loop = self.other, asyncio.get_running_loop()
        assert other is not None
        pending = getattr(self, "_held", 0) + len(payload)
        self._held = pending  # type: ignore[attr-defined]
        self.frames_sent += 1

        def deliver() -> None:
            self._held -= len(payload)  # type: ignore[attr-defined]
            other._deliver(header, bytes(payload))  # the bytes as they are now
            if not self._held:  # type: ignore[attr-defined]
                for fut in getattr(self, "_waiters", []):
                    if not fut.done():
                        fut.set_result(None)

        loop.call_later(0.2 if self.peer == 0 else 0.0, deliver)
        return self.sent_mark(None)  # (held: until it is delivered)

    async def drained(self: MemoryLink) -> None:
        while getattr(self, "_held", 0):
            fut = asyncio.get_running_loop().create_future()
            self.__dict__.setdefault("_waiters", []).append(fut)
            await fut

    monkeypatch.setattr(MemoryLink, "send", send)
    monkeypatch.setattr(MemoryLink, "write_buffer_size", lambda self: getattr(self, "_held", 0))
    monkeypatch.setattr(MemoryLink, "drained", drained)

    async def body(g: ac.Group) -> list[float]:
        buf = np.full(1000, float(g.rank + 1))
        await g.allreduce(buf)
        return [float(buf.min()), float(buf.max())]

    assert await run_ranks(2, body, chunk_bytes=chunk_bytes) == [[3.0, 3.0], [3.0, 3.0]]


@pytest.mark.parametrize(
    ("transport", "n"), [("memory", 2), ("memory", 3), ("memory", 5), ("memory", 8), ("tcp", 3)]
)
async def test_small_broadcast_from_every_root(transport: str, n: int) -> None:
    async def body(g: ac.Group) -> list[tuple[bool, list[int]]]:
        out = []
        for root in range(n):
            buf = np.full(6, g.rank * 100 + root, np.int32)
            handle = g.broadcast(buf, root=root)
            out.append((not isinstance(handle, asyncio.Task), (await handle).tolist()))
        return out

    for per_root in await run_ranks(n, body, transport=transport):
        for root, (task_free, got) in enumerate(per_root):
            assert task_free
            assert got == [root * 100 + root] * 6


@pytest.mark.parametrize(("transport", "n"), [("memory", 3), ("tcp", 2), ("auto", 2), ("tcp", 4)])
async def test_barrier_and_one_frame_send_recv_take_the_task_free_path(
    transport: str, n: int
) -> None:
    """barrier, and send/recv with a given peer of one frame, run without a Task (the
    default transport included); recv from any rank and a message larger than a chunk
    keep the Task path, and both kinds of message keep their (source, tag) order."""

    async def body(g: ac.Group) -> tuple[list[bool], list[Any]]:
        kinds, got = [], []
        for _ in range(3):
            handle = g.barrier()
            kinds.append(not isinstance(handle, asyncio.Task))
            await handle
        right, left = (g.rank + 1) % n, (g.rank - 1) % n
        small = [np.full(4, g.rank * 10 + i, np.int32) for i in range(5)]
        big = np.full(5000, g.rank, np.float64)  # 40 KB: several 16 KiB chunks
        sends = [g.send(a, right, tag=7) for a in small[:2]]
        sends.append(g.send(big, right, tag=7))
        sends += [g.send(a, right, tag=7) for a in small[2:]]
        kinds += [not isinstance(h, asyncio.Task) for h in sends]
        bufs = [np.zeros(4, np.int32) for _ in range(5)]
        into_big = np.zeros(5000, np.float64)
        recvs = [g.recv(b, left, tag=7) for b in bufs[:2]]
        recvs.append(g.recv(into_big, left, tag=7))
        recvs += [g.recv(b, left, tag=7) for b in bufs[2:]]
        kinds += [not isinstance(h, asyncio.Task) for h in recvs]
        sources = await asyncio.gather(*recvs)
        await asyncio.gather(*sends)
        got = [sources, [b.tolist() for b in bufs], float(into_big.min()), float(into_big.max())]
        anyone = g.recv(np.zeros(1), tag=9)  # any source: Task path
        kinds.append(isinstance(anyone, asyncio.Task))
        await g.send(np.ones(1), right, tag=9)
        got.append(await anyone)
        return kinds, got

    results = await run_ranks(n, body, transport=transport, chunk_bytes=16 * 1024)
    for rank, (kinds, got) in enumerate(results):
        left = (rank - 1) % n
        assert kinds == [True] * 3 + [True, True, False, True, True, True] * 2 + [True], kinds
        sources, bufs, lo, hi = got[:4]
        assert sources == [left] * 6
        assert bufs == [[left * 10 + i] * 4 for i in range(5)]
        assert (lo, hi) == (float(left), float(left))
        assert got[4] == left


async def test_one_frame_recv_deadline_and_cancellation() -> None:
    """A one-frame recv that nothing answers times out with PeerTimeout naming its peer;
    cancelling a one-frame recv that received nothing leaves the group usable; a one-frame
    send is complete once its frame left (one loop pass over TCP: nothing to cancel)."""

    async def body(g: ac.Group) -> Any:
        peer = 1 - g.rank
        if g.rank == 0:
            with pytest.raises(ac.PeerTimeout) as info:
                await g.recv(np.zeros(2), peer, tag=3, timeout=0.5)
            return info.value
        with pytest.raises(ac.PeerTimeout):  # rank 0's relayed deadline
            await g.recv(np.zeros(2), peer, tag=4)
        return None

    err, _ = await run_ranks(2, body, transport="tcp", timeout=30.0)
    assert isinstance(err, ac.PeerTimeout)
    assert err.ranks == [1], err

    async def cancels(g: ac.Group) -> list[Any]:
        peer = 1 - g.rank
        waiting = g.recv(np.zeros(2), peer, tag=5)
        await asyncio.sleep(0)  # posted: nothing arrived
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        usable = not g.statistics()["broken"]
        await g.barrier()  # still usable on both ranks
        if g.rank == 0:
            sent = g.send(np.full(2, 7.0), peer, tag=6)  # its one step ran in the call
            done_at_once = sent.done() and not sent.cancel()
            await sent
            got = None
        else:
            buf = np.zeros(2)
            await g.recv(buf, peer, tag=6)
            done_at_once, got = True, buf.tolist()
        await g.barrier()
        return [usable, done_at_once, got, g.statistics()["broken"]]

    assert await run_ranks(2, cancels, transport="tcp", timeout=30.0) == [
        [True, True, None, False],
        [True, True, [7.0, 7.0], False],
    ]


@pytest.mark.parametrize("transport", ["tcp", "auto", "memory"])
async def test_the_star_roots_answer_is_one_fan_out_and_a_failing_send_in_it_breaks_all(
    transport: str,
) -> None:
    """The star's root sends its answer to every leaf from one loop (``Small.fan``: the
    header built once). A send that raises partway through (fault injection: rank 0's link
    to rank 2 refuses its answer) fails the root's operation and breaks the group, and no
    rank is left waiting or given a wrong sum: ranks 2 and 3 get an error, rank 1 (answered
    before the failure) the right sum or an error."""
    from aiocollect.errors import PeerDisconnected

    async def body(g: ac.Group) -> Any:
        buf = np.full(1, float(g.rank + 1), np.float32)
        await g.allreduce(buf, algorithm="star")
        assert float(buf[0]) == 10.0
        small = next(p[1] for k, p in g._plans.items() if k[0] == "allreduce")
        assert small is not None  # (the star's one-frame program)
        shape = (small.fan_at, len(small.fan), len(small.ops))
        await g.barrier()
        if g.rank == 0:
            link = g._fabric.links[2]

            def refuse(header: bytes, payload: Any) -> Any:
                raise PeerDisconnected("injected: the answer to rank 2 cannot be sent", 2)

            link.send = refuse  # type: ignore[method-assign]
        buf[0] = g.rank + 1
        try:
            await g.allreduce(buf, algorithm="star", timeout=20.0)
            outcome = float(buf[0])
        except ac.AiocollectError as exc:
            outcome = type(exc).__name__  # type: ignore[assignment]
        return shape, outcome

    results = await run_ranks(4, body, transport=transport, timeout=40.0)
    assert results[0][0] == (3, 3, 6)  # three receives, then one fan-out of three sends
    assert [r[0] for r in results[1:]] == [(1, 0, 1)] * 3  # a leaf: one step, no fan-out
    assert results[0][1] == "PeerDisconnected"
    assert results[1][1] in (10.0, "PeerDisconnected", "GroupBrokenError"), results
    for leaf in (2, 3):
        assert isinstance(results[leaf][1], str), results


@pytest.mark.parametrize(("transport", "n"), [("tcp", 2), ("memory", 3)])  # doubling, star
async def test_one_element_reductions(transport: str, n: int) -> None:
    """A one-element buffer reduces through the plan's scratch element (``Small.one``) and
    lands in the caller's buffer, for every op, with numpy's error state "raise" too (an
    overflow still gives the IEEE result), while operations of the same shape overlap."""

    async def body(g: ac.Group) -> list[float]:
        got = []
        for op in (ac.SUM, ac.PROD, ac.MIN, ac.MAX):
            bufs = [np.array([g.rank + 2 + k], np.float32) for k in range(3)]
            await asyncio.gather(*(g.allreduce(b, op=op) for b in bufs))
            got += [float(b[0]) for b in bufs]
        with np.errstate(all="raise"):
            big = np.array([3e38], np.float32)
            await g.allreduce(big)
        ints = np.array([g.rank + 1], np.int32)
        await g.allreduce(ints, op=ac.PROD)
        return [*got, float(big[0]), float(ints[0])]

    results = await run_ranks(n, body, transport=transport)
    want = []
    for reduce in (sum, np.prod, min, max):
        want += [float(reduce([r + 2 + k for r in range(n)])) for k in range(3)]
    want += [float("inf"), float(np.prod(range(1, n + 1)))]
    assert results == [want] * n
