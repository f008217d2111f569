"""DistributedDataParallel training on the aiocollect torch backend.

Run with torchrun (two processes on this machine)::

    torchrun --nproc-per-node 2 examples/torch_ddp.py                  # aiocollect
    torchrun --nproc-per-node 2 examples/torch_ddp.py --backend gloo   # same result

Every rank trains the same small model on its own shard of a synthetic regression task for
20 steps; DDP averages the gradients with an allreduce on the chosen backend. Rank 0 prints
the final parameter checksum, which is the same (to float rounding) for every backend.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import aiocollect.torch  # noqa: F401 - registers the "aiocollect" backend


def make_model() -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank (DDP broadcasts anyway)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(64, 16, generator=gen)
    y = x[:, :4].sum(dim=1, keepdim=True).sin()
    return x, y


def train(steps: int, process_group: dist.ProcessGroup | None = None) -> tuple[nn.Module, float]:
    """``steps`` of DDP training (on ``process_group``, default the world); returns the
    trained module and the last loss of this rank."""
    model = DistributedDataParallel(make_model(), process_group=process_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss = torch.zeros(())
    for step in range(steps):
        x, y = batch(dist.get_rank(), step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return model.module, float(loss.detach())


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default=os.environ.get("DDP_BACKEND", "aiocollect"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save", help="write the final parameters here (torch.save)")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    try:
        model, loss = train(args.steps)
        if dist.get_rank() == 0:
            print(
                f"backend={args.backend} world_size={dist.get_world_size()} "
                f"steps={args.steps} loss={loss:.6f}"
            )
            print(f"final parameter checksum: {checksum(model):.10f}")
            if args.save:
                torch.save([p.detach().clone() for p in model.parameters()], args.save)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
