"""Ranks that disagree get MismatchError on every rank, promptly, naming both sides."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks, spawn_ranks

pytestmark = pytest.mark.timeout(60)

Call = Callable[[ac.Group], Awaitable[Any]]

CASES: dict[str, tuple[Call, Call, str]] = {
    "size": (lambda g: g.allreduce(np.zeros(10, np.float32)),
             lambda g: g.allreduce(np.zeros(12, np.float32)), "count=10"),
    "dtype": (lambda g: g.allreduce(np.zeros(10, np.float32)),
              lambda g: g.allreduce(np.zeros(10, np.float64)), "float64"),
    "op": (lambda g: g.allreduce(np.zeros(10, np.float32), op=ac.SUM),
           lambda g: g.allreduce(np.zeros(10, np.float32), op=ac.MAX), "op=MAX"),
    "root": (lambda g: g.broadcast(np.zeros(10), root=0),
             lambda g: g.broadcast(np.zeros(10), root=1), "root=1"),
    "kind": (lambda g: g.allreduce(np.zeros(10)),
             lambda g: g.broadcast(np.zeros(10), root=0), "broadcast"),
    "barrier-vs-allreduce": (lambda g: g.barrier(),
                             lambda g: g.allreduce(np.zeros(3)), "barrier"),
    "empty-vs-full": (lambda g: g.allreduce(np.zeros(0)),
                      lambda g: g.allreduce(np.zeros(5)), "count=0"),
    "reduce_scatter-vs-allgather": (lambda g: g.reduce_scatter(np.zeros(12)),
                                    lambda g: g.allgather(np.zeros(12)), "allgather"),
}


async def _body(g: ac.Group, case: str, odd: int) -> tuple[float, str, str]:
    first, second, _ = CASES[case]
    call = second if g.rank == odd else first
    t0 = time.monotonic()
    try:
        await g.barrier()
        t0 = time.monotonic()
        await call(g)
        # a rank whose own op finished (nothing to receive) learns on its next call
        await g.barrier()
    except ac.MismatchError as exc:
        return time.monotonic() - t0, "MismatchError", str(exc)
    except ac.GroupBrokenError as exc:
        cause = exc.__cause__
        if isinstance(cause, ac.MismatchError):
            return time.monotonic() - t0, "MismatchError", str(cause)
        raise
    return time.monotonic() - t0, "no error", ""


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n, transport", [(2, "memory"), (3, "tcp"), (4, "memory")])
async def test_mismatch_in_process(case: str, n: int, transport: str) -> None:
    res = await run_ranks(n, _body, case, n - 1, transport=transport, timeout=20)
    for rank, (elapsed, kind, message) in enumerate(res):
        assert kind == "MismatchError", f"rank {rank}: {kind}"
        assert elapsed < 1.0, f"rank {rank} took {elapsed:.2f}s"
        assert "called" in message and "but rank" in message
    assert any(CASES[case][2] in m for _, _, m in res), [m for _, _, m in res]


@pytest.mark.parametrize("case", ["size", "kind", "root"])
async def test_mismatch_in_processes(case: str) -> None:
    res = await spawn_ranks(3, _body, case, 1, timeout=40)
    assert [kind for _, kind, _ in res] == ["MismatchError"] * 3
    assert max(elapsed for elapsed, _, _ in res) < 1.0


async def _p2p_size(g: ac.Group) -> str:
    if g.rank == 0:
        await g.send(np.zeros(10, np.float32), 1)
        try:
            await g.barrier()
        except ac.GroupBrokenError as exc:  # the barrier was called after the failure
            return type(exc.__cause__).__name__
        except ac.MismatchError:  # the barrier was in flight when it happened
            return "MismatchError"
        return "no error"
    try:
        await g.recv(np.zeros(12, np.float32), 0)
    except ac.MismatchError as exc:
        assert "10" in str(exc) and "12" in str(exc)
        return "MismatchError"
    return "no error"


async def test_send_recv_size_mismatch() -> None:
    assert await run_ranks(2, _p2p_size, timeout=10) == ["MismatchError"] * 2
