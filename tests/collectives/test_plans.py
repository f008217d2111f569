"""The groups' memo of argument checks (``Group._plans``): a repeated call reuses what the
first one concluded, a call differing in dtype, size, op, root or algorithm never does,
bad arguments still raise UsageError every time, and ranks that disagree still get
MismatchError on every rank after their plans are warm."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("transport", ["memory", "tcp"])
async def test_a_different_dtype_size_op_or_root_gets_its_own_plan(transport: str) -> None:
    async def body(g: ac.Group) -> list[Any]:
        r = g.rank + 1
        out: list[Any] = []
        for _ in range(2):  # the second round runs on warm plans
            for dtype in (np.float32, np.float64, np.int32, np.int64):
                for count in (1, 3, 1000, 70_000):
                    buf = np.full(count, r, dtype)
                    await g.allreduce(buf)
                    out.append((dtype, count, "sum", buf.dtype, buf.size, buf[-1].item()))
                    buf = np.full(count, r, dtype)
                    await g.allreduce(buf, op=ac.ReduceOp.MAX)
                    out.append((dtype, count, "max", buf.dtype, buf.size, buf[-1].item()))
            buf = np.full(4, r, np.float64)
            await g.allreduce(buf, op=ac.ReduceOp.AVG)
            out.append(("avg", buf[0].item()))
            buf = np.full(4, r, np.float64)
            await g.allreduce(buf, algorithm="ring")
            out.append(("ring", buf[0].item()))
            for root in (0, 1, np.int64(1)):
                buf = np.full(2, 10 * r, np.int32)
                await g.broadcast(buf, root=root)  # type: ignore[arg-type]
                out.append(("bcast", int(root), buf.tolist()))
        return out

    for res in await run_ranks(2, body, transport=transport):
        for rec in res:
            if rec[0] == "avg":
                assert rec[1] == 1.5
            elif rec[0] == "ring":
                assert rec[1] == 3.0
            elif rec[0] == "bcast":
                assert rec[2] == [10 * (rec[1] + 1)] * 2
            else:
                dtype, count, how, got_dtype, got_size, last = rec
                assert (got_dtype, got_size) == (np.dtype(dtype), count)
                assert last == (3 if how == "sum" else 2), rec


async def test_bad_arguments_raise_every_time_and_are_not_remembered() -> None:
    async def body(g: ac.Group) -> int:
        buf = np.zeros(4, np.float32)
        ibuf = np.zeros(4, np.int32)
        await g.allreduce(buf)
        await g.allreduce(ibuf)
        await g.broadcast(buf, root=1)
        for _ in range(2):
            with pytest.raises(ac.UsageError):
                g.allreduce(buf, op=ac.ReduceOp.BAND)  # a bitwise op on floats
            with pytest.raises(ac.UsageError):
                g.allreduce(ibuf, op=ac.ReduceOp.AVG)  # AVG on integers
            with pytest.raises(ac.UsageError):
                g.allreduce(buf, algorithm="nope")
            with pytest.raises(ac.UsageError):
                g.allreduce(buf, algorithm=["unhashable"])  # type: ignore[arg-type]
            with pytest.raises(ac.UsageError):
                g.broadcast(buf, root=2)
            with pytest.raises(ac.UsageError):
                g.broadcast(buf, root=True)  # a bool is no rank, though True == 1
            with pytest.raises(ac.UsageError):
                g.broadcast(buf, root=1.0)  # type: ignore[arg-type]
            with pytest.raises(ac.UsageError):
                g.allreduce(buf, timeout=-1)
        await g.allreduce(buf)  # the group is still usable: nothing was sent
        return len(g._plans)

    assert await run_ranks(2, body) == [3, 3]


@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize("case", ["op", "dtype", "root"])
async def test_mismatch_on_warm_plans_raises_on_every_rank(transport: str, case: str) -> None:
    async def body(g: ac.Group) -> str:
        buf = np.ones(4, np.float32)
        for _ in range(3):  # both ranks' plans warm for both variants
            await g.allreduce(buf)
            await g.allreduce(buf, op=ac.ReduceOp.MAX)
            await g.allreduce(np.ones(4, np.float64))
            await g.broadcast(buf, root=0)
            await g.broadcast(buf, root=1)
        try:
            if case == "op":
                await g.allreduce(buf, op=ac.ReduceOp.MAX if g.rank else ac.ReduceOp.SUM)
            elif case == "dtype":
                await g.allreduce(np.ones(4, np.float64) if g.rank else buf)
            else:  # both ranks only send: the peer's unexpected frame tells, and the
                # next operation fails with it
                await g.broadcast(buf, root=g.rank)
                await g.barrier()
        except ac.MismatchError:
            return "MismatchError"
        except ac.GroupBrokenError as exc:
            return type(exc.__cause__).__name__
        return "no error"

    assert await run_ranks(2, body, transport=transport, timeout=20) == ["MismatchError"] * 2


async def test_send_recv_and_barrier_plans() -> None:
    """send/recv remember their fingerprint per (dtype, size), barrier per algorithm: warm
    ones for two sizes still tell a size mismatch, and a bad algorithm raises each time."""

    async def body(g: ac.Group) -> str:
        small, large = np.zeros(4, np.float32), np.zeros(8, np.float32)
        for _ in range(3):
            for buf in (small, large, np.zeros(4, np.float64)):
                if g.rank == 0:
                    buf[:] = 7
                    await g.send(buf, 1)
                else:
                    buf[:] = 0
                    assert await g.recv(buf, 0) == 0
                    assert (buf == 7).all()
            await g.barrier()
            with pytest.raises(ac.UsageError):
                g.barrier(algorithm="nope")
        if g.rank == 0:
            await g.send(large, 1)
            try:
                await g.barrier()
            except ac.GroupBrokenError as exc:
                return type(exc.__cause__).__name__
            except ac.MismatchError:
                return "MismatchError"
            return "no error"
        try:
            await g.recv(small, 0)
        except ac.MismatchError:
            return "MismatchError"
        return "no error"

    assert await run_ranks(2, body, transport="tcp", timeout=20) == ["MismatchError"] * 2


async def test_block_collective_plans() -> None:
    """reduce and the block collectives remember a plan per call shape: warm ones give the
    same results for other shapes, roots and ops, and bad arguments raise every time,
    warm or not, without being remembered."""

    async def body(g: ac.Group) -> tuple[list[Any], int]:
        n, r = g.world_size, g.rank
        out: list[Any] = []
        for _ in range(3):  # the later rounds run on warm plans
            for rows in (2, 4):
                send = np.arange(rows * n, dtype=np.float32) + r
                buf = send.copy()
                await g.reduce(buf, root=1, op=ac.ReduceOp.MAX)
                out.append(buf.tolist())
                out.append((await g.allgather(send)).tolist())
                res = await g.gather(send, root=1)
                out.append(None if res is None else res.tolist())
                blk = np.zeros(rows, np.float32)
                await g.scatter(send if r == 0 else None, blk, root=0)
                out.append(blk.tolist())
                out.append((await g.reduce_scatter(send, op=ac.ReduceOp.AVG)).tolist())
                out.append((await g.alltoall(send.reshape(n, rows))).tolist())
                out.append([a.tolist() for a in await g.allgatherv(send[: rows + r])])
                counts = [rows * n - 1, 1] if r == 0 else [1, rows * n - 1]
                out.append([a.tolist() for a in await g.alltoallv(send, counts)])
            f32 = np.zeros(4, np.float32)
            with pytest.raises(ac.UsageError, match="out has shape"):
                g.allgather(f32, np.zeros(3, np.float32))
            with pytest.raises(ac.UsageError, match="root=5 is out of range"):
                g.gather(f32, root=5)
            with pytest.raises(ac.UsageError, match="the root must pass send"):
                g.scatter(None, f32, root=r)
            with pytest.raises(ac.UsageError, match="divisible"):
                g.reduce_scatter(np.zeros(2 * n + 1, np.float32))
            with pytest.raises(ac.UsageError, match="AVG needs a float"):
                g.reduce(np.zeros(4, np.int32), op=ac.ReduceOp.AVG)
            with pytest.raises(ac.UsageError, match="no algorithm"):
                g.alltoall(f32, algorithm="nope")
            with pytest.raises(ac.UsageError, match="send_counts sum to"):
                g.alltoallv(f32, [1] * n)
            with pytest.raises(ac.UsageError, match="unsupported dtype"):
                g.allgatherv(np.array([object()]))
        return out, len(g._plans)

    res = await run_ranks(2, body, transport="tcp")
    (first, plans0), (second, plans1) = res
    per_round = len(first) // 3
    for out in (first, second):
        assert out[:per_round] == out[per_round : 2 * per_round] == out[2 * per_round :]
    # per rows: reduce, allgather, gather, scatter, reduce_scatter, alltoall; one each for
    # allgatherv and alltoallv (planned per dtype); and on rank 1 its bad scatter's (root
    # 1 and a block of 4: a valid shape, kept, whose missing send is checked per call)
    assert (plans0, plans1) == (2 * 6 + 2, 2 * 6 + 3)
    assert (first[0], second[0]) == ([0.0, 1, 2, 3], [1.0, 2, 3, 4])  # MAX into rank 1
    assert (first[2], second[2]) == (None, [[0.0, 1, 2, 3], [1.0, 2, 3, 4]])
    assert (first[3], second[3]) == ([0.0, 1], [2.0, 3])
    assert (first[4], second[4]) == ([0.5, 1.5], [2.5, 3.5])


@pytest.mark.parametrize("case", ["gather root", "reduce op", "alltoall shape"])
async def test_block_mismatch_on_warm_plans_raises_on_every_rank(case: str) -> None:
    async def body(g: ac.Group) -> str:
        n = g.world_size
        buf = np.ones(2 * n, np.float32)
        for _ in range(3):  # both ranks' plans warm for both variants
            for root in range(n):
                await g.gather(buf, root=root)
                await g.reduce(buf.copy(), op=ac.ReduceOp.MAX, root=root)
            await g.reduce(buf.copy())
            await g.alltoall(buf)
            await g.alltoall(buf.reshape(n, 2))
            await g.alltoall(np.ones(4 * n, np.float32))
        try:
            if case == "gather root":
                await g.gather(buf, root=g.rank)
                await g.barrier()
            elif case == "reduce op":
                await g.reduce(buf.copy(), op=ac.ReduceOp.MAX if g.rank else ac.ReduceOp.SUM)
                await g.barrier()
            else:
                await g.alltoall(np.ones((4 if g.rank else 2) * n, np.float32))
        except ac.MismatchError:
            return "MismatchError"
        except ac.GroupBrokenError as exc:
            return type(exc.__cause__).__name__
        return "no error"

    assert await run_ranks(2, body, transport="tcp", timeout=20) == ["MismatchError"] * 2
