"""The automatic algorithm choice: one rule per collective, by message size and world size.

The thresholds were measured on the development machine (docs/algorithms.md has the tables
and the commands). Every rank computes the same choice from the same (size, world size,
whether every rank runs on one thread: an in-process group, whose links all say so on
every rank; and whether the rendezvous records predict that every rank reads every other
rank's memory: ``pulls``, ``Fabric.pulls``), and
the choice travels in the frame fingerprint, so ranks that force different algorithms get
MismatchError instead of garbage. The registries (``registry.py``) call these rules for
``algorithm=None`` or ``"auto"``.
"""

from __future__ import annotations

#: Thresholds in bytes (per rank message size), measured; see docs/algorithms.md.
ALLREDUCE_DOUBLING_MAX = 16 * 1024
ALLREDUCE_HALVING_MAX = 64 * 1024
#: Past ALLREDUCE_HALVING_MAX, halving-doubling still replaces the ring while the ring's
#: blocks (S / n) are at most this: the ring's 2(n-1) steps grow with the group while
#: halving-doubling's 2 log2(n) do not, for the same bytes per rank. At four ranks this is
#: ALLREDUCE_HALVING_MAX's block (the measured crossover); at 1,024 ranks a 1 MiB
#: allreduce's ring would take 2,046 steps of 1 KiB (docs/algorithms.md).
RING_BLOCK_MIN = 16 * 1024
BROADCAST_BINOMIAL_MAX = 512 * 1024
DIRECT_BLOCK_MAX = 16 * 1024
#: The direct allgather (every rank sends to every other: n - 1 frames per rank, a link
#: to every rank) up to this many ranks; past it, Bruck's ceil(log2 n) rounds over the
#: links a group opens when it forms (docs/algorithms.md, "allgather").
DIRECT_MAX_RANKS = 16
#: With two ranks recursive doubling (one exchange) beats the ring (two) up to here.
TWO_RANK_DOUBLING_MAX = 64 * 1024
#: World sizes where the star (through rank 0) replaces recursive doubling up to
#: ALLREDUCE_DOUBLING_MAX: as few steps of latency (two), fewer messages (2(n-1) against
#: n log2 n, or the fold's extra steps at three ranks), and a rank 0 whose n-1 receives
#: and sends are still few. Past four ranks its root's serial messages outgrow recursive
#: doubling's log2(n) steps where every rank has a core (docs/algorithms.md, "Star").
STAR_WORLD = range(3, 5)
#: Where every rank reads the others' memory (``pulls``), allreduces from this size on
#: read the peers' buffers (``pull``): 3(n-1) small frames per rank instead of the ring's
#: frame per chunk and step. At 64-256 KiB the ring was as fast or faster; from 1 MiB the
#: pull allreduce was faster at two and four ranks (docs/algorithms.md, "Pull").
PULL_MIN = 1024 * 1024
#: Where every rank reads the others' memory (``pulls``), allreduces from SEGMENT_MIN to
#: SEGMENT_MAX copy through the ranks' shared slot segments (``segment``): plain memory
#: copies instead of the pull's ``process_vm_readv`` (which pins every page it reads),
#: and one round of frames fewer. Below, recursive doubling (two ranks) and the ring or
#: halving-doubling were faster; above, the pull (docs/algorithms.md, "Segment").
SEGMENT_MIN = 256 * 1024
SEGMENT_MAX = 4 * 1024 * 1024
#: The same for allgather (the gathered total) and reduce_scatter (the input), except that
#: a two-rank allgather reads from here up: at 1 and 4 MiB the ring's one pulled frame
#: per rank beat the pull's address and finished rounds, at 16 MiB it no longer did; and
#: a two-rank broadcast (binomial: one pulled frame per chunk) likewise
#: (docs/algorithms.md, "Pull").
TWO_RANK_PULL_MIN = 16 * 1024 * 1024
#: A broadcast of three or more ranks reads the root's buffer from here up (binomial was
#: faster at 1 MiB, the pull from 4 MiB at four ranks).
PULL_BROADCAST_MIN = 4 * 1024 * 1024
#: allgatherv and the object gathers exchange sizes and values by Bruck's log-step rounds
#: (collectives/bruck.py) from this many ranks on, by ring below (docs/algorithms.md,
#: "allgatherv": the measured crossover).
BRUCK_MIN_RANKS = 4
#: Bruck's rounds carry the rows while all of them together are at most this many bytes;
#: larger results go by ring, pipelined between neighbours.
BRUCK_MAX_BYTES = 64 * 1024


def star(n: int, one_thread: bool) -> bool:
    """Whether the star is the automatic choice for a small allreduce or a barrier: at
    three and four ranks, and at any world size from three when every rank runs on one
    thread (the in-process memory transport), where nothing runs in parallel and the
    operation's time is the sum of its messages' CPU."""
    return n in STAR_WORLD or (one_thread and n >= 3)


def allreduce(nbytes: int, n: int, one_thread: bool = False, pulls: bool = False) -> str:
    if pulls and SEGMENT_MIN <= nbytes <= SEGMENT_MAX and n >= 2:
        return "segment"
    if pulls and nbytes >= PULL_MIN and n >= 2:
        return "pull"
    if n <= 2:
        return "recursive_doubling" if nbytes <= TWO_RANK_DOUBLING_MAX else "ring"
    if nbytes <= ALLREDUCE_DOUBLING_MAX:
        return "star" if star(n, one_thread) else "recursive_doubling"
    if nbytes <= ALLREDUCE_HALVING_MAX or nbytes <= RING_BLOCK_MIN * n:
        return "halving_doubling"
    return "ring"


def barrier(nbytes: int, n: int, one_thread: bool = False, pulls: bool = False) -> str:
    """(``nbytes`` is 0: a barrier's frames are empty.)"""
    return "star" if star(n, one_thread) else "dissemination"


def broadcast(nbytes: int, n: int, one_thread: bool = False, pulls: bool = False) -> str:
    if pulls and n >= 2 and nbytes >= (PULL_BROADCAST_MIN if n > 2 else TWO_RANK_PULL_MIN):
        return "pull"
    return "binomial" if n <= 3 or nbytes <= BROADCAST_BINOMIAL_MAX else "pipeline"


def by_block(nbytes: int, n: int, one_thread: bool = False, pulls: bool = False) -> str:
    """Between direct and the ring, for allgather (``nbytes``: the gathered total) and
    reduce_scatter (the input). (``one_thread`` and ``pulls``, as every rule takes them:
    no difference here.)"""
    return "direct" if nbytes // max(1, n) <= DIRECT_BLOCK_MAX else "ring"


def _pull_or_by_block(nbytes: int, n: int, pulls: bool, least: int) -> str:
    """``pull`` from ``least`` bytes where every rank reads the others (and the blocks
    are past direct's), else :func:`by_block`."""
    if pulls and n >= 2 and nbytes // n > DIRECT_BLOCK_MAX and nbytes >= least:
        return "pull"
    return by_block(nbytes, n)


def allgather(nbytes: int, n: int, one_thread: bool = False, pulls: bool = False) -> str:
    """``nbytes``: the gathered total. Past :data:`DIRECT_MAX_RANKS` ranks, ``direct``'s
    blocks go by Bruck's rounds (``bruck``) instead."""
    chosen = _pull_or_by_block(nbytes, n, pulls, PULL_MIN if n > 2 else TWO_RANK_PULL_MIN)
    return "bruck" if chosen == "direct" and n > DIRECT_MAX_RANKS else chosen


def reduce_scatter(nbytes: int, n: int, one_thread: bool = False, pulls: bool = False) -> str:
    """``nbytes``: the input."""
    return _pull_or_by_block(nbytes, n, pulls, PULL_MIN)


def allgatherv(nbytes: int, n: int, one_thread: bool = False, pulls: bool = False) -> str:
    """``nbytes``: unknown at the call (0): the rows' sizes are exchanged first, and
    ``bruck`` sends large rows by ring (:data:`BRUCK_MAX_BYTES`)."""
    return "bruck" if n >= BRUCK_MIN_RANKS else "ring"
