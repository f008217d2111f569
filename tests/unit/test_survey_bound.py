"""Which peers a waiting operation asks what they called (engine/watchdog.py, ``asked``):
the peers it waits for first, then the others, in group order from this rank, at most
``SURVEY_MOST``; every peer of a small group."""

from __future__ import annotations

from dataclasses import dataclass

from aiocollect.engine.watchdog import SURVEY_MOST, asked


@dataclass
class _Waiting:
    """What ``asked`` reads of an operation: its world ranks and the group ranks it
    waits for."""

    ranks: list[int]
    waits_for: list[int]

    def silent_peers(self) -> list[int]:
        return self.waits_for


def test_a_small_group_asks_every_peer() -> None:
    op = _Waiting([10, 11, 12, 13], [2])
    assert asked(op, 11) == [12, 13, 10]  # (rank 12 is the one waited for: group rank 2)


def test_a_large_group_asks_the_peers_waited_for_then_the_nearest() -> None:
    world = list(range(1000, 1256))
    op = _Waiting(world, [200, 3])
    got = asked(op, 1005)  # group rank 5
    assert len(got) == SURVEY_MOST
    assert got[:2] == [1200, 1003]  # waited for, in order from rank 5: 200 before 3
    assert got[2:] == [1000 + q for q in range(6, 6 + SURVEY_MOST - 2)]
    assert 1005 not in got


def test_every_rank_is_asked_by_the_ranks_before_it() -> None:
    """Where every rank waits for every other (an all-to-all), each is still asked by its
    predecessors: the rank that called something else is found."""
    n = 256
    ranks = list(range(n))
    askers = {q: 0 for q in ranks}
    for me in ranks:
        for q in asked(_Waiting(ranks, [r for r in ranks if r != me]), me):
            askers[q] += 1
    assert set(askers.values()) == {SURVEY_MOST}
