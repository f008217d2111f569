"""The fingerprint (aiocollect.fingerprint) and the algorithm registries
(collectives/registry.py): the wire layout is pinned, every registered algorithm has a wire
code, and dispatch is by name."""

from __future__ import annotations

import numpy as np
import pytest

from aiocollect.collectives import doubling, registry, ring, select
from aiocollect.errors import UsageError
from aiocollect.fingerprint import ALGORITHM_CODES, describe, pack, unpack
from aiocollect.types import Collective, ReduceOp, dtype_code

F32 = np.zeros(10, np.float32)


@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        # the layout every version of aiocollect sends: collective | algorithm << 5, dtype,
        # elements, op, root
        (
            {"coll": Collective.ALLREDUCE, "op": ReduceOp.SUM, "algorithm": "ring"},
            (3, 11, 10, 1, -1),
        ),
        (
            {"coll": Collective.ALLREDUCE, "op": ReduceOp.MAX, "algorithm": "recursive_doubling"},
            (3 | 1 << 5, 11, 10, 4, -1),
        ),
        (
            {"coll": Collective.ALLREDUCE, "op": ReduceOp.AVG, "algorithm": "halving_doubling"},
            (3 | 2 << 5, 11, 10, 5, -1),
        ),
        (
            {"coll": Collective.BROADCAST, "root": 2, "algorithm": "pipeline"},
            (2 | 1 << 5, 11, 10, 0, 2),
        ),
        ({"coll": Collective.ALLGATHER, "algorithm": "direct"}, (5 | 1 << 5, 11, 10, 0, -1)),
        (
            {"coll": Collective.REDUCE_SCATTER, "op": ReduceOp.SUM, "algorithm": "direct"},
            (9 | 1 << 5, 11, 10, 1, -1),
        ),
        ({"coll": Collective.ALLGATHERV, "count": 0, "algorithm": "ring"}, (6, 11, 0, 0, -1)),
        # the single-algorithm collectives: code 0, named by their registry's only algorithm
        (
            {"coll": Collective.REDUCE, "op": ReduceOp.SUM, "root": 1, "algorithm": "binomial"},
            (4, 11, 10, 1, 1),
        ),
        ({"coll": Collective.GATHER, "root": 2, "algorithm": "direct"}, (7, 11, 10, 0, 2)),
        ({"coll": Collective.SCATTER, "root": 0, "algorithm": "direct"}, (8, 11, 10, 0, 0)),
        ({"coll": Collective.ALLTOALL, "algorithm": "pairwise"}, (10, 11, 10, 0, -1)),
        (
            {"coll": Collective.ALLTOALLV, "count": 0, "algorithm": "pairwise"},
            (11, 11, 0, 0, -1),
        ),
        # no registry runs these: no algorithm, code 0
        ({"coll": Collective.SEND}, (12, 11, 10, 0, -1)),
    ],
)
def test_pack_keeps_the_wire_layout(kwargs: dict[str, object], want: tuple[int, ...]) -> None:
    coll = kwargs.pop("coll")
    assert isinstance(coll, Collective)
    assert pack(coll, F32, **kwargs) == want  # type: ignore[arg-type]


def test_pack_without_an_array() -> None:
    assert pack(Collective.BARRIER, None, algorithm="dissemination") == (1, 0, 0, 0, -1)
    assert pack(Collective.OBJECT, None, count=0, root=3) == (14, 0, 0, 0, 3)


@pytest.mark.parametrize(
    ("coll", "algorithm"),
    [
        *((c, None) for c in ALGORITHM_CODES),  # a registry runs it: its name is required
        (Collective.SEND, "direct"),  # no registry runs it: no name
        (Collective.OBJECT, "ring"),
        (Collective.GATHER, "ring"),  # not one of its algorithms
    ],
)
def test_pack_refuses_a_missing_or_foreign_algorithm(
    coll: Collective, algorithm: str | None
) -> None:
    with pytest.raises(KeyError):
        pack(coll, F32, algorithm=algorithm)


def test_unpack_inverts_pack_and_tolerates_unknown_codes() -> None:
    f = unpack(pack(Collective.BROADCAST, F32, root=1, algorithm="pipeline"))
    assert (f.collective, f.algorithm, f.dtype, f.elements, f.op, f.root) == (
        Collective.BROADCAST,
        "pipeline",
        dtype_code(F32.dtype),
        10,
        0,
        1,
    )
    assert unpack((13, 0, 0, 0, -1)).collective is None  # 13 (SPLIT) is reserved
    assert unpack((3 | 7 << 5, 0, 0, 0, -1)).algorithm is None
    assert describe((31, 0, 0, 0, -1)).startswith("collective#31(")


def test_describe_names_the_algorithm_where_there_is_a_choice() -> None:
    text = describe(pack(Collective.ALLREDUCE, F32, op=ReduceOp.MAX, algorithm="ring"))
    assert text == "allreduce[ring](count=10, dtype=float32, op=MAX)"
    assert describe(
        pack(Collective.REDUCE, F32, op=ReduceOp.SUM, root=2, algorithm="binomial")
    ) == ("reduce[binomial](count=10, dtype=float32, op=SUM, root=2)")
    assert describe(pack(Collective.GATHER, F32, root=2, algorithm="direct")) == (
        "gather(count=10, dtype=float32, root=2)"
    )


def test_every_registry_matches_the_wire_codes() -> None:
    assert {r.collective for r in registry.REGISTRIES.values()} == set(ALGORITHM_CODES)
    for name, reg in registry.REGISTRIES.items():
        codes = ALGORITHM_CODES[reg.collective]
        assert name == reg.collective.name.lower()
        assert list(reg.names) == sorted(codes, key=codes.__getitem__)
        assert set(reg.algorithms) == set(codes)
        assert max(codes.values()) < 8  # three bits in the fingerprint


def test_a_registry_refuses_an_algorithm_without_a_code() -> None:
    with pytest.raises(ValueError, match="differ from the fingerprint's codes"):
        registry.Registry(Collective.BARRIER, [registry.Algorithm("gossip", ring.allreduce)])


def test_choose_by_name_and_auto() -> None:
    reg = registry.ALLREDUCE
    assert reg.choose("ring", 4, 4).run is ring.allreduce
    assert reg.choose(None, 4, 4).name == "star"
    assert reg.choose(None, select.ALLREDUCE_DOUBLING_MAX, 3).name == "star"
    assert reg.choose(None, 4, 8).name == "recursive_doubling"
    assert reg.choose(None, select.ALLREDUCE_DOUBLING_MAX + 1, 4).name == "halving_doubling"
    assert reg.choose("auto", select.ALLREDUCE_HALVING_MAX, 4).name == "halving_doubling"
    assert reg.choose(None, select.ALLREDUCE_HALVING_MAX + 1, 4).name == "ring"
    assert reg.choose(None, select.ALLREDUCE_HALVING_MAX + 1, 3).name == "ring"
    # large groups: halving-doubling while the ring's blocks are small
    block = select.RING_BLOCK_MIN
    assert reg.choose(None, 8 * block, 8).name == "halving_doubling"
    assert reg.choose(None, 8 * block + 1, 8).name == "ring"
    assert reg.choose(None, 1 << 20, 1024).name == "halving_doubling"
    assert reg.choose(None, 64 << 20, 1024).name == "ring"
    assert reg.choose(None, select.TWO_RANK_DOUBLING_MAX, 2).name == "recursive_doubling"
    assert reg.choose("recursive_doubling", 4, 4).program is doubling.small_program
    assert registry.BROADCAST.choose(None, 1 << 20, 4).name == "pipeline"
    assert registry.ALLGATHER.choose(None, 4 * select.DIRECT_BLOCK_MAX, 4).name == "direct"
    assert registry.BARRIER.choose(None, 0, 3).name == "star"
    assert registry.BARRIER.choose(None, 0, 4).name == "star"
    assert registry.BARRIER.choose(None, 0, 2).name == "dissemination"
    assert registry.BARRIER.choose(None, 0, 5).name == "dissemination"


@pytest.mark.parametrize("bad", ["tree", 1, ["ring"]])
def test_choose_refuses_unknown_names(bad: object) -> None:
    with pytest.raises(
        UsageError,
        match=r"allreduce has no algorithm .*; choose one of "
        r"ring, recursive_doubling, halving_doubling, star, pull, two_level, segment or 'auto'",
    ):
        registry.ALLREDUCE.choose(bad, 4, 2)  # type: ignore[arg-type]


def test_one_frame_form_only_where_it_applies() -> None:
    rd = registry.ALLREDUCE.algorithms["recursive_doubling"]
    assert rd.one_frame(64, 4, 1 << 20)
    assert not rd.one_frame(64, 3, 1 << 20)  # not a power of two
    assert not rd.one_frame(0, 4, 1 << 20)  # nothing to send
    assert not rd.one_frame(2 << 20, 4, 1 << 20)  # more than one frame
    assert not registry.ALLREDUCE.algorithms["ring"].one_frame(64, 4, 1 << 20)
    assert registry.BROADCAST.algorithms["binomial"].one_frame(64, 3, 1 << 20)
    assert not registry.BROADCAST.algorithms["binomial"].one_frame(64, 1, 1 << 20)
