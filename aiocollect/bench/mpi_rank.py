"""One rank of an Open MPI baseline round: ``mpirun -n N python -m
aiocollect.bench.mpi_rank --config C --label L --result F [--name T]``.

Started by :mod:`aiocollect.bench.runner` through :func:`aiocollect.bench.mpi.command`.
The rank and world size are ``MPI.COMM_WORLD``'s; the cases are measured by the timing
method every backend shares (:func:`aiocollect.bench.worker.sweep`), with mpi4py's
blocking collectives on numpy buffers (their nonblocking forms and ``Waitall`` for K in
flight). Like gloo's, the collectives block the event loop, which runs nothing else.
Rank 0 writes its round as JSON to ``--result``. Exit status 0, or 1 when mpi4py is
missing or a case failed (the message says why).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aiocollect.bench.spec import ROOT, Array, Shape
from aiocollect.bench.sweep import Buffers
from aiocollect.bench.worker import decode, sweep, write_result


class MpiBackend:
    """Collectives of mpi4py's ``COMM_WORLD`` (``MPI`` is the ``mpi4py.MPI`` module)."""

    name = "mpi"
    has_loop_probe = False
    algorithm = "mpi"

    def __init__(self, mpi: Any) -> None:
        self.mpi = mpi
        self.comm = mpi.COMM_WORLD
        self.rank: int = self.comm.Get_rank()
        self.world_size: int = self.comm.Get_size()

    def algorithm_for(self, collective: str, shp: Shape) -> str:
        del collective, shp
        return "mpi"

    def allocate(self, shp: Shape, dtype: np.dtype[Any]) -> Buffers:
        send = np.zeros(shp.send, dtype=dtype)
        out = None if shp.out is None else np.zeros(shp.out, dtype=dtype)
        return Buffers(send, out, (send, out))

    def _blocking(self, collective: str, send: Array, out: Any) -> None:
        comm, in_place = self.comm, self.mpi.IN_PLACE
        if collective == "allreduce":
            comm.Allreduce(in_place, send)
        elif collective == "broadcast":
            comm.Bcast(send, root=ROOT)
        elif collective == "reduce":
            if self.rank == ROOT:
                comm.Reduce(in_place, send, root=ROOT)
            else:
                comm.Reduce(send, None, root=ROOT)
        elif collective == "allgather":
            comm.Allgather(send, out)
        elif collective == "reduce_scatter":
            comm.Reduce_scatter_block(send, out)
        elif collective == "alltoall":
            comm.Alltoall(send, out)
        elif collective == "sendrecv":
            n, r = self.world_size, self.rank
            comm.Sendrecv(send, (r + 1) % n, recvbuf=out, source=(r - 1) % n)
        elif collective == "barrier":
            comm.Barrier()
        else:
            raise ValueError(f"unknown collective {collective!r}")

    def _start(self, collective: str, send: Array, out: Any) -> list[Any]:
        """The requests of ``collective`` started without waiting."""
        comm, in_place = self.comm, self.mpi.IN_PLACE
        if collective == "allreduce":
            return [comm.Iallreduce(in_place, send)]
        if collective == "broadcast":
            return [comm.Ibcast(send, root=ROOT)]
        if collective == "reduce":
            if self.rank == ROOT:
                return [comm.Ireduce(in_place, send, root=ROOT)]
            return [comm.Ireduce(send, None, root=ROOT)]
        if collective == "allgather":
            return [comm.Iallgather(send, out)]
        if collective == "reduce_scatter":
            return [comm.Ireduce_scatter_block(send, out)]
        if collective == "alltoall":
            return [comm.Ialltoall(send, out)]
        if collective == "sendrecv":
            n, r = self.world_size, self.rank
            return [comm.Isend(send, (r + 1) % n), comm.Irecv(out, (r - 1) % n)]
        if collective == "barrier":
            return [comm.Ibarrier()]
        raise ValueError(f"unknown collective {collective!r}")

    async def run(self, collective: str, bufs: Buffers) -> None:
        self._blocking(collective, *bufs.native)

    async def run_many(self, collective: str, sets: list[Buffers]) -> None:
        self.mpi.Request.Waitall([q for b in sets for q in self._start(collective, *b.native)])

    async def barrier(self) -> None:
        self.comm.Barrier()

    async def agree(self, value: int) -> int:
        box = np.array([value], dtype=np.int64)
        self.comm.Bcast(box, root=0)
        return int(box[0])

    async def gather(self, values: Array) -> Array:
        mine = np.ascontiguousarray(values, dtype=np.float64)
        out = np.empty((self.world_size, mine.size), dtype=np.float64)
        self.comm.Allgather(mine, out)
        return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of an MPI rank; returns its exit status."""
    parser = argparse.ArgumentParser(prog="python -m aiocollect.bench.mpi_rank")
    parser.add_argument("--config", required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--name", help="tag of the progress lines (default: mpi)")
    ns = parser.parse_args(argv)
    try:
        from mpi4py import MPI
    except ImportError as exc:
        print(f"aiocollect bench: the MPI baseline needs mpi4py: {exc}", file=sys.stderr)
        return 1
    cfg, _ = decode(ns.config)
    backend = MpiBackend(MPI)
    try:
        result = asyncio.run(sweep(backend, cfg, ns.label, ns.name))
    except Exception as exc:  # one rank's failure ends every rank (MPI's own abort)
        what = f"{type(exc).__name__}: {exc}"
        print(f"aiocollect bench: MPI rank {backend.rank}: {what}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)
        return 1
    if backend.rank == 0:
        write_result(Path(ns.result), [result])
    return 0


if __name__ == "__main__":
    sys.exit(main())
