"""The libraries under test: aiocollect, and torch.distributed with gloo as the baseline.

Both implement :class:`aiocollect.bench.sweep.Backend`. The gloo backend's collectives
block the event loop (gloo runs them on its own threads and waits); that is harmless since
nothing else runs on a gloo rank's loop, and it keeps one timing method for both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import numpy as np

from aiocollect.bench.spec import ROOT, Array, Shape
from aiocollect.bench.sweep import Buffers

if TYPE_CHECKING:
    from aiocollect.group import Group


def _touched(shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
    """A zeroed array whose pages are resident (so RSS growth excludes user buffers)."""
    arr = np.empty(shape, dtype=dtype)
    arr.fill(0)
    return arr


class AiocollectBackend:
    """Collectives of an open aiocollect :class:`~aiocollect.group.Group`."""

    name = "aiocollect"
    has_loop_probe = True

    def __init__(self, group: Group, algorithm: str | None = None) -> None:
        self.group = group
        self.rank = group.rank
        self.world_size = group.world_size
        self.algorithm = algorithm or "auto"
        # Passed only when chosen, so the benchmark runs on versions without algorithm=.
        self._extra: dict[str, Any] = (
            {} if self.algorithm == "auto" else {"algorithm": self.algorithm}
        )

    def algorithm_for(self, collective: str, shp: Shape) -> str:
        """The algorithm that runs: the one forced, else ``auto:NAME`` when this version
        says what it chooses, else ``auto``."""
        if self.algorithm != "auto":
            return self.algorithm
        try:  # older versions lack it: the report must not depend on it
            return f"auto:{self.group.chosen_algorithm(collective, shp.total_bytes)}"
        except Exception:
            return "auto"

    def allocate(self, shp: Shape, dtype: np.dtype[Any]) -> Buffers:
        send = _touched(shp.send, dtype)
        out = None if shp.out is None else _touched(shp.out, dtype)
        return Buffers(send, out, (send, out))

    def _start(self, collective: str, bufs: Buffers) -> Awaitable[Any]:
        g, kw = self.group, self._extra
        send, out = bufs.native
        if collective == "allreduce":
            return g.allreduce(send, **kw)
        if collective == "broadcast":
            return g.broadcast(send, root=ROOT, **kw)
        if collective == "reduce":
            return g.reduce(send, root=ROOT, **kw)
        if collective == "allgather":
            return g.allgather(send, out, **kw)
        if collective == "reduce_scatter":
            return g.reduce_scatter(send, out, **kw)
        if collective == "alltoall":
            return g.alltoall(send, out, **kw)
        if collective == "sendrecv":  # (point to point: no algorithm to pass)
            return self._sendrecv(send, out)
        if collective == "barrier":
            return g.barrier(**kw)
        raise ValueError(f"unknown collective {collective!r}")

    async def _sendrecv(self, send: Array, out: Array) -> None:
        """Send ``send`` to rank r+1 while receiving ``out`` from rank r-1: the send
        starts, the receive is awaited, then the send (as a program would write it;
        ``asyncio.gather`` would add its own future and a loop turn, about 10 µs here)."""
        n, r = self.world_size, self.rank
        sent = self.group.send(send, (r + 1) % n)
        try:
            await self.group.recv(out, (r - 1) % n)
        finally:
            await sent

    async def run(self, collective: str, bufs: Buffers) -> None:
        await self._start(collective, bufs)

    async def run_many(self, collective: str, sets: list[Buffers]) -> None:
        await asyncio.gather(*[self._start(collective, bufs) for bufs in sets])

    async def barrier(self) -> None:
        await self.group.barrier()

    async def agree(self, value: int) -> int:
        box = np.array([value], dtype=np.int64)
        await self.group.broadcast(box, root=0)
        return int(box[0])

    async def gather(self, values: Array) -> Array:
        out: Array = await self.group.allgather(np.ascontiguousarray(values))
        return out


class GlooBackend:
    """torch.distributed with the gloo backend (``init_process_group`` already done)."""

    name = "gloo"
    has_loop_probe = False
    algorithm = "gloo"

    def algorithm_for(self, collective: str, shp: Shape) -> str:
        del collective, shp
        return "gloo"

    def __init__(self, torch: Any, rank: int, world_size: int) -> None:
        self.torch = torch
        self.dist = torch.distributed
        self.rank = rank
        self.world_size = world_size
        dist = self.dist
        # reduce_scatter_tensor is deprecated in favour of reduce_scatter_single where
        # the latter exists; both take (output, input).
        self._reduce_scatter = (
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        )

    def _tensor(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[Any, Array]:
        t = self.torch.empty(shape, dtype=getattr(self.torch, dtype.name))
        view: Array = t.numpy()
        view.fill(0)
        return t, view

    def allocate(self, shp: Shape, dtype: np.dtype[Any]) -> Buffers:
        send, send_view = self._tensor(shp.send, dtype)
        if shp.out is None:
            return Buffers(send_view, None, (send, None))
        out, out_view = self._tensor(shp.out, dtype)
        return Buffers(send_view, out_view, (send, out))

    def _issue(self, collective: str, bufs: Buffers, async_op: bool) -> list[Any]:
        """Start ``collective``: its work handles to wait for (none left to wait for
        without ``async_op``, except sendrecv's, whose send and receive always run
        asynchronously)."""
        dist = self.dist
        send, out = bufs.native
        if collective == "sendrecv":
            n, r = self.world_size, self.rank
            return [dist.isend(send, (r + 1) % n), dist.irecv(out, (r - 1) % n)]
        return [self._collective(collective, send, out, async_op)]

    def _collective(self, collective: str, send: Any, out: Any, async_op: bool) -> Any:
        """One collective call: its work handle with ``async_op``, else None (done)."""
        dist = self.dist
        if collective == "barrier":
            return dist.barrier(async_op=async_op)
        if collective == "allreduce":
            return dist.all_reduce(send, async_op=async_op)
        if collective == "broadcast":
            return dist.broadcast(send, src=ROOT, async_op=async_op)
        if collective == "reduce":
            return dist.reduce(send, dst=ROOT, async_op=async_op)
        if collective == "allgather":
            return dist.all_gather_into_tensor(out.view(-1), send, async_op=async_op)
        if collective == "reduce_scatter":
            return self._reduce_scatter(out, send, async_op=async_op)
        if collective == "alltoall":
            return dist.all_to_all_single(out, send, async_op=async_op)
        raise ValueError(f"unknown collective {collective!r}")

    async def run(self, collective: str, bufs: Buffers) -> None:
        for work in self._issue(collective, bufs, False):
            if work is not None:
                work.wait()

    async def run_many(self, collective: str, sets: list[Buffers]) -> None:
        works = [work for bufs in sets for work in self._issue(collective, bufs, True)]
        for work in works:
            work.wait()

    async def barrier(self) -> None:
        self.dist.barrier()

    async def agree(self, value: int) -> int:
        box = self.torch.tensor([value], dtype=self.torch.int64)
        self.dist.broadcast(box, src=0)
        return int(box.item())

    async def gather(self, values: Array) -> Array:
        t = self.torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        out = self.torch.empty(self.world_size * t.numel(), dtype=self.torch.float64)
        self.dist.all_gather_into_tensor(out, t)
        result: Array = out.numpy().reshape(self.world_size, -1)
        return result
