"""The peers a group links when it forms (collectives/neighbours.py): symmetric, few, and
every partner of the algorithms that talk to neighbours only. No event loop."""

from __future__ import annotations

import math

import pytest

from aiocollect.collectives import barrier, doubling, tree
from aiocollect.collectives.neighbours import NEIGHBOUR_CODES, neighbours
from aiocollect.fingerprint import ALGORITHM_CODES
from aiocollect.types import Collective

pytestmark = pytest.mark.timeout(30)

SIZES = [*range(1, 34), 64, 100, 128, 1000, 1024]


def _partners(program: object) -> set[int]:
    return {p for st in program.steps for p in (st.send_to, st.recv_from) if p >= 0}  # type: ignore[attr-defined]


@pytest.mark.parametrize("n", SIZES)
def test_symmetric_and_few(n: int) -> None:
    bound = 3 * math.ceil(math.log2(n)) + 2 if n > 1 else 0
    for r in range(n):
        mine = neighbours(n, r)
        assert r not in mine
        assert all(0 <= p < n for p in mine)
        assert len(mine) <= bound, (n, r, sorted(mine))
        for p in mine:
            assert r in neighbours(n, p), (n, r, p)


@pytest.mark.parametrize("n", range(2, 26))
def test_covers_the_one_frame_programs(n: int) -> None:
    """Every partner of the dissemination barrier, of binomial trees from every root and of
    recursive doubling (power-of-two sizes) is a neighbour."""
    for r in range(n):
        mine = neighbours(n, r)
        assert _partners(barrier.small_program(n, r)) <= mine
        for root in range(n):
            assert _partners(tree.small_program(n, r, root)) <= mine
        if n & (n - 1) == 0:
            assert _partners(doubling.small_program(n, r, False)) <= mine


@pytest.mark.parametrize("n", [3, 5, 6, 7, 12, 13])
def test_covers_the_fold_of_doubling(n: int) -> None:
    """Outside powers of two, recursive doubling folds the first 2 * rem ranks in pairs and
    maps the active ranks back: every rank of an exchange is a neighbour of the other."""
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    for r in range(n):
        mine = neighbours(n, r)
        if r < 2 * rem:
            assert r ^ 1 in mine
        v = r // 2 if r < 2 * rem and r % 2 else (r - rem if r >= 2 * rem else -1)
        if v < 0:
            continue
        mask = 1
        while mask < p:
            partner = v ^ mask
            assert (2 * partner + 1 if partner < rem else partner + rem) in mine
            mask <<= 1


def test_codes_name_only_neighbour_algorithms() -> None:
    codes = {
        (int(coll) | code << 5): (coll, name)
        for coll, names in ALGORITHM_CODES.items()
        for name, code in names.items()
    }
    named = {codes[c] for c in NEIGHBOUR_CODES if c in codes}
    assert (Collective.ALLTOALL, "pairwise") not in named
    assert (Collective.ALLGATHER, "direct") not in named
    assert all(name not in ("star", "pull", "direct", "pairwise") for _, name in named)
