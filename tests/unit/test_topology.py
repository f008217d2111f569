"""The topology of a group (engine/topology.py), the host indices the rendezvous derives
from its records (rendezvous/hosts.py) and the inter-host pieces of the two-level
allreduce (collectives/hierarchical.py): sans-IO."""

from __future__ import annotations

import pytest

from aiocollect.collectives.hierarchical import pieces
from aiocollect.engine.topology import Topology
from aiocollect.rendezvous.hosts import host_indices


def test_host_indices_by_hostname_and_boot_id() -> None:
    recs = {
        0: {"hostname": "a", "boot_id": "1"},
        1: {"hostname": "b", "boot_id": "1"},
        2: {"hostname": "a", "boot_id": "1"},
        3: {"hostname": "a", "boot_id": "2"},  # same name, another machine
        4: {},  # no host named: a host of its own
        5: {"hostname": "b", "boot_id": "1"},
    }
    assert host_indices(recs, 7) == [0, 1, 0, 2, 3, 1, 4]


@pytest.mark.parametrize(
    ("host_ids", "hosts", "two_level"),
    [
        ([0, 0, 1, 1], ((0, 1), (2, 3)), True),
        ([5, 9, 5, 9], ((0, 2), (1, 3)), True),  # cyclic; any labels
        ([0, 0, 0], ((0, 1, 2),), False),  # one host
        ([0, 1, 2], ((0,), (1,), (2,)), False),  # one rank per host
        ([0, 1, 0, 2], ((0, 2), (1,), (3,)), True),  # uneven
    ],
)
def test_topology(host_ids: list[int], hosts: tuple[tuple[int, ...], ...], two_level: bool) -> None:
    for rank in range(len(host_ids)):
        topo = Topology.of(host_ids, rank)
        assert topo.hosts == hosts
        assert topo.two_level is two_level
        assert rank in topo.local
        assert topo.local[topo.local_rank] == rank
        assert topo.leaders == tuple(h[0] for h in hosts)
        assert topo.describe()["hosts"] == [list(h) for h in hosts]


def test_pieces_even_hosts_are_the_local_blocks() -> None:
    topo = Topology.of([0, 1, 0, 1], 0)  # hosts (0, 2), (1, 3)
    assert pieces(topo, 10) == [(0, 5, (0, 1)), (5, 10, (2, 3))]


def test_pieces_uneven_hosts_cut_at_every_bound() -> None:
    topo = Topology.of([0, 0, 0, 1, 1, 2], 0)  # hosts of 3, 2 and 1 ranks
    got = pieces(topo, 12)
    assert got == [
        (0, 4, (0, 3, 5)),
        (4, 6, (1, 3, 5)),
        (6, 8, (1, 4, 5)),
        (8, 12, (2, 4, 5)),
    ]
    # every element in exactly one piece; fewer elements than ranks: no empty piece
    assert [p[:2] for p in pieces(topo, 1)] == [(0, 1)]
    assert pieces(topo, 0) == []


@pytest.mark.parametrize(
    "host_ids",
    [
        [0, 0, 1, 1, 2, 2, 3, 3],
        [0, 1, 2, 3, 0, 1, 2, 3],
        [0, 1, 0, 2, 1, 0, 1],  # uneven: 3 + 3 + 1
        [0] * 5 + [1] * 3 + [2] * 4,
    ],
)
def test_two_level_peers_hold_every_piece_ring_and_are_symmetric(host_ids: list[int]) -> None:
    """The links a two-level operation makes: symmetric, the host's ranks, the leaders
    among themselves, and every ring of every piece of every message size."""
    n = len(host_ids)
    topos = [Topology.of(host_ids, r) for r in range(n)]
    peers = [t.two_level_peers() for t in topos]
    for a in range(n):
        assert a not in peers[a]
        assert set(topos[a].local) - {a} <= peers[a]
        for b in peers[a]:
            assert a in peers[b], (a, b)
    leaders = topos[0].leaders
    for a in leaders:
        assert set(leaders) - {a} <= peers[a]
    for count in (1, 2, 3, 7, 12, 1000, 1001):
        for _, _, ring in pieces(topos[0], count):
            for k, r in enumerate(ring):  # ring neighbours on every other host
                assert ring[(k + 1) % len(ring)] in peers[r] | {r}
    # not the full mesh: ranks that share no piece and lead no host are not linked
    assert any(len(p) < n - 1 for p in peers)
    for root in range(n):  # a rooted operation: the root stands for its host
        rooted = [t.two_level_peers(root) for t in topos]
        reps = [
            root if h == topos[0].host_of[root] else ranks[0]
            for h, ranks in enumerate(topos[0].hosts)
        ]
        for a in range(n):
            assert peers[a] <= rooted[a]
            for b in rooted[a]:
                assert a in rooted[b], (root, a, b)
            if a in reps:
                assert set(reps) - {a} <= rooted[a]
