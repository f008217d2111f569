"""Data-parallel training of a small numpy MLP, with gradient allreduce overlapped with backprop.

What this example shows
-----------------------
* Every rank holds a full replica of a 2-hidden-layer tanh MLP with a softmax output, written
  in plain numpy. The data set is synthetic and deterministic: inputs are Gaussian and the
  labels come from a fixed-seed random "teacher" network, so every rank can build it locally.
* At every step the global batch is split between the ranks: each rank runs forward and
  backward on its own shard only.
* The backward pass goes layer by layer from the last. As soon as one layer's gradients are
  computed, ``group.allreduce(bucket, op=aiocollect.AVG)`` is *started* (its handle is kept,
  not awaited) and backprop moves on to the previous layer, so several allreduces are in
  flight at once while numpy keeps computing. Only before the optimizer step does the rank
  ``await asyncio.gather(*handles)``. This is the bucketed, overlapped scheme of PyTorch's
  DistributedDataParallel, in a hundred lines of asyncio.
* Parameters and gradients each live in one flat float32 vector; a layer's weight and bias
  gradients are adjacent, so each layer's "bucket" is one contiguous slice (one allreduce),
  and the momentum-SGD step is two vector operations.
* Rank 0 prints the per-epoch loss and accuracies (summed across ranks with an allreduce),
  then the allreduce throughput (algorithm and bus bandwidth, timed on dedicated allreduces
  of the full gradient), and every rank checks that all replicas ended with bit-identical
  weights by allgathering a SHA-256 of its parameter vector.

Run it with the launcher (``make demo`` does this)::

    aiocollect run -n 4 examples/data_parallel.py --epochs 8

or start N processes yourself with ``AIOCOLLECT_RANK``, ``AIOCOLLECT_WORLD_SIZE`` and
``AIOCOLLECT_STORE=tcp://127.0.0.1:PORT`` set (rank 0 hosts the store).

Exit status: 0 on success; 1 if the loss did not decrease clearly or the ranks' weights
differ at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

# One BLAS thread per rank (as torchrun does): N ranks each spinning up a BLAS thread per core
# oversubscribe the machine and make this demo ~10x slower. Must precede importing numpy.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402

import aiocollect  # noqa: E402

F32 = npt.NDArray[np.float32]
Labels = npt.NDArray[np.int64]
Handle = asyncio.Future[Any]

LOSS_RATIO = 0.7  # the last epoch's loss must be below this fraction of the first's


# -- data ------------------------------------------------------------------------------------


def make_dataset(n: int, features: int, classes: int, seed: int) -> tuple[F32, Labels]:
    """``n`` Gaussian inputs labelled by a fixed random teacher MLP (identical on all ranks)."""
    rng = np.random.default_rng([seed, 0xDA7A])
    w1 = rng.standard_normal((features, 64)) / np.sqrt(features)
    w2 = rng.standard_normal((64, classes)) * 2.0
    x = rng.standard_normal((n, features))
    labels = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype(np.int64)
    return x.astype(np.float32), labels


# -- model -----------------------------------------------------------------------------------


@dataclass
class Layer:
    """One dense layer; every array is a view into the model's flat vectors."""

    w: F32  # (fan_in, fan_out)
    b: F32  # (fan_out,)
    grad_w: F32
    grad_b: F32
    bucket: F32  # grad_w and grad_b together: the slice allreduced as soon as it is ready


@dataclass
class MLP:
    """A tanh MLP with a softmax output; parameters and gradients in flat float32 vectors."""

    sizes: Sequence[int]
    seed: int
    params: F32 = field(init=False)
    grads: F32 = field(init=False)
    velocity: F32 = field(init=False)
    layers: list[Layer] = field(init=False)

    def __post_init__(self) -> None:
        pairs = list(zip(self.sizes[:-1], self.sizes[1:], strict=True))
        total = sum(i * o + o for i, o in pairs)
        self.params = np.zeros(total, np.float32)
        self.grads = np.zeros(total, np.float32)
        self.velocity = np.zeros(total, np.float32)
        self.layers = []
        rng = np.random.default_rng([self.seed, 0x1417])
        at = 0
        for fan_in, fan_out in pairs:
            nw, size = fan_in * fan_out, fan_in * fan_out + fan_out
            w = self.params[at : at + nw].reshape(fan_in, fan_out)
            w[...] = rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)
            bucket = self.grads[at : at + size]
            self.layers.append(
                Layer(
                    w=w,
                    b=self.params[at + nw : at + size],
                    grad_w=bucket[:nw].reshape(fan_in, fan_out),
                    grad_b=bucket[nw:],
                    bucket=bucket,
                )
            )
            at += size

    def forward(self, x: F32) -> list[F32]:
        """Activations of every layer: ``[x, h1, ..., logits]``."""
        acts = [x]
        for i, layer in enumerate(self.layers):
            z = acts[-1] @ layer.w + layer.b
            acts.append(z if i == len(self.layers) - 1 else np.tanh(z))
        return acts

    def step(self, lr: float, momentum: float) -> None:
        """Momentum SGD on the (already averaged) gradient vector."""
        self.velocity *= np.float32(momentum)
        self.velocity += self.grads
        self.params -= np.float32(lr) * self.velocity


def softmax(logits: F32) -> F32:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    out: F32 = e / e.sum(axis=1, keepdims=True)
    return out


# -- training --------------------------------------------------------------------------------


@dataclass
class CommStats:
    """What the training loop saw of its allreduces."""

    allreduces: int = 0
    bytes: int = 0
    wait_seconds: float = 0.0
    max_in_flight: int = 0


async def train_step(
    group: aiocollect.Group, model: MLP, x: F32, y: Labels, global_batch: int, stats: CommStats
) -> tuple[float, int]:
    """Forward and backward on this rank's shard, overlapping each layer's gradient allreduce
    with the backward pass of the layers below it. Returns (loss sum, correct) of the shard."""
    acts = model.forward(x)
    probs = softmax(acts[-1])
    rows = np.arange(len(y))
    loss_sum = float(-np.log(probs[rows, y] + 1e-12).sum())
    correct = int((probs.argmax(axis=1) == y).sum())

    # d(mean loss over the *global* batch)/d(logits), scaled by world_size so that the AVG
    # allreduce gives exactly the global-batch mean gradient even when shards differ in size.
    delta = probs
    delta[rows, y] -= 1.0
    delta *= np.float32(group.world_size / global_batch)

    handles: list[Handle] = []
    for i in reversed(range(len(model.layers))):
        layer = model.layers[i]
        np.matmul(acts[i].T, delta, out=layer.grad_w)
        np.sum(delta, axis=0, out=layer.grad_b)
        # Start this layer's allreduce now; don't wait for it.
        handles.append(group.allreduce(layer.bucket, op=aiocollect.AVG))
        stats.allreduces += 1
        stats.bytes += layer.bucket.nbytes
        # Yield once so the allreduce puts its first chunks on the wire; they travel while
        # numpy computes the previous layer's gradients below.
        await asyncio.sleep(0)
        if i > 0:
            delta = (delta @ layer.w.T) * (1.0 - acts[i] * acts[i])

    stats.max_in_flight = max(stats.max_in_flight, sum(not h.done() for h in handles))
    start = time.perf_counter()
    await asyncio.gather(*handles)  # every bucket now holds the average over all ranks
    stats.wait_seconds += time.perf_counter() - start
    return loss_sum, correct


def shard(indices: npt.NDArray[np.int64], rank: int, world_size: int) -> npt.NDArray[np.int64]:
    """This rank's share of a batch: every world_size-th sample, starting at rank."""
    return indices[rank::world_size]


async def bench_allreduce(group: aiocollect.Group, model: MLP, iters: int) -> tuple[float, float]:
    """Seconds per allreduce of the full gradient: as one buffer, and as per-layer buckets
    all in flight at once (as in training)."""
    flat = model.grads.copy()
    buckets = [layer.bucket.copy() for layer in model.layers]
    for _ in range(2):  # warm-up
        await group.allreduce(flat, op=aiocollect.AVG)
    await group.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        await group.allreduce(flat, op=aiocollect.AVG)
    one_buffer = (time.perf_counter() - start) / iters
    await group.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        await asyncio.gather(*(group.allreduce(b, op=aiocollect.AVG) for b in buckets))
    bucketed = (time.perf_counter() - start) / iters
    return one_buffer, bucketed


def weights_digest(model: MLP) -> npt.NDArray[np.uint8]:
    return np.frombuffer(hashlib.sha256(model.params.tobytes()).digest(), np.uint8)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--epochs", type=int, default=8, help="passes over the data (default 8)")
    p.add_argument(
        "--batch",
        type=int,
        default=256,
        help="global batch size, split between the ranks (default 256)",
    )
    p.add_argument("--hidden", type=int, default=128, help="width of both hidden layers")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed for data and initial weights")
    p.add_argument("--samples", type=int, default=8192, help="training samples (default 8192)")
    p.add_argument("--features", type=int, default=32, help="input dimension (default 32)")
    p.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")
    p.add_argument(
        "--bench-iters",
        type=int,
        default=20,
        help="timed allreduces of the full gradient at the end (default 20)",
    )
    args = p.parse_args(argv)
    for name in ("epochs", "batch", "hidden", "samples", "features", "bench_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.classes < 2:
        p.error("--classes must be at least 2")
    return args


async def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    x_all, y_all = make_dataset(
        args.samples + args.samples // 4, args.features, args.classes, args.seed
    )
    x_train, y_train = x_all[: args.samples], y_all[: args.samples]
    x_test, y_test = x_all[args.samples :], y_all[args.samples :]

    async with aiocollect.open_group() as group:
        rank, n = group.rank, group.world_size

        def say(*parts: object) -> None:
            if rank == 0:
                print(*parts, flush=True)

        model = MLP([args.features, args.hidden, args.hidden, args.classes], args.seed)
        # Start every replica from rank 0's weights (as DDP does), whatever each rank drew.
        await group.broadcast(model.params, root=0)
        say(
            f"data-parallel MLP {list(model.sizes)} ({model.params.size} parameters) on "
            f"{n} ranks: {args.samples} samples, global batch {args.batch} "
            f"(~{-(-args.batch // n)} per rank), {args.epochs} epochs"
        )

        stats = CommStats()
        losses: list[float] = []
        test_idx = shard(np.arange(len(y_test)), rank, n)
        train_start = time.perf_counter()
        for epoch in range(args.epochs):
            epoch_start = time.perf_counter()
            wait_before = stats.wait_seconds
            order = np.random.default_rng([args.seed, epoch]).permutation(args.samples)
            loss_sum, correct, seen = 0.0, 0, 0
            for start in range(0, args.samples, args.batch):
                batch = order[start : start + args.batch]
                mine = shard(batch, rank, n)
                loss, ok = await train_step(
                    group, model, x_train[mine], y_train[mine], len(batch), stats
                )
                model.step(args.lr, args.momentum)
                loss_sum, correct, seen = loss_sum + loss, correct + ok, seen + len(mine)

            test_logits = model.forward(x_test[test_idx])[-1]
            test_ok = int((test_logits.argmax(axis=1) == y_test[test_idx]).sum())
            totals = np.array([loss_sum, correct, seen, test_ok, len(test_idx)], np.float64)
            await group.allreduce(totals)  # SUM over ranks
            mean_loss = float(totals[0] / totals[2])
            losses.append(mean_loss)
            say(
                f"epoch {epoch + 1:>2}/{args.epochs}  loss {mean_loss:.4f}  "
                f"train acc {100 * totals[1] / totals[2]:5.1f}%  "
                f"test acc {100 * totals[3] / totals[4]:5.1f}%  "
                f"({time.perf_counter() - epoch_start:.2f} s, waited "
                f"{stats.wait_seconds - wait_before:.2f} s for allreduces)"
            )
        train_seconds = time.perf_counter() - train_start

        one_buffer, bucketed = await bench_allreduce(group, model, args.bench_iters)
        nbytes = model.grads.nbytes
        bus = 2 * (n - 1) / n
        say(
            f"training: {stats.allreduces} allreduces, {stats.bytes / 1e6:.2f} MB, "
            f"{stats.wait_seconds:.2f} s of {train_seconds:.2f} s spent waiting for them "
            f"(up to {stats.max_in_flight} in flight at once)"
        )
        for what, seconds in (
            ("as one buffer", one_buffer),
            (f"as {len(model.layers)} concurrent buckets", bucketed),
        ):
            say(
                f"allreduce of the full gradient ({nbytes / 1e3:.1f} kB) {what}: "
                f"{seconds * 1e3:.3f} ms, {nbytes / seconds / 1e6:.1f} MB/s, "
                f"bus bandwidth {bus * nbytes / seconds / 1e6:.1f} MB/s"
            )

        digests = await group.allgather(weights_digest(model))
        differing = [r for r in range(n) if not np.array_equal(digests[r], digests[0])]

    if differing:
        print(
            f"error: rank {rank}: the weights of ranks {differing} differ from rank 0's "
            f"(sha256 {bytes(digests[0]).hex()[:16]}... vs "
            f"{[bytes(digests[r]).hex()[:16] for r in differing]})",
            file=sys.stderr,
        )
        return 1
    say(f"weights identical on all {n} ranks (sha256 {bytes(digests[0]).hex()[:16]}...)")
    if len(losses) > 1 and not losses[-1] < losses[0] * LOSS_RATIO:
        if rank == 0:
            print(
                f"error: the loss did not decrease enough: {losses[0]:.4f} in the first "
                f"epoch, {losses[-1]:.4f} in the last (needed < {LOSS_RATIO:g} x first)",
                file=sys.stderr,
            )
        return 1
    if len(losses) > 1:
        say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}: ok")
    return 0


def run(coro: Coroutine[Any, Any, int]) -> int:
    """``asyncio.run``, on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    result: int = uvloop.run(coro)
    return result


if __name__ == "__main__":
    sys.exit(run(main()))
