"""Which peers a rank's algorithms talk to: the links a group opens when it forms.

A group opens only these links at ``open_group`` (and a sub-group at ``split``); every
other link opens at first use (docs/design.md, "Links on demand"). :func:`neighbours`
is the union of the partners of every algorithm that talks to neighbours only:

- ring (allreduce, allgather, reduce_scatter, allgatherv, the object gathers) and the
  pipelined broadcast: ``r - 1`` and
  ``r + 1``;
- dissemination barrier, Bruck's allgather (allgather, allgatherv, the object gathers) and
  binomial trees (broadcast, reduce, broadcast_object) from any root: ``r + 2^k``
  and ``r - 2^k`` (mod n), ``2^k < n``;
- recursive doubling and halving-doubling: the folding pair and the partners
  ``v xor 2^k`` of the active ranks.

That is at most 3 ceil(log2 n) + 2 peers. :data:`NEIGHBOUR_CODES` names these algorithms by
the collective field of their fingerprint; an operation by any other algorithm (direct,
pairwise, star, pull, and any added later) opens every link of its group before it
starts, so a new algorithm is correct before it is listed here; the two-level algorithms
(:data:`TWO_LEVEL_CODES`) open the links of their host's ranks, the leaders and the
inter-host rings of their share.
"""

from __future__ import annotations

from functools import lru_cache

from aiocollect.fingerprint import ALGORITHM_CODES
from aiocollect.types import Collective

_NEIGHBOUR_ALGORITHMS: dict[Collective, tuple[str, ...]] = {
    Collective.ALLREDUCE: ("ring", "recursive_doubling", "halving_doubling"),
    Collective.BROADCAST: ("binomial", "pipeline"),
    Collective.REDUCE: ("binomial",),
    Collective.ALLGATHER: ("ring", "bruck"),
    Collective.REDUCE_SCATTER: ("ring",),
    Collective.ALLGATHERV: ("ring", "bruck"),
    Collective.BARRIER: ("dissemination",),
}

#: The collective fields (collective code | algorithm code << 5) of the operations whose
#: algorithm talks only to :func:`neighbours`.
NEIGHBOUR_CODES: frozenset[int] = frozenset(
    int(coll) | ALGORITHM_CODES[coll][name] << 5
    for coll, names in _NEIGHBOUR_ALGORITHMS.items()
    for name in names
) | {int(Collective.OBJECT)}  # (the object collectives: binomial tree, ring and Bruck)


#: The collective fields of the two-level operations (``collectives/hierarchical.py``):
#: they link the peers of :meth:`~aiocollect.engine.topology.Topology.two_level_peers`.
TWO_LEVEL_CODES: frozenset[int] = frozenset(
    int(coll) | names["two_level"] << 5
    for coll, names in ALGORITHM_CODES.items()
    if "two_level" in names
)


@lru_cache(maxsize=64)
def neighbours(n: int, rank: int) -> frozenset[int]:
    """The group ranks that group rank ``rank`` of ``n`` exchanges frames with in the
    algorithms of :data:`NEIGHBOUR_CODES`. Symmetric: ``b in neighbours(n, a)`` exactly
    when ``a in neighbours(n, b)``.

    Args:
        n: the group's size (>= 1).
        rank: this rank, in ``[0, n)``.

    Returns:
        The peers, without ``rank`` itself.
    """
    out: set[int] = set()
    dist = 1
    while dist < n:  # ring (dist 1), dissemination, binomial trees from any root
        out.add((rank + dist) % n)
        out.add((rank - dist) % n)
        dist <<= 1
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if rank < 2 * rem:  # the folding pair of recursive doubling
        out.add(rank ^ 1)
    v = rank // 2 if rank < 2 * rem and rank % 2 else (rank - rem if rank >= 2 * rem else -1)
    if v >= 0:
        mask = 1
        while mask < p:
            partner = v ^ mask
            out.add(2 * partner + 1 if partner < rem else partner + rem)
            mask <<= 1
    out.discard(rank)
    return frozenset(out)
