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
