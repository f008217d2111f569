"""Which ranks of a group share a host: hosts, local ranks and leaders (sans-IO).

The rendezvous gives every world rank a host index (ranks whose records carry the same
hostname and boot id share one; :func:`aiocollect.rendezvous.hosts.host_indices`). A group
(the world group or one from ``split``) orders its hosts by their lowest group rank and the
ranks of a host by group rank, so every rank of the group computes the same
:class:`Topology` whatever the placement (blocked, cyclic or uneven).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Topology:
    """The hosts of one group, seen from one of its ranks.

    Attributes:
        hosts: Per host, its ranks (group ranks, ascending); hosts ordered by their
            lowest rank.
        host: The index in ``hosts`` of this rank's host.
        local_rank: This rank's index among its host's ranks.
        host_of: Per group rank, the index of its host.
        local_of: Per group rank, its index among its host's ranks.
    """

    hosts: tuple[tuple[int, ...], ...]
    host: int
    local_rank: int
    host_of: tuple[int, ...]
    local_of: tuple[int, ...]

    @staticmethod
    def of(host_ids: Sequence[int], rank: int) -> Topology:
        """The topology of a group whose rank ``i`` runs on host ``host_ids[i]`` (any
        hashable labels; equal labels share a host), seen from group rank ``rank``."""
        order: dict[int, list[int]] = {}
        for r, h in enumerate(host_ids):
            order.setdefault(h, []).append(r)
        hosts = tuple(tuple(ranks) for ranks in order.values())
        host_of = [0] * len(host_ids)
        local_of = [0] * len(host_ids)
        for h, ranks in enumerate(hosts):
            for i, r in enumerate(ranks):
                host_of[r], local_of[r] = h, i
        return Topology(hosts, host_of[rank], local_of[rank], tuple(host_of), tuple(local_of))

    @property
    def leaders(self) -> tuple[int, ...]:
        """Per host, its leader: its lowest group rank."""
        return tuple(ranks[0] for ranks in self.hosts)

    @property
    def local(self) -> tuple[int, ...]:
        """The ranks of this rank's host."""
        return self.hosts[self.host]

    @property
    def two_level(self) -> bool:
        """Whether the group spans several hosts with several ranks on some: where the
        two-level algorithms pay (one host, or one rank per host, stays flat)."""
        return len(self.hosts) > 1 and any(len(ranks) > 1 for ranks in self.hosts)

    def two_level_peers(self, root: int = -1) -> frozenset[int]:
        """The group ranks this rank exchanges frames with in a two-level operation
        (``collectives/hierarchical.py``), whatever the message size: the ranks of its
        host (the phases inside a host), the other leaders if it leads its host (the one-
        leader phases), and on every other host the ranks whose share of a message
        overlaps its own (the inter-host rings of the several-leaders allreduce: local
        rank ``i`` of ``R`` holds ``[i/R, (i+1)/R)`` of the message, and the shares are
        cut where any host's bounds fall). With a ``root`` (broadcast, reduce), the root
        stands for its host among the leaders: the root and the other hosts' leaders
        are each other's peers. Symmetric for one ``root``: ``b`` is in ``a``'s set
        exactly when ``a`` is in ``b``'s. The links a group makes for a two-level
        operation."""
        mine = self.local
        out = set(mine)
        if self.local_rank == 0:
            out.update(self.leaders)
        i, size = self.local_rank, len(mine)
        for h, ranks in enumerate(self.hosts):
            if h == self.host:
                continue
            r = len(ranks)  # [j/r, (j+1)/r) overlaps [i/size, (i+1)/size):
            out.update(
                ranks[j] for j in range(r) if j * size < (i + 1) * r and i * r < (j + 1) * size
            )
        if root >= 0:
            root_host = self.host_of[root]
            reps = [root if h == root_host else ranks[0] for h, ranks in enumerate(self.hosts)]
            if mine[self.local_rank] in reps:
                out.update(reps)
        out.discard(mine[self.local_rank])
        return frozenset(out)

    def describe(self) -> dict[str, Any]:
        """The topology as plain values (``Group.statistics()``, ``aiocollect info``):
        ``hosts`` (ranks per host), ``host``, ``local_rank``, ``leaders``, ``two_level``."""
        return {
            "hosts": [list(ranks) for ranks in self.hosts],
            "host": self.host,
            "local_rank": self.local_rank,
            "leaders": list(self.leaders),
            "two_level": self.two_level,
        }
