"""The operation fingerprint, packed and unpacked here only.

Every frame of an operation carries its fingerprint (``transport.wire.Header``), five
signed 64-bit integers, so that ranks which called different operations at one sequence
number find out (MismatchError) instead of exchanging garbage:

======  =====================================================================
field   value
======  =====================================================================
0       collective code (``types.Collective``, bits 0-4) | algorithm code << 5
1       dtype code (``types.dtype_code``; 0: no array)
2       element count (or 0 for the two-phase v-collectives and objects)
3       reduction op code (``types.op_code``; 0: none)
4       root (-1: none)
======  =====================================================================

The codes are part of the wire protocol: append only. :data:`ALGORITHM_CODES` names the
algorithm codes explicitly; the collectives' registries (``collectives/registry.py``)
dispatch by name and use the code only through :func:`pack`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from aiocollect.types import Collective, OpLike, dtype_code, dtype_label, op_code, op_label

Fingerprint = tuple[int, int, int, int, int]

#: Bits of the collective field below the algorithm code.
_ALG_SHIFT = 5
_COLL_MASK = (1 << _ALG_SHIFT) - 1
#: Largest algorithm code (three bits).
MAX_ALGORITHM_CODE = 7

#: Algorithm codes per collective, carried in bits 5-7 of the collective field. Part of the
#: protocol: never renumber, append only (at most 8 per collective).
ALGORITHM_CODES: dict[Collective, dict[str, int]] = {
    Collective.ALLREDUCE: {
        "ring": 0,
        "recursive_doubling": 1,
        "halving_doubling": 2,
        "star": 3,
        "pull": 4,
        "two_level": 5,
        "segment": 6,
    },
    Collective.BROADCAST: {"binomial": 0, "pipeline": 1, "pull": 2, "two_level": 3},
    Collective.REDUCE: {"binomial": 0, "two_level": 1},
    Collective.ALLGATHER: {"ring": 0, "direct": 1, "pull": 2, "two_level": 3, "bruck": 4},
    Collective.ALLGATHERV: {"ring": 0, "two_level": 1, "bruck": 2},
    Collective.REDUCE_SCATTER: {"ring": 0, "direct": 1, "pull": 2, "two_level": 3},
    Collective.GATHER: {"direct": 0},
    Collective.SCATTER: {"direct": 0},
    Collective.ALLTOALL: {"pairwise": 0},
    Collective.ALLTOALLV: {"pairwise": 0},
    Collective.BARRIER: {"dissemination": 0, "star": 1, "two_level": 2},
}
_ALGORITHM_NAMES: dict[Collective, dict[int, str]] = {
    coll: {code: name for name, code in codes.items()} for coll, codes in ALGORITHM_CODES.items()
}


class Fields(NamedTuple):
    """An unpacked fingerprint (:func:`unpack`)."""

    #: The collective, or None for a code no version of aiocollect sends.
    collective: Collective | None
    #: The algorithm's name, or None where the collective has no such code.
    algorithm: str | None
    collective_code: int
    dtype: int
    elements: int
    op: int
    root: int


def pack(
    coll: Collective,
    arr: np.ndarray[Any, np.dtype[Any]] | None,
    *,
    count: int | None = None,
    op: OpLike | None = None,
    root: int = -1,
    algorithm: str | None = None,
) -> Fingerprint:
    """The fingerprint of an operation on ``arr`` (None: no array; ``count`` overrides its
    element count) run by ``algorithm``: the name of the registry's algorithm for every
    collective of :data:`ALGORITHM_CODES` (those a registry runs, single-algorithm ones
    included), None for the others (tagged send/recv, objects), whose code is 0.

    Raises:
        UsageError: ``arr``'s dtype is not supported (from ``types.dtype_code``).
        KeyError: ``algorithm`` is None for a collective a registry runs, names one
            where none does, or has no code for ``coll`` (a caller's bug, never user
            input: the registries choose names from :data:`ALGORITHM_CODES`).
    """
    codes = ALGORITHM_CODES.get(coll)
    if (codes is None) != (algorithm is None):
        raise KeyError(f"{coll.name.lower()}: algorithm {algorithm!r}")
    alg = 0 if codes is None or algorithm is None else codes[algorithm]
    dcode = 0 if arr is None else dtype_code(arr.dtype)
    n = (0 if arr is None else arr.size) if count is None else count
    return (int(coll) | (alg << _ALG_SHIFT), dcode, n, 0 if op is None else op_code(op), root)


def unpack(fp: Fingerprint) -> Fields:
    """The fields of a fingerprint, also one a peer sent (unknown codes give None)."""
    code, dtype, count, op, root = fp
    try:
        coll: Collective | None = Collective(code & _COLL_MASK)
    except ValueError:
        coll = None
    names = _ALGORITHM_NAMES.get(coll, {}) if coll is not None else {}
    return Fields(coll, names.get(code >> _ALG_SHIFT), code, dtype, count, op, root)


def collective_label(code: int) -> str:
    """``allreduce[ring]`` from a fingerprint's collective field (the algorithm shown only
    where the collective has more than one)."""
    f = unpack((code, 0, 0, 0, -1))
    if f.collective is None:
        return f"collective#{code}"
    name = f.collective.name.lower()
    if f.algorithm is not None and len(ALGORITHM_CODES[f.collective]) > 1:
        return f"{name}[{f.algorithm}]"
    return name


def describe(fp: Fingerprint) -> str:
    """``allreduce[ring](count=10, dtype=float32, op=MAX)``: a fingerprint for error
    messages."""
    f = unpack(fp)
    parts = [f"count={f.elements}", f"dtype={dtype_label(f.dtype)}"]
    if f.op:
        parts.append(f"op={op_label(f.op)}")
    if f.root >= 0:
        parts.append(f"root={f.root}")
    return f"{collective_label(f.collective_code)}({', '.join(parts)})"
