"""World size 8 through ``torch.distributed`` itself: collectives on strict subsets of the
ranks (what DistributedTest's ``*_group`` tests cover, which torch only runs at world size
8 or more) and the coalescing manager.

``python -m tests.torch.world8 DIR`` imports torch once, forks 8 rank processes (real
processes, real sockets, a FileStore in DIR) and exits 0 when every rank printed
``RANK r OK``; a rank's traceback otherwise.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import aiocollect.torch  # registers the backend

WORLD = 8
SUBSET = [1, 2, 5]  # not a prefix, not contiguous
OTHERS = [0, 3, 4, 6, 7]  # a second group, used at the same time


def _subset_checks(group: dist.ProcessGroup, members: list[int], rank: int) -> None:
    me = members.index(rank)  # the group rank
    n = len(members)
    t = torch.tensor([float(rank)] * 3)
    dist.all_reduce(t, group=group)
    assert t.tolist() == [float(sum(members))] * 3, t
    t = torch.tensor([float(rank)])
    dist.broadcast(t, src=members[-1], group=group)  # src is a global rank
    assert t.item() == members[-1], t
    outs = [torch.empty(2) for _ in range(n)]
    dist.all_gather(outs, torch.full((2,), float(rank)), group=group)
    assert [o[0].item() for o in outs] == [float(m) for m in members], outs
    t = torch.tensor([float(rank + 1)])
    dist.reduce(t, dst=members[1], op=dist.ReduceOp.PRODUCT, group=group)
    if me == 1:
        expected = 1.0
        for m in members:
            expected *= m + 1
        assert t.item() == expected, t
    gathered = [torch.empty(1) for _ in range(n)] if me == 0 else None
    dist.gather(torch.tensor([float(rank)]), gathered, dst=members[0], group=group)
    if gathered is not None:
        assert [g.item() for g in gathered] == [float(m) for m in members]
    out = torch.empty(1)
    chunks = [torch.tensor([float(10 * i)]) for i in range(n)] if me == n - 1 else None
    dist.scatter(out, chunks, src=members[-1], group=group)
    assert out.item() == 10.0 * me, out
    a2a_in = torch.tensor([float(100 * me + j) for j in range(n)])
    a2a_out = torch.empty(n)
    dist.all_to_all_single(a2a_out, a2a_in, group=group)
    assert a2a_out.tolist() == [float(100 * j + me) for j in range(n)], a2a_out
    dist.barrier(group=group)
    objs: list[object] = [None] * n
    dist.all_gather_object(objs, {"rank": rank}, group=group)
    assert objs == [{"rank": m} for m in members], objs
    assert dist.get_group_rank(group, rank) == me
    assert dist.get_world_size(group) == n


def _coalescing(group: dist.ProcessGroup, members: list[int], rank: int) -> None:
    big = 200_000
    a = torch.ones(big, 2)[:, 0]  # not contiguous: written back when the work finishes
    b = torch.full((big,), float(rank))
    c = torch.full((4,), float(rank))
    with dist._coalescing_manager(group=group, device=torch.device("cpu"), async_ops=True) as cm:  # type: ignore[attr-defined]
        dist.all_reduce(a, group=group)
        dist.all_reduce(b, group=group)
        dist.broadcast(c, src=members[0], group=group)
    cm.wait()
    assert int((a == len(members)).sum()) == big, a
    assert int((b == float(sum(members))).sum()) == big, b
    assert c.tolist() == [float(members[0])] * 4, c


def _ddp_sparse(rank: int) -> None:
    """DistributedDataParallel with sparse gradients (a sparse allreduce per bucket)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(WORLD + 2, 4, sparse=True)
    model = torch.nn.parallel.DistributedDataParallel(emb)
    model(torch.tensor([rank, WORLD])).sum().backward()  # row WORLD: every rank's
    grad = emb.weight.grad
    assert grad is not None, grad
    assert grad.is_sparse, grad
    expected = torch.zeros(WORLD + 2, 4)
    expected[:WORLD] = 1.0 / WORLD  # DDP averages: each rank's own row, once
    expected[WORLD] = 1.0
    assert torch.allclose(grad.to_dense(), expected), grad.to_dense()


def _ddp_no_sync_with_hook(rank: int) -> None:
    """Gradient accumulation under ``no_sync`` with a Python comm hook (what DistributedTest's
    ``test_accumulate_gradients_no_sync*`` cover, which build their model only when the
    backend is named gloo)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    lin = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.ones_(lin.weight)
    model = torch.nn.parallel.DistributedDataParallel(lin)
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    x = torch.full((1, 4), float(rank + 1))
    with model.no_sync():
        model(x).sum().backward()  # local only: grad = x
    model(x).sum().backward()  # synced: the mean over ranks of 2 x
    grad = lin.weight.grad
    assert grad is not None
    mean = sum(r + 1 for r in range(WORLD)) / WORLD
    assert torch.allclose(grad, torch.full((1, 4), 2 * mean)), grad


def rank_main(rank: int, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "aiocollect",
        store=dist.FileStore(path, WORLD),  # type: ignore[attr-defined]
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    subset = dist.new_group(SUBSET)
    others = dist.new_group(OTHERS)
    members, group = (SUBSET, subset) if rank in SUBSET else (OTHERS, others)
    assert subset == dist.GroupMember.NON_GROUP_MEMBER or rank in SUBSET
    _subset_checks(group, members, rank)
    _coalescing(group, members, rank)
    aiocollect.torch.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    if rank in SUBSET:
        aiocollect.torch.monitored_barrier(subset, timedelta(seconds=30))
    world = torch.tensor([1.0])
    dist.all_reduce(world)
    assert world.item() == WORLD
    _ddp_sparse(rank)
    _ddp_no_sync_with_hook(rank)
    dist.barrier()
    dist.destroy_process_group()
    print(f"RANK {rank} OK", flush=True)


def _child(rank: int, path: str) -> None:
    try:
        rank_main(rank, path)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def main(directory: str, timeout: float = 100.0) -> int:
    path = os.path.join(directory, "store")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_child, args=(r, path)) for r in range(WORLD)]
    for p in procs:
        p.start()
    codes = []
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
        codes.append(p.exitcode)
    print("exit codes", codes, flush=True)
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
