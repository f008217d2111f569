"""Algorithm choice: names per collective and the automatic choice by size and world size.

The thresholds were measured on the development machine (2 cores, TCP loopback; see
docs/algorithms.md for the table and the command). Every rank computes the same choice from
the same (size, world size), and the choice travels in the frame fingerprint, so ranks that
force different algorithms get MismatchError instead of garbage.
"""

from __future__ import annotations

from aiocollect.errors import UsageError
from aiocollect.types import ALGORITHMS

#: Thresholds in bytes (per rank message size), measured; see docs/algorithms.md.
ALLREDUCE_DOUBLING_MAX = 16 * 1024
ALLREDUCE_HALVING_MAX = 64 * 1024
BROADCAST_BINOMIAL_MAX = 512 * 1024
DIRECT_BLOCK_MAX = 16 * 1024
#: With two ranks recursive doubling is one exchange against the ring's two; it wins up to
#: about here (4 B-64 KiB: 210-240 us against 330-580 us; 256 KiB: 0.63 ms against 0.49).
TWO_RANK_DOUBLING_MAX = 64 * 1024


def choose(collective: str, algorithm: str | None, nbytes: int, world_size: int) -> int:
    """Index of the algorithm to run (into ``ALGORITHMS[collective]``).

    Raises:
        UsageError: unknown algorithm name for this collective.
    """
    names = ALGORITHMS[collective]
    if algorithm not in (None, "auto"):
        if algorithm not in names:
            raise UsageError(
                f"{collective} has no algorithm {algorithm!r}; choose one of "
                f"{', '.join(names)} or 'auto'")
        return names.index(algorithm)
    return names.index(_auto(collective, nbytes, world_size))


def _auto(collective: str, nbytes: int, n: int) -> str:
    if collective == "allreduce":
        if n <= 2:
            return "recursive_doubling" if nbytes <= TWO_RANK_DOUBLING_MAX else "ring"
        if nbytes <= ALLREDUCE_DOUBLING_MAX:
            return "recursive_doubling"
        if nbytes <= ALLREDUCE_HALVING_MAX:
            return "halving_doubling"
        return "ring"
    if collective == "broadcast":
        return "binomial" if n <= 3 or nbytes <= BROADCAST_BINOMIAL_MAX else "pipeline"
    if collective in ("allgather", "reduce_scatter"):
        return "direct" if nbytes // max(1, n) <= DIRECT_BLOCK_MAX else "ring"
    return ALGORITHMS[collective][0]


def name(collective: str, index: int) -> str:
    return ALGORITHMS[collective][index]
