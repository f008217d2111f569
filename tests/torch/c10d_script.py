"""Run under ``torchrun --nproc-per-node 2``: every c10d collective on the "aiocollect"
backend against gloo on the same inputs, sub-groups, DDP, and error propagation.

The default group uses aiocollect; a gloo group over the same ranks gives the reference.
Each check prints ``PASS <name>`` (once per rank); the script ends with ``ALL OK rank <r>``
or a traceback (non-zero exit).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import aiocollect
import aiocollect.torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import torch_ddp  # type: ignore[import-not-found]

# Older torch releases have these only as all_gather_into_tensor and reduce_scatter_tensor.
all_gather_single_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single_fn = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


Tensors = list[torch.Tensor]
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
AC: dist.ProcessGroup
GLOO: dist.ProcessGroup


def inputs(shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Deterministic per-rank data, small enough for exact integer and float results."""
    gen = torch.Generator().manual_seed(100 * RANK + salt)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randint(-8, 9, shape, generator=gen).to(dtype) / 4
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    low = 0 if dtype == torch.uint8 else -8
    return torch.randint(low, 9, shape, generator=gen).to(dtype)


def same(name: str, fn: Callable[[dist.ProcessGroup], Tensors], atol: float = 0.0) -> None:
    """``fn`` on the aiocollect group and on the gloo group gives equal tensors (checked
    for aiocollect alone where this torch's gloo lacks the call: all_to_all in
    torch 2.9)."""
    got = fn(AC)
    try:
        want = fn(GLOO)
    except RuntimeError as exc:
        if "does not support" not in str(exc):
            raise
        print(f"SKIP {name}: gloo lacks it here ({exc})", flush=True)
        return
    assert len(got) == len(want), (name, len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype, (name, i, g.dtype, w.dtype, g.shape)
        assert g.shape == w.shape, (name, i, g.dtype, w.dtype, g.shape)
        if atol:
            torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=f"{name}[{i}]")
        else:
            assert torch.equal(g, w), f"{name}[{i}]: aiocollect {g} != gloo {w}"
    say(f"PASS {name}")


def say(line: str) -> None:
    # One write per line: the ranks share torchrun's stdout pipe.
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def is_mismatch(exc: BaseException | None) -> bool:
    """A MismatchError, or the GroupBrokenError an operation gets when the mismatch was
    detected just before it started (it carries the MismatchError as its cause)."""
    return isinstance(exc, aiocollect.MismatchError) or (
        isinstance(exc, aiocollect.GroupBrokenError)
        and isinstance(exc.__cause__, aiocollect.MismatchError)
    )


def check(name: str, ok: bool) -> None:
    assert ok, name
    say(f"PASS {name}")


# -- reductions -------------------------------------------------------------------------------


def reductions() -> None:
    ops = {
        "sum": dist.ReduceOp.SUM,
        "product": dist.ReduceOp.PRODUCT,
        "min": dist.ReduceOp.MIN,
        "max": dist.ReduceOp.MAX,
    }
    for dtype in (
        torch.float32,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.int8,
        torch.float16,
        torch.bfloat16,
    ):
        for opname, op in ops.items():

            def run(
                g: dist.ProcessGroup,
                dtype: torch.dtype = dtype,
                op: dist.ReduceOp = op,  # type: ignore[assignment]
            ) -> Tensors:
                t = inputs((5, 7), dtype)
                dist.all_reduce(t, op=op, group=g)
                return [t]

            same(f"all_reduce {opname} {dtype}", run)
    for opname, op in {
        "band": dist.ReduceOp.BAND,
        "bor": dist.ReduceOp.BOR,
        "bxor": dist.ReduceOp.BXOR,
    }.items():

        def bitwise(g: dist.ProcessGroup, op: dist.ReduceOp = op) -> Tensors:  # type: ignore[assignment]
            t = inputs((33,), torch.int32)
            dist.all_reduce(t, op=op, group=g)
            return [t]

        same(f"all_reduce {opname}", bitwise)

    t = inputs((4, 6), torch.float32)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    ref = inputs((4, 6), torch.float32)
    dist.all_reduce(ref, group=GLOO)
    check("all_reduce avg", torch.allclose(t, ref / WORLD))
    premul = inputs((4, 6), torch.float32)
    dist.all_reduce(premul, op=dist._make_nccl_premul_sum(0.5))  # type: ignore[attr-defined]
    check("all_reduce premul_sum", torch.allclose(premul, ref * 0.5))

    def complex_(g: dist.ProcessGroup) -> Tensors:
        t = inputs((3, 4), torch.complex64)
        dist.all_reduce(t, group=g)
        return [t]

    same("all_reduce complex64", complex_)

    def strided(g: dist.ProcessGroup) -> Tensors:
        base = inputs((6, 8), torch.float32)
        if g is AC:
            view = base[:, ::2]
            assert not view.is_contiguous()
            dist.all_reduce(view, group=g)
            return [base]
        view = base[:, ::2].contiguous()
        dist.all_reduce(view, group=g)
        base[:, ::2] = view
        return [base]

    same("all_reduce non-contiguous", strided)

    def scalar(g: dist.ProcessGroup) -> Tensors:
        t = torch.tensor(float(RANK + 1))
        dist.all_reduce(t, group=g)
        return [t]

    same("all_reduce 0-d", scalar)

    def concurrent(g: dist.ProcessGroup) -> Tensors:
        ts = [inputs((1000 * (i + 1),), torch.float32, salt=i) for i in range(6)]
        works = [dist.all_reduce(t, group=g, async_op=True) for t in ts]
        for w in works:
            assert w is not None
            w.wait()
        return ts

    same("all_reduce async x6", concurrent)

    def big(g: dist.ProcessGroup) -> Tensors:
        t = inputs((3, 1 << 19), torch.float32)  # 6 MiB: several pipelined chunks
        dist.all_reduce(t, group=g)
        return [t]

    same("all_reduce 6 MiB", big)

    def coalesced(g: dist.ProcessGroup) -> Tensors:
        ts = [inputs((5,), torch.float32, salt=1), inputs((3, 2), torch.float32, salt=2)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist.all_reduce_coalesced(ts, group=g)
        return ts

    same("all_reduce_coalesced", coalesced)

    def manager(g: dist.ProcessGroup) -> Tensors:
        ts = [inputs((5,), torch.float32, salt=3), inputs((9,), torch.float32, salt=4)]
        with dist._coalescing_manager(group=g, async_ops=True) as cm:  # type: ignore[attr-defined]
            for t in ts:
                dist.all_reduce(t, group=g)
        cm.wait()
        return ts

    same("coalescing manager", manager)

    for root in range(WORLD):
        for opname, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):

            def reduce_(g: dist.ProcessGroup, root: int = root, op: dist.ReduceOp = op) -> Tensors:  # type: ignore[assignment]
                t = inputs((7, 3), torch.float32)
                dist.reduce(t, dst=root, op=op, group=g)
                return [t] if root == RANK else []  # gloo leaves scratch data elsewhere

            same(f"reduce {opname} root {root}", reduce_)

    def reduce_scatter(g: dist.ProcessGroup) -> Tensors:
        ins = [inputs((4, 3), torch.float32, salt=i) for i in range(WORLD)]
        out = torch.empty(4, 3)
        dist.reduce_scatter(out, ins, group=g)
        return [out]

    same("reduce_scatter", reduce_scatter)

    def rs_single(g: dist.ProcessGroup) -> Tensors:
        inp = inputs((WORLD * 5, 2), torch.float32)
        out = torch.empty(5, 2)
        reduce_scatter_single_fn(out, inp, group=g)
        return [out]

    same("reduce_scatter_single", rs_single)

    inp = inputs((WORLD, 5, 2), torch.float32)
    out = torch.empty(5, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecated name of reduce_scatter_single
        dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.AVG)
    ref = torch.empty(5, 2)
    reduce_scatter_single_fn(ref, inp.reshape(-1, 2), group=GLOO)
    check("reduce_scatter_tensor stacked avg", torch.allclose(out, ref / WORLD))


# -- data movement ----------------------------------------------------------------------------


def movement() -> None:
    for root in range(WORLD):

        def bcast(g: dist.ProcessGroup, root: int = root) -> Tensors:
            t = inputs((11, 2), torch.float64)
            dist.broadcast(t, src=root, group=g)
            return [t]

        same(f"broadcast root {root}", bcast)

    def all_gather(g: dist.ProcessGroup) -> Tensors:
        outs = [torch.empty(3, 4, dtype=torch.int64) for _ in range(WORLD)]
        dist.all_gather(outs, inputs((3, 4), torch.int64), group=g)
        return outs

    same("all_gather", all_gather)

    def refused(call: Callable[[], object]) -> str:
        try:
            call()
        except RuntimeError as exc:
            return "invalid tensor size" if "invalid tensor size" in str(exc) else repr(exc)
        return "accepted"

    def uneven(g: dist.ProcessGroup | None) -> str:
        outs = [torch.zeros(r + 1, 2) for r in range(WORLD)]
        return refused(lambda: dist.all_gather(outs, torch.full((RANK + 1, 2), 1.0), group=g))

    check("all_gather uneven refused as by gloo", uneven(None) == uneven(GLOO) != "accepted")

    def single(g: dist.ProcessGroup) -> Tensors:
        out = torch.empty(WORLD * 3, 5)
        all_gather_single_fn(out, inputs((3, 5), torch.float32), group=g)
        return [out]

    same("all_gather_single", single)

    stacked = torch.empty(WORLD, 3, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecated name of all_gather_single
        dist.all_gather_into_tensor(stacked, inputs((3, 5), torch.float32))
    check("all_gather_into_tensor stacked", torch.equal(stacked.reshape(-1, 5), single(GLOO)[0]))

    out = torch.zeros(WORLD * 4)
    out[RANK * 4 : (RANK + 1) * 4] = RANK + 1.0
    all_gather_single_fn(out, out[RANK * 4 : (RANK + 1) * 4])
    check(
        "all_gather_single in place",
        torch.equal(out, torch.arange(1, WORLD + 1.0).repeat_interleave(4)),
    )

    for root in range(WORLD):

        def gather(g: dist.ProcessGroup, root: int = root) -> Tensors:
            outs = [torch.empty(6) for _ in range(WORLD)] if root == RANK else None
            dist.gather(inputs((6,), torch.float32), outs, dst=root, group=g)
            return outs or []

        same(f"gather root {root}", gather)

        def scatter(g: dist.ProcessGroup, root: int = root) -> Tensors:
            out = torch.empty(2, 3)
            ins = [inputs((2, 3), torch.float32, salt=i) for i in range(WORLD)]
            dist.scatter(out, ins if root == RANK else None, src=root, group=g)
            return [out]

        same(f"scatter root {root}", scatter)

    def objects(g: dist.ProcessGroup) -> Tensors:
        objs: list[object] = [None] * WORLD
        dist.all_gather_object(objs, {"rank": RANK, "data": list(range(RANK + 3))}, group=g)
        lst: list[object] = [f"hello from {RANK}", RANK * 10]
        dist.broadcast_object_list(lst, src=WORLD - 1, group=g)
        gathered: list[object] | None = [None] * WORLD if RANK == 0 else None
        dist.gather_object(("x", RANK), gathered, dst=0, group=g)
        one: list[object] = [None]
        dist.scatter_object_list(one, [f"to {r}" for r in range(WORLD)], src=0, group=g)
        encoded = repr((objs, lst, gathered, one)).encode()
        return [torch.tensor(list(encoded), dtype=torch.uint8)]

    same("object collectives", objects)

    def alltoall(g: dist.ProcessGroup) -> Tensors:
        ins = [inputs((3, 2), torch.float32, salt=i) for i in range(WORLD)]
        outs = [torch.empty(3, 2) for _ in range(WORLD)]
        dist.all_to_all(outs, ins, group=g)
        return outs

    same("all_to_all", alltoall)

    # rank r sends (r + 2 * i + 1) rows to rank i (gloo's all_to_all needs even sizes)
    ins = [torch.full((RANK + 2 * i + 1, 2), float(10 * RANK + i)) for i in range(WORLD)]
    outs = [torch.empty(j + 2 * RANK + 1, 2) for j in range(WORLD)]
    dist.all_to_all(outs, ins)
    check(
        "all_to_all uneven",
        all(torch.equal(o, torch.full_like(o, 10.0 * j + RANK)) for j, o in enumerate(outs)),
    )

    def a2a_single(g: dist.ProcessGroup) -> Tensors:
        out = torch.empty(WORLD * 4, 3)
        dist.all_to_all_single(out, inputs((WORLD * 4, 3), torch.float32), group=g)
        return [out]

    same("all_to_all_single", a2a_single)

    def single_splits(g: dist.ProcessGroup) -> Tensors:
        in_splits = [RANK + i + 1 for i in range(WORLD)]
        out_splits = [j + RANK + 1 for j in range(WORLD)]
        inp = inputs((sum(in_splits), 3), torch.float32)
        out = torch.empty(sum(out_splits), 3)
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=g)
        return [out]

    same("all_to_all_single splits", single_splits)

    dist.barrier()
    check("barrier", dist.barrier(async_op=True) is not None)


# -- functional collectives (torch.distributed._functional_collectives, C++ dispatch) ---------


def functional() -> None:
    import torch.distributed._functional_collectives as fc

    def run(g: dist.ProcessGroup) -> Tensors:
        t = inputs((WORLD * 2, 3), torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated names, still what DTensor calls
            out = [
                fc.all_reduce(t, "sum", g),
                fc.all_gather_tensor(t, 0, g),
                fc.reduce_scatter_tensor(t, "sum", 0, g),
                fc.all_to_all_single(t, None, None, g),
                fc.broadcast(t, 1, g),
                *fc.all_reduce_coalesced([t, t * 2], "max", g),
            ]
        return [fc.wait_tensor(x) for x in out]  # type: ignore[no-untyped-call]

    same("functional collectives", run)


# -- point to point ---------------------------------------------------------------------------


def point_to_point() -> None:
    peer = 1 - RANK
    t = torch.full((5,), float(RANK))
    if RANK == 0:  # received in the other order: matched by tag (gloo would block here)
        dist.send(t, dst=1)
        dist.send(t + 1, dst=1, tag=7)
    else:
        dist.recv(t, src=0, tag=7)
        ok7 = torch.equal(t, torch.ones(5))
        dist.recv(t, src=0)
        check("send/recv tags", ok7 and torch.equal(t, torch.zeros(5)))
    got = torch.empty(3)
    if RANK == 1:
        dist.send(torch.arange(3.0), dst=0)
    else:
        src = dist.recv(got)
        check("recv any source", src == 1 and torch.equal(got, torch.arange(3.0)))
    a, b = torch.full((4,), float(RANK)), torch.empty(4)
    works = [dist.isend(a, dst=peer), dist.irecv(b, src=peer)]
    for w in works:
        assert w is not None
        w.wait()
    check("isend/irecv", torch.equal(b, torch.full((4,), float(peer))))
    ops = [
        dist.P2POp(dist.isend, torch.full((2,), RANK + 5.0), peer),
        dist.P2POp(dist.irecv, c := torch.empty(2), peer),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    check("batch_isend_irecv", torch.equal(c, torch.full((2,), peer + 5.0)))


# -- sub-groups -------------------------------------------------------------------------------


def sub_groups() -> None:
    pair = dist.new_group([0, 1], backend="aiocollect")
    t = torch.full((3,), RANK + 1.0)
    dist.all_reduce(t, group=pair)
    check("new_group all ranks", torch.equal(t, torch.full((3,), 3.0)))
    for member in range(WORLD):
        solo = dist.new_group([member])  # the default backend: aiocollect
        if member == RANK:
            s = torch.full((2,), 5.0)
            dist.all_reduce(s, group=solo)
            dist.broadcast(s, src=member, group=solo)  # global rank, translated to group 0
            check(
                f"new_group [{member}]",
                torch.equal(s, torch.full((2,), 5.0))
                and dist.get_backend(solo) == "aiocollect"
                and solo.size() == 1,
            )
        else:
            check(f"new_group [{member}] non-member", solo == dist.GroupMember.NON_GROUP_MEMBER)
    for g in dist.new_subgroups(group_size=1)[1]:  # type: ignore[no-untyped-call]
        del g
    check("new_subgroups", True)


# -- DDP and errors ---------------------------------------------------------------------------


def ddp() -> None:
    model_ac, loss_ac = torch_ddp.train(20, AC)
    model_gloo, loss_gloo = torch_ddp.train(20, GLOO)
    for p, q in zip(model_ac.parameters(), model_gloo.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    check(f"ddp 20 steps (loss {loss_ac:.6f} vs {loss_gloo:.6f})", abs(loss_ac - loss_gloo) < 1e-5)


def errors() -> None:
    bad = dist.new_group(backend="aiocollect", timeout=timedelta(seconds=20))
    t = torch.ones(4)
    if RANK == 0:
        work = dist.all_reduce(t, group=bad, async_op=True)
    else:
        work = dist.broadcast(t, src=0, group=bad, async_op=True)
    assert work is not None
    try:
        work.wait()
    except aiocollect.AiocollectError as exc:
        check(f"mismatch raised by wait(): {str(exc)[:60]}...", is_mismatch(exc))
    else:
        raise AssertionError("a mismatched collective did not fail")
    check(
        "work state",
        work.is_completed() and not work.is_success() and is_mismatch(work.exception()),
    )
    fut = work.get_future()
    try:
        fut.wait()
    except aiocollect.AiocollectError as exc:
        check("future failed with the error", fut.done() and is_mismatch(exc))
    else:
        raise AssertionError("the future of a failed collective completed normally")
    try:
        dist.all_reduce(t, group=bad)
    except aiocollect.GroupBrokenError as exc:
        check("next call raises GroupBrokenError", is_mismatch(exc.__cause__))
    else:
        raise AssertionError("the broken group accepted a collective")

    # DDP: rank 1 enters a barrier where rank 0 runs DDP's gradient allreduce.
    group = dist.new_group(backend="aiocollect", timeout=timedelta(seconds=20))
    model = torch.nn.parallel.DistributedDataParallel(torch_ddp.make_model(), process_group=group)
    x, y = torch_ddp.batch(RANK, 0)
    if RANK == 1:
        barrier = dist.barrier(group=group, async_op=True)
        assert barrier is not None
        try:
            barrier.wait()
        except aiocollect.AiocollectError as exc:
            check("ddp: the other rank's wait() raises", is_mismatch(exc))
        else:
            raise AssertionError("the barrier did not fail")
        return
    # completes: the future is normal
    torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
    try:
        aiocollect.torch.check(group)
    except aiocollect.GroupBrokenError:
        check("ddp: check() reports the failed allreduce", True)
    else:
        raise AssertionError("check() missed the failure")
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
    except Exception as exc:
        check(f"ddp: the next backward raises {type(exc).__name__}", True)
    else:
        raise AssertionError("backward on a broken group succeeded")


def peer_death() -> None:
    """Rank 1 dies (no cleanup); rank 0's allreduce fails with a PeerError, or, when the
    loss was already noticed before the allreduce started (the contract: any operation on
    a broken group), with GroupBrokenError whose cause is the PeerError. Which one depends
    on how fast rank 0 gets to the allreduce after the barrier; both name the dead rank."""
    group = dist.new_group(backend="aiocollect", timeout=timedelta(seconds=20))
    dist.barrier(group=group)
    if RANK == 1:
        say(f"ALL OK rank {RANK}")
        os._exit(0)
    t = torch.ones(3)
    work = dist.all_reduce(t, group=group, async_op=True)
    assert work is not None
    try:
        work.wait()
    except aiocollect.PeerError as exc:
        check(f"peer death: wait() raises {type(exc).__name__}", exc.rank == 1)
    except aiocollect.GroupBrokenError as exc:
        cause = exc.__cause__
        named = isinstance(cause, aiocollect.PeerError) and cause.rank == 1
        check("peer death: wait() raises GroupBrokenError from a PeerError", named)
    else:
        raise AssertionError("an allreduce with a dead peer succeeded")


def main() -> None:
    global AC, GLOO
    dist.init_process_group("aiocollect", timeout=timedelta(seconds=60))
    AC = dist.group.WORLD  # type: ignore[assignment]
    GLOO = dist.new_group(backend="gloo")
    assert WORLD == 2
    assert dist.get_backend() == "aiocollect"
    reductions()
    movement()
    functional()
    point_to_point()
    sub_groups()
    ddp()
    errors()
    dist.barrier(group=GLOO)
    peer_death()  # last: rank 1 is gone afterwards
    dist.destroy_process_group()
    say(f"ALL OK rank {RANK}")


if __name__ == "__main__":
    main()
