"""One registry per collective: algorithm names to whole algorithms.

``Group`` validates a call, asks the collective's registry for an algorithm by name
(``choose``: the one forced with ``algorithm=``, else the automatic choice of
``select.py``), packs the algorithm's name into the fingerprint and starts its ``run``;
nothing outside this module and ``aiocollect.fingerprint`` (which owns the wire codes)
depends on the order of the algorithms. Every algorithm of a collective has one signature,
so adding one is its function in its family's module, one line here and one code in
``fingerprint.ALGORITHM_CODES`` (checked when this module is imported).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, TypeVar

import numpy as np

from aiocollect._buffers import Array
from aiocollect.collectives import (
    barrier,
    bruck,
    direct,
    doubling,
    hierarchical,
    pipeline,
    pull,
    ring,
    segment,
    select,
    star,
    tree,
    vector,
)
from aiocollect.engine.op import Op
from aiocollect.engine.small import Program
from aiocollect.errors import UsageError
from aiocollect.fingerprint import ALGORITHM_CODES
from aiocollect.types import Collective

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Algorithm(Generic[P, T]):
    """A whole algorithm of one collective."""

    #: Its name, as ``algorithm=`` takes it and the fingerprint carries it.
    name: str
    #: The algorithm: a coroutine function over the operation's flat arrays.
    run: Callable[P, Awaitable[T]]
    #: The same frames as ``run`` for a message of one frame, as a rank's program for
    #: the one-frame path (``engine/small.py``), where the algorithm has that form:
    #: ``program(world_size, rank, *options)`` (the options per collective: allreduce's
    #: ``average``, broadcast's ``root``, none for barrier).
    program: Callable[..., Program] | None = None
    #: The world sizes ``program`` covers.
    covers: Callable[[int], bool] | None = None

    def one_frame(self, nbytes: int, world_size: int, chunk_bytes: int) -> bool:
        """Whether a message of ``nbytes`` runs as ``program`` (one frame, a world size
        it covers, something to send; see :meth:`empty_frames` for barrier)."""
        return 0 < nbytes <= chunk_bytes and self.empty_frames(world_size)

    def empty_frames(self, world_size: int) -> bool:
        """Whether ``program`` covers ``world_size`` (for barrier, whose frames are
        empty, the whole question)."""
        return self.program is not None and self.covers is not None and self.covers(world_size)


class Registry(Generic[P, T]):
    """The algorithms of one collective, by name, and its automatic choice."""

    def __init__(
        self,
        collective: Collective,
        algorithms: Sequence[Algorithm[P, T]],
        auto: Callable[[int, int, bool, bool], str] | None = None,
    ) -> None:
        self.collective = collective
        self.name = collective.name.lower()
        self.algorithms = {a.name: a for a in algorithms}
        codes = ALGORITHM_CODES[collective]
        if set(self.algorithms) != set(codes):
            raise ValueError(
                f"{self.name}: registered algorithms {sorted(self.algorithms)} "
                f"differ from the fingerprint's codes {sorted(codes)}"
            )
        #: The names, in the order of their wire codes.
        self.names = tuple(sorted(codes, key=codes.__getitem__))
        self._auto = auto
        self._default = self.names[0]

    def choose(
        self,
        algorithm: str | None,
        nbytes: int,
        world_size: int,
        one_thread: bool = False,
        pulls: bool = False,
    ) -> Algorithm[P, T]:
        """The algorithm named ``algorithm``, or for None and ``"auto"`` the automatic
        choice for a message of ``nbytes`` over ``world_size`` ranks, ``one_thread``
        when every rank runs on this thread, ``pulls`` when every rank reads every
        other's memory (the same on every rank: they depend only on values they
        share).

        Raises:
            UsageError: no algorithm of this collective has that name.
        """
        if algorithm is None or algorithm == "auto":
            auto = self._auto
            if auto is None:
                return self.algorithms[self._default]
            return self.algorithms[auto(nbytes, world_size, one_thread, pulls)]
        found = self.algorithms.get(algorithm) if isinstance(algorithm, str) else None
        if found is None:
            raise UsageError(
                f"{self.name} has no algorithm {algorithm!r}; choose one of "
                f"{', '.join(self.names)} or 'auto'"
            )
        return found


# One registry per collective; the comment gives ``run``'s arguments after the Op (arrays
# flat, blocks views of the caller's arrays, ``average``: divide by the world size).

#: (buf, ufunc, average): buf reduced in place on every rank.
ALLREDUCE: Registry[[Op, Array, np.ufunc, bool], None] = Registry(
    Collective.ALLREDUCE,
    [
        Algorithm("ring", ring.allreduce),
        Algorithm(
            "recursive_doubling",
            doubling.recursive_doubling,
            doubling.small_program,
            doubling.small_covers,
        ),
        Algorithm("halving_doubling", doubling.halving_doubling),
        Algorithm("star", star.allreduce, star.small_program, star.small_covers),
        Algorithm("pull", pull.allreduce),
        Algorithm("two_level", hierarchical.allreduce),
        Algorithm("segment", segment.allreduce),
    ],
    select.allreduce,
)
#: (buf, root): root's buf copied into every rank's.
BROADCAST: Registry[[Op, Array, int], None] = Registry(
    Collective.BROADCAST,
    [
        Algorithm("binomial", tree.broadcast, tree.small_program, tree.small_covers),
        Algorithm("pipeline", pipeline.broadcast),
        Algorithm("pull", pull.broadcast),
        Algorithm("two_level", hierarchical.broadcast),
    ],
    select.broadcast,
)
#: (buf, root, ufunc, average): buf reduced into root's; the others' unchanged.
REDUCE: Registry[[Op, Array, int, np.ufunc, bool], None] = Registry(
    Collective.REDUCE,
    [
        Algorithm("binomial", tree.reduce),
        Algorithm("two_level", hierarchical.reduce),
    ],
)
#: (send, blocks): every rank's send into its block.
ALLGATHER: Registry[[Op, Array, Sequence[Array]], None] = Registry(
    Collective.ALLGATHER,
    [
        Algorithm("ring", ring.allgather),
        Algorithm("direct", direct.allgather),
        Algorithm("pull", pull.allgather),
        Algorithm("bruck", bruck.allgather),
        Algorithm("two_level", hierarchical.allgather),
    ],
    select.allgather,
)
#: (send, dest, ufunc, average): block op.rank of the reduction of send into dest.
REDUCE_SCATTER: Registry[[Op, Array, Array, np.ufunc, bool], None] = Registry(
    Collective.REDUCE_SCATTER,
    [
        Algorithm("ring", ring.reduce_scatter),
        Algorithm("direct", direct.reduce_scatter),
        Algorithm("pull", pull.reduce_scatter),
        Algorithm("two_level", hierarchical.reduce_scatter),
    ],
    select.reduce_scatter,
)
#: (send, blocks on the root else None, root).
GATHER: Registry[[Op, Array, Sequence[Array] | None, int], None] = Registry(
    Collective.GATHER, [Algorithm("direct", direct.gather)]
)
#: (blocks on the root else None, out, root).
SCATTER: Registry[[Op, Sequence[Array] | None, Array, int], None] = Registry(
    Collective.SCATTER, [Algorithm("direct", direct.scatter)]
)
#: (send blocks, out blocks): send block i to rank i.
ALLTOALL: Registry[[Op, Sequence[Array], Sequence[Array]], None] = Registry(
    Collective.ALLTOALL, [Algorithm("pairwise", direct.alltoall)]
)
#: (arr) -> every rank's arr, in rank order.
ALLGATHERV: Registry[[Op, Array], list[Array]] = Registry(
    Collective.ALLGATHERV,
    [
        Algorithm("ring", vector.allgatherv),
        Algorithm("bruck", vector.allgatherv_bruck),
        Algorithm("two_level", hierarchical.allgatherv),
    ],
    select.allgatherv,
)
#: (arr, counts, out or None) -> the blocks received, in rank order.
ALLTOALLV: Registry[[Op, Array, list[int], Array | None], list[Array]] = Registry(
    Collective.ALLTOALLV, [Algorithm("pairwise", vector.alltoallv)]
)
#: ().
BARRIER: Registry[[Op], None] = Registry(
    Collective.BARRIER,
    [
        Algorithm("dissemination", barrier.barrier, barrier.small_program, barrier.small_covers),
        Algorithm("star", barrier.star, barrier.star_program, barrier.small_covers),
        Algorithm("two_level", hierarchical.barrier),
    ],
    select.barrier,
)

#: Every registry by collective name (``allreduce``...).
REGISTRIES: dict[str, Registry[..., Any]] = {
    r.name: r
    for r in (
        ALLREDUCE,
        BROADCAST,
        REDUCE,
        ALLGATHER,
        REDUCE_SCATTER,
        GATHER,
        SCATTER,
        ALLTOALL,
        ALLGATHERV,
        ALLTOALLV,
        BARRIER,
    )
}
