"""The torch backend behaves as gloo does where torch's own tests look.

In-process ranks (one AiocollectProcessGroup per rank, each on its own thread, real sockets),
calling the process group's c10d methods as torch's test_c10d_gloo.py and DistributedTest
call gloo's. One test per cause found by running torch's suites against both backends.
"""

from __future__ import annotations

import math
import re
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed (pip install 'aiocollect[torch]')"
)
dist = pytest.importorskip("torch.distributed")

import aiocollect  # noqa: E402
from aiocollect.torch import _plan, _reductions  # noqa: E402
from aiocollect.torch._checks import ArgumentError  # noqa: E402
from aiocollect.torch.errors import CollectiveTimeout, MonitoredBarrierError  # noqa: E402
from aiocollect.torch.process_group import AiocollectProcessGroup  # noqa: E402
from tests.torch.local import close, make_groups, run_ranks  # noqa: E402

PG = AiocollectProcessGroup
W = 3


def _opts(cls: Any, **fields: Any) -> Any:
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


# -- 1. several tensors per call --------------------------------------------------------------


@pytest.mark.timeout(60)
def test_several_tensors_are_several_inputs() -> None:
    ops = [
        (dist.ReduceOp.SUM, float(W * (2 * W - 1))),
        (dist.ReduceOp.PRODUCT, float(math.factorial(2 * W))),
        (dist.ReduceOp.MIN, 1.0),
        (dist.ReduceOp.MAX, 2.0 * W),
    ]

    def body(pg: PG, r: int) -> None:
        for op, expected in ops:  # gloo's multi-input reduce tests
            base = 0.0 if op == dist.ReduceOp.SUM else 1.0
            xs = [torch.tensor([2 * r + base]), torch.tensor([2 * r + base + 1])]
            fut = pg.allreduce(xs, _opts(dist.AllreduceOptions, reduceOp=op)).get_future()
            for t in fut.wait():
                assert t.item() == expected, (op, t)
        for root in range(W):  # broadcast honours rootTensor
            for j in range(2):
                xs = [torch.tensor([r * 2 + 0.0]), torch.tensor([r * 2 + 1.0])]
                opts = _opts(dist.BroadcastOptions, rootRank=root, rootTensor=j)
                out = pg.broadcast(xs, opts).get_future().wait()
                assert [t.item() for t in out] == [root * 2.0 + j] * 2
        for n in (1, 2, 3):  # allgather: N inputs, N x world outputs per list
            inputs = [torch.tensor([n * r + i]) for i in range(n)]
            outputs = [[torch.tensor([-1]) for _ in range(n * W)] for _ in range(n)]
            value = pg.allgather(outputs, inputs).get_future().wait()
            assert [[t.item() for t in o] for o in outputs] == [list(range(n * W))] * n
            assert value == (outputs if n > 1 else outputs[0])  # gloo's future value

    run_ranks(W, body)


# -- 2. all_gather_coalesced layout -----------------------------------------------------------


@pytest.mark.timeout(60)
def test_all_gather_coalesced_is_rank_major() -> None:
    def body(pg: PG, r: int) -> None:
        inputs = [torch.full((2,), float(r)), torch.full((3, 1), 10.0 + r), torch.ones(0)]
        outputs = [[torch.empty_like(x) for x in inputs] for _ in range(W)]
        pg.allgather_coalesced(outputs, inputs).wait()
        for rank, out in enumerate(outputs):
            assert out[0].tolist() == [float(rank)] * 2
            assert out[1].reshape(-1).tolist() == [10.0 + rank] * 3
            assert out[2].numel() == 0

    run_ranks(W, body)


# -- 3. the same tensor twice -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_same_tensor_twice_in_allreduce_coalesced() -> None:
    def body(pg: PG, r: int) -> list[list[float]]:
        xs = [2 * [torch.tensor([i + r])] for i in range(50)]
        futs = [pg.allreduce_coalesced(x).get_future() for x in xs]
        return [[t.item() for t in f.wait()] for f in futs]

    results = run_ranks(W, body)
    expected = [[i * W + W * (W - 1) // 2] * 2 for i in range(50)]
    assert results == [expected] * W


# -- 4. argument checks at the call -----------------------------------------------------------


def _bad_calls(pg: PG, r: int) -> list[tuple[str, Any]]:
    t1, t2, t3 = torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.zeros(2)
    sparse = torch.sparse_coo_tensor([[0]], [1.0], size=(2,), check_invariants=True)
    B, R = dist.BroadcastOptions, dist.ReduceOptions
    G, S = dist.GatherOptions, dist.ScatterOptions
    return [
        ("invalid root rank", lambda: pg.broadcast([t1], _opts(B, rootRank=-1))),
        ("invalid root rank", lambda: pg.broadcast([t1], _opts(B, rootRank=W))),
        ("invalid root tensor", lambda: pg.broadcast([t1], _opts(B, rootRank=r, rootTensor=1))),
        ("invalid root tensor", lambda: pg.broadcast([], _opts(B, rootRank=r))),
        ("invalid tensor type", lambda: pg.broadcast([t1, t2], _opts(B, rootRank=r))),
        ("invalid tensor size", lambda: pg.broadcast([t1, t3], _opts(B, rootRank=r))),
        ("requires non-empty tensor list", lambda: pg.allreduce([])),
        ("invalid tensor type", lambda: pg.allreduce([t1, t2])),
        ("invalid tensor size", lambda: pg.allreduce([t1, t3])),
        ("invalid tensor layout", lambda: pg.allreduce([t1, sparse])),
        ("unsupported reduction", lambda: pg.allreduce([sparse], dist.ReduceOp.MAX)),
        ("requires non-empty tensor list", lambda: pg.allreduce_coalesced([])),
        ("tensors must all have the same type", lambda: pg.allreduce_coalesced([t1, t2])),
        ("invalid tensor layout at index", lambda: pg.allreduce_coalesced([t1, sparse])),
        ("unsupported layout", lambda: pg.allreduce_coalesced([sparse, sparse.clone()])),
        ("invalid root rank", lambda: pg.reduce([t1], _opts(R, rootRank=-1))),
        ("invalid root tensor", lambda: pg.reduce([t1], _opts(R, rootRank=r, rootTensor=1))),
        (
            "requires a single-element tensor list",
            lambda: pg.reduce([t1, t1], _opts(R, rootRank=r)),
        ),
        ("invalid root rank", lambda: pg.gather([], [t1], _opts(G, rootRank=-1))),
        (
            "requires a single-element input tensor list",
            lambda: pg.gather([], [t1, t1], _opts(G, rootRank=0)),
        ),
        (
            "requires a single-element output list",
            lambda: pg.gather([[t1] * W, [t1] * W], [t1], _opts(G, rootRank=r)),
        ),
        (
            f"Incorrect output list size {W - 1}. Output list size should be {W}",
            lambda: pg.gather([[t1] * (W - 1)], [t1], _opts(G, rootRank=r)),
        ),
        ("invalid tensor type", lambda: pg.gather([[t2] * W], [t1], _opts(G, rootRank=r))),
        (
            "requires empty output on non-root",
            lambda: pg.gather([[t1] * W], [t1], _opts(G, rootRank=(r + 1) % W)),
        ),
        ("invalid root rank", lambda: pg.scatter([t1], [], _opts(S, rootRank=W))),
        (
            "requires a single-element output tensor list",
            lambda: pg.scatter([t1, t1], [], _opts(S, rootRank=0)),
        ),
        (
            "requires a single-element input list",
            lambda: pg.scatter([t1], [], _opts(S, rootRank=r)),
        ),
        (
            f"Incorrect input list size {W + 1}. Input list size should be {W}",
            lambda: pg.scatter([t1], [[t1] * (W + 1)], _opts(S, rootRank=r)),
        ),
        ("invalid tensor size", lambda: pg.scatter([t1], [[t3] * W], _opts(S, rootRank=r))),
        (
            "requires empty input on non-root",
            lambda: pg.scatter([t1], [[t1] * W], _opts(S, rootRank=(r + 1) % W)),
        ),
        ("requires non-empty input tensor list", lambda: pg.allgather([], [])),
        (
            "requires input/output tensor lists to have the same length",
            lambda: pg.allgather([[t1] * W, [t1] * W], [t1]),
        ),
        ("invalid output tensor list", lambda: pg.allgather([[t1] * (W + 1)], [t1])),
        ("invalid tensor type", lambda: pg.allgather([[t1, t1] * W] * 2, [t1, t2])),
        (
            "invalid size of output tensor at index 0",
            lambda: pg.allgather_coalesced([[torch.zeros(0)]] + [[t1]] * (W - 1), [t1]),
        ),
        (
            "invalid tensor type at index 0",
            lambda: pg.allgather_coalesced([[t2]] + [[t1]] * (W - 1), [t1]),
        ),
        (
            "output lists should be equal to world size",
            lambda: pg.allgather_coalesced([[t1]] * (W + 1), [t1]),
        ),
        (
            "Tensors must be contiguous",
            lambda: pg.alltoall_base(torch.zeros(W, 2), torch.zeros(2, W).t(), [], []),
        ),
    ]


@pytest.mark.timeout(60)
def test_bad_arguments_raise_runtime_errors_before_anything_runs() -> None:
    def body(pg: PG, r: int) -> float:
        for pattern, call in _bad_calls(pg, r):
            seq = pg._get_sequence_number_for_group()
            with pytest.raises(RuntimeError, match=re.escape(pattern)) as info:
                call()
            assert isinstance(info.value, ArgumentError)
            assert isinstance(info.value, aiocollect.UsageError)
            assert pg._get_sequence_number_for_group() == seq, pattern  # nothing issued
        pg.check()  # the group is still usable, and no rank sent anything
        t = torch.ones(3)
        pg.allreduce([t]).wait()
        return t.sum().item()  # type: ignore[no-any-return]

    assert run_ranks(W, body) == [3.0 * W] * W


@pytest.mark.timeout(60)
def test_checks_run_in_gloos_order_with_torchs_own_inputs() -> None:
    """torch's test_allreduce_coalesced_checks and test_allgather_checks (test_c10d_gloo.py):
    a sparse tensor of another dtype is a layout error, not a type error; an all_gather
    output of another size than the input is refused on every rank."""

    def body(pg: PG, r: int) -> None:
        t1, t2, t3 = torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.zeros(2)
        isparse = torch.sparse_coo_tensor([[0]], [1], size=(1,), check_invariants=True)  # int64
        cases: list[tuple[str, Any]] = [
            ("invalid tensor layout at index", lambda: pg.allreduce_coalesced([t1, isparse])),
            ("unsupported layout", lambda: pg.allreduce_coalesced([isparse, isparse.clone()])),
            ("invalid tensor type", lambda: pg.allgather([([t1, t2] * W)[:W]], [t1])),
            ("invalid tensor size", lambda: pg.allgather([([t1, t3] * W)[:W]], [t1])),
            ("invalid tensor size", lambda: pg.allgather([[t3] * W], [t1])),
        ]
        for pattern, call in cases:
            with pytest.raises(RuntimeError, match=re.escape(pattern)) as info:
                call()
            assert isinstance(info.value, ArgumentError)
        assert pg._get_sequence_number_for_group() == 0  # nothing was issued

    run_ranks(W, body)


# -- 5. failures reach the Work and its future ------------------------------------------------


@pytest.mark.timeout(60)
def test_inference_mode_outputs_are_written() -> None:
    def body(pg: PG, r: int) -> None:
        with torch.inference_mode():
            base = torch.full((4, 4), float(r + 1))
            col = base[:, 1]  # not contiguous: written back after the collective
            fut = pg.allreduce([col]).get_future()
            outs = [torch.zeros(2, 2)[:, 0] for _ in range(W)]
            pg.allgather([outs], [torch.full((2,), float(r))]).wait()
        assert fut.wait()[0].tolist() == [float(W * (W + 1) // 2)] * 4
        assert base[:, 1].tolist() == [float(W * (W + 1) // 2)] * 4
        assert [o.tolist() for o in outs] == [[float(k)] * 2 for k in range(W)]

    run_ranks(W, body)


@pytest.mark.timeout(60)
def test_a_failed_copy_back_fails_the_work_and_its_future(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _reductions.allreduce

    def failing(*args: Any) -> _plan.Plan:  # fault injection: the copy-back raises
        plan = real(*args)

        def finish(results: list[Any]) -> None:
            raise RuntimeError("copy-back failed")

        plan.finish = finish
        return plan

    monkeypatch.setattr(_reductions, "allreduce", failing)

    def body(pg: PG, r: int) -> None:
        work = pg.allreduce([torch.ones(2)])
        with pytest.raises(RuntimeError, match="copy-back failed"):
            work.get_future().wait()
        with pytest.raises(RuntimeError, match="copy-back failed"):
            work.wait()
        assert not work.is_success()

    run_ranks(W, body)


# -- 6. barrier implies completion ------------------------------------------------------------


@pytest.mark.timeout(60)
def test_barrier_completes_after_earlier_operations() -> None:
    n = 200_000

    def body(pg: PG, r: int) -> None:
        for _ in range(3):
            bases = [torch.ones(n, 2) for _ in range(4)]
            cols = [b[:, 0] for b in bases]  # copied back when each allreduce finishes
            for c in cols:
                pg.allreduce([c])
            pg.barrier().wait()
            for b in bases:
                assert int((b[:, 0] == W).sum()) == n

    run_ranks(W, body)


# -- 7. API pieces ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_broadcast_root_reduce_scatter_uneven_options_sequence_numbers() -> None:
    def body(pg: PG, r: int) -> int:
        x = torch.tensor([r + 1.0])
        assert pg.broadcast(x, root=0).get_future().wait()[0].item() == 1.0
        # reduce_scatter with a different block size per rank: rank i gets i + 1 elements
        inputs = [torch.full((i + 1,), float(r)) for i in range(W)]
        out = torch.empty(r + 1)
        pg.reduce_scatter([out], [inputs]).wait()
        assert out.tolist() == [float(sum(range(W)))] * (r + 1)
        assert pg.options._timeout == timedelta(seconds=30)
        pg._set_default_timeout(timedelta(seconds=7))
        assert pg.options._timeout == timedelta(seconds=7)
        return pg._get_sequence_number_for_group()

    seqs = run_ranks(W, body)
    assert len(set(seqs)) == 1
    assert seqs[0] == 2


@pytest.mark.timeout(60)
def test_default_timeout_applies_to_later_calls() -> None:
    pgs = make_groups(2)
    pgs[0]._set_default_timeout(timedelta(seconds=0.5))
    started = time.monotonic()
    work = pgs[0].recv([torch.empty(1)], 1, 0)  # rank 1 never sends
    with pytest.raises(RuntimeError, match=" Timed out waiting 500ms "):
        work.wait()
    assert time.monotonic() - started < 5
    for pg in pgs:
        pg.abort()


# -- 8. sparse tensors ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sparse_allreduce_sums_indices_and_values() -> None:
    def body(pg: PG, r: int) -> None:
        for per_rank in (1, 2):
            tensors = []
            for k in range(per_rank):
                j = r * per_rank + k  # every input its own index, plus a shared one
                idx = torch.tensor([[j, 10], [0, 1]])
                vals = torch.tensor([[1.0, 2.0], [float(j), 1.0]])
                tensors.append(
                    torch.sparse_coo_tensor(idx, vals, (12, 2, 2), check_invariants=True)
                )
            expected = sum(t.to_dense() for t in _all_inputs(per_rank))
            out = pg.allreduce(tensors).get_future().wait()
            for t in [*out, *tensors]:
                assert t.is_sparse
                assert torch.equal(t.to_dense(), expected)

    def _all_inputs(per_rank: int) -> list[Any]:
        res = []
        for j in range(W * per_rank):
            idx = torch.tensor([[j, 10], [0, 1]])
            vals = torch.tensor([[1.0, 2.0], [float(j), 1.0]])
            res.append(torch.sparse_coo_tensor(idx, vals, (12, 2, 2), check_invariants=True))
        return res

    run_ranks(W, body)


# -- 9. timeout wording -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_barrier_timeout_is_worded_as_torch_expects() -> None:
    pgs = make_groups(W)
    started = time.monotonic()
    work = pgs[0].barrier(_opts(dist.BarrierOptions, timeout=timedelta(seconds=1)))
    with pytest.raises(Exception, match=r" (Timed out|closed|timeout) ") as info:
        work.wait()
    elapsed = time.monotonic() - started
    assert isinstance(info.value, CollectiveTimeout)
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value, aiocollect.PeerTimeout)
    assert 0.9 < elapsed < 4, elapsed
    for pg in pgs:
        pg.abort()


# -- 10. profiling ----------------------------------------------------------------------------


def _profiler_keeps_records_ended_elsewhere() -> bool:
    """Whether this torch's profiler keeps a record ended on another thread than the one
    that began it (the backend ends a call's record on its loop thread): torch 2.9's
    drops it."""
    prof = torch.autograd.profiler.profile()
    with prof:
        handle = torch.autograd._record_function_with_args_enter("aiocollect:probe")
        ender = threading.Thread(
            target=torch.autograd._record_function_with_args_exit, args=(handle,)
        )
        ender.start()
        ender.join()
    return any(e.name == "aiocollect:probe" for e in prof.function_events)


@pytest.mark.timeout(60)
def test_collectives_record_profiler_events() -> None:
    if not _profiler_keeps_records_ended_elsewhere():
        pytest.skip("this torch's profiler drops records ended on another thread")
    pgs = make_groups(2)
    prof = torch.autograd.profiler.profile(record_shapes=True)

    def body(r: int) -> None:
        pg = pgs[r]
        if r == 0:
            with prof:
                pg.allreduce([torch.ones(3, 2)]).wait()
                pg.broadcast([torch.ones(4)], _opts(dist.BroadcastOptions)).wait()
                pg.send([torch.ones(5)], 1, 0).wait()
        else:
            pg.allreduce([torch.ones(3, 2)]).wait()
            pg.broadcast([torch.ones(4)], _opts(dist.BroadcastOptions)).wait()
            pg.recv([torch.ones(5)], 0, 0).wait()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    events = {e.name: e for e in prof.function_events if e.name.startswith("aiocollect:")}
    for name, shape in (
        ("aiocollect:all_reduce", [3, 2]),
        ("aiocollect:broadcast", [4]),
        ("aiocollect:send", [5]),
    ):
        assert name in events, sorted(events)
        assert events[name].input_shapes == [shape]
        assert events[name].is_async
    close(pgs)


# -- 11. monitored barrier --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_monitored_barrier_names_the_missing_ranks() -> None:
    world = 4
    pgs = make_groups(world)
    results: dict[int, BaseException | None] = {}

    def body(r: int, wait_all: bool) -> None:
        try:
            pgs[r].monitored_barrier(timedelta(seconds=1), wait_all_ranks=wait_all)
            results[r] = None
        except BaseException as exc:
            results[r] = exc

    for wait_all, expected in (
        (False, "Rank 2 failed to pass monitoredBarrier in 1000 ms"),
        (True, "Ranks 2, 3 failed to pass monitoredBarrier in 1000 ms"),
    ):
        results.clear()
        threads = [threading.Thread(target=body, args=(r, wait_all)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert isinstance(results[0], MonitoredBarrierError), results
        assert expected in str(results[0])
        assert isinstance(results[0], RuntimeError)
        assert results[0].ranks == ([2] if not wait_all else [2, 3])
        assert isinstance(results[1], MonitoredBarrierError)  # never released by rank 0
        for r in (2, 3):  # the late ranks catch up, so the next round starts even
            pgs[r]._monitored += 1
    # everyone arrives: it passes
    results.clear()
    threads = [threading.Thread(target=body, args=(r, True)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {r: None for r in range(world)}
    with pytest.raises(MonitoredBarrierError, match="Rank 0 timed out in monitoredBarrier"):
        pgs[0].monitored_barrier(timedelta(0))  # gloo's zero timeout: no time to wait
    close(pgs)


# -- 12. the coalescing manager ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_end_coalescing_waits_for_the_coalesced_operations() -> None:
    n = 300_000

    def body(pg: PG, r: int) -> None:
        pg._start_coalescing(torch.device("cpu"))
        bases = [torch.ones(n, 2) for _ in range(3)]
        for b in bases:
            pg.allreduce([b[:, 0]])
        work = pg._end_coalescing(torch.device("cpu"))
        work.wait()
        for b in bases:
            assert int((b[:, 0] == W).sum()) == n

    run_ranks(W, body)
