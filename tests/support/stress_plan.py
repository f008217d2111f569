"""Seeded random mixes of collectives, many in flight at once, checked exactly with numpy.

Every rank builds the same plan from the same seed: a list of operations, each on the world
group or one of two sub-groups, with a collective, dtype, op, root and a payload size drawn
so that sizes straddle every threshold of the data path (the one-frame small-operation path,
the chunk size, the shared-memory pull threshold, and, summed over what is in flight, the
per-link send window). Each rank then starts every operation of its groups without awaiting
any, awaits them all, and compares each result with the closed form computed from every
rank's (reproducible) input.

Data are small integers (floats included), so sums and products are exact in any order and
a result either matches to the bit or is wrong.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.collectives import select
from aiocollect.engine.op import SEND_WINDOW
from aiocollect.transport.cma import PULL_MIN

CHUNK = 1 << 20  # the default chunk size of a group whose links may copy (TCP, memory)
KINDS = (
    "allreduce",
    "broadcast",
    "reduce",
    "allgather",
    "gather",
    "scatter",
    "reduce_scatter",
    "alltoall",
    "allgatherv",
    "barrier",
    "sendrecv",
    "object",
)
DTYPES = ("int64", "int32", "uint8", "float64", "float32", "bool")


def boundary_sizes(chunk: int = CHUNK, pull_min: int = PULL_MIN) -> list[int]:
    """Payload sizes in bytes on both sides of each threshold (multiples of 8)."""
    sizes = {
        0,
        8,
        64,
        4096,
        # the automatic allreduce's switch points: star or recursive doubling, then
        # halving-doubling, then the ring
        select.ALLREDUCE_DOUBLING_MAX - 8,
        select.ALLREDUCE_DOUBLING_MAX + 8,
        64 * 1024,
        chunk - 64,
        chunk + 64,
        pull_min - 64,
        pull_min + 64,
        3 * chunk + 4096,
    }
    return sorted(s for s in sizes if s >= 0)


@dataclass(frozen=True)
class Spec:
    """One planned operation (the same on every rank)."""

    index: int
    group: str  # "world", "half" (ranks of equal parity) or "rest" (all but rank 0)
    kind: str
    dtype: str
    nbytes: int
    op: str
    root: int  # a rank of the operation's group


def _valid_ops(dtype: str) -> list[str]:
    if dtype == "bool":
        return ["BOR", "BAND", "MAX", "MIN"]
    if dtype.startswith("float"):
        return ["SUM", "MAX", "MIN"]
    return ["SUM", "MAX", "MIN", "BXOR", "BAND", "BOR"]


def plan(seed: int, world: int, count: int, sizes: list[int]) -> list[Spec]:
    """``count`` operations for a world of ``world`` ranks; the last one is a broadcast on
    the world group larger than the per-link send window, so that queued bytes overflow it."""
    rng = np.random.default_rng(seed)
    groups = ["world"] + (["half"] if world >= 3 else []) + (["rest"] if world >= 3 else [])
    out = []
    for i in range(count):
        group = str(
            rng.choice(
                groups,
                p=None
                if len(groups) == 1
                else [0.6] + [0.4 / (len(groups) - 1)] * (len(groups) - 1),
            )
        )
        kind = str(rng.choice(KINDS))
        dtype = str(rng.choice(DTYPES))
        ops = _valid_ops(dtype)
        out.append(
            Spec(
                i,
                group,
                kind,
                dtype,
                int(rng.choice(sizes)),
                ops[int(rng.integers(len(ops)))],
                int(rng.integers(1 << 16)),
            )
        )
    out.append(
        Spec(
            count,
            "world",
            "broadcast",
            "uint8",
            SEND_WINDOW + (8 << 20),
            "SUM",
            int(rng.integers(1 << 16)),
        )
    )
    return out


def _data(seed: int, spec: Spec, rank: int, count: int) -> np.ndarray[Any, Any]:
    """Rank ``rank``'s input for ``spec`` (group rank), reproducible on every rank."""
    rng = np.random.default_rng([seed, spec.index, rank])
    dt = np.dtype(spec.dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    hi = 4 if dt.kind == "f" else (256 if dt.itemsize == 1 else 1 << 20)
    return rng.integers(0, hi, count).astype(dt)


_NP_OPS: dict[str, Callable[..., Any]] = {
    "SUM": np.add,
    "MAX": np.maximum,
    "MIN": np.minimum,
    "BXOR": np.bitwise_xor,
    "BAND": np.bitwise_and,
    "BOR": np.bitwise_or,
}


def _reduce(op: str, arrays: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    dt = arrays[0].dtype
    if dt.kind == "b":
        fn = {
            "BOR": np.logical_or,
            "MAX": np.logical_or,
            "BAND": np.logical_and,
            "MIN": np.logical_and,
        }[op]
    else:
        fn = _NP_OPS[op]  # type: ignore[assignment]
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = fn(out, a).astype(dt)
    return out


Check = Callable[[Any], None]


def start(g: ac.Group, seed: int, spec: Spec) -> tuple[Any, Check]:
    """Start ``spec`` on ``g`` (this rank's handle of the spec's group) without awaiting it.

    Returns:
        The handle and a check of its result (raising AssertionError on a wrong one).
    """
    n, r = g.world_size, g.rank
    item = np.dtype(spec.dtype).itemsize
    count = spec.nbytes // item
    root = spec.root % n
    eq = np.testing.assert_array_equal

    def inp(rank: int, c: int = count) -> np.ndarray[Any, Any]:
        return _data(seed, spec, rank, c)

    kind = spec.kind
    if kind == "allreduce":
        buf = inp(r)
        want = _reduce(spec.op, [inp(x) for x in range(n)])
        return g.allreduce(buf, op=ac.ReduceOp[spec.op]), lambda _: eq(buf, want)
    if kind == "broadcast":
        buf = inp(r)
        want = inp(root)
        return g.broadcast(buf, root=root), lambda _: eq(buf, want)
    if kind == "reduce":
        buf = inp(r)
        want = _reduce(spec.op, [inp(x) for x in range(n)]) if r == root else buf.copy()
        return g.reduce(buf, root=root, op=ac.ReduceOp[spec.op]), lambda _: eq(buf, want)
    if kind in ("allgather", "gather"):
        send = inp(r)
        want = np.stack([inp(x) for x in range(n)])
        if kind == "allgather":
            return g.allgather(send), lambda res: eq(res, want)
        return g.gather(send, root=root), lambda res: eq(res, want) if r == root else _is_none(res)
    if kind == "scatter":
        per = max(count // n, 0)
        out = np.zeros(per, np.dtype(spec.dtype))
        full = inp(root, per * n).reshape(n, per)
        send = full if r == root else None  # type: ignore[assignment]
        want = full[r].copy()
        return g.scatter(send, out, root=root), lambda _: eq(out, want)
    if kind in ("reduce_scatter", "alltoall"):
        per = max(count // n, 0)
        send = inp(r, per * n)
        if kind == "reduce_scatter":
            want = _reduce(spec.op, [inp(x, per * n) for x in range(n)])[r * per : (r + 1) * per]
            return g.reduce_scatter(send, op=ac.ReduceOp[spec.op]), lambda res: eq(res, want)
        want = np.concatenate([inp(x, per * n)[r * per : (r + 1) * per] for x in range(n)])
        return g.alltoall(send), lambda res: eq(res, want)
    if kind == "allgatherv":
        mine = inp(r, _vcount(count, r))
        want_v = [inp(x, _vcount(count, x)) for x in range(n)]
        return g.allgatherv(  # type: ignore[return-value]
            mine
        ), lambda res: [eq(a, b) for a, b in zip(res, want_v, strict=True)] and None
    if kind == "barrier":
        return g.barrier(), _is_none
    if kind == "object":
        value = {
            "i": spec.index,
            "from": root,
            "data": inp(root, min(count, 4096)),
            "nested": [1, "two", None, 3.5],
        }
        obj = value if r == root else None

        def check_obj(res: Any) -> None:
            assert res["i"] == spec.index, res
            assert res["from"] == root, res
            eq(res["data"], value["data"])
            assert res["nested"] == [1, "two", None, 3.5]

        return g.broadcast_object(obj, root=root), check_obj
    assert kind == "sendrecv"
    if n == 1:
        return g.barrier(), _is_none
    got = np.zeros(count, np.dtype(spec.dtype))
    src, dst = (r - 1) % n, (r + 1) % n
    recv = g.recv(got, src, tag=spec.index)
    sent = g.send(inp(r), dst, tag=spec.index)
    want = inp(src)

    async def both() -> int:
        await sent
        return int(await recv)

    def check_p2p(res: Any) -> None:
        assert res == src
        eq(got, want)

    return asyncio.ensure_future(both()), check_p2p


def _vcount(count: int, rank: int) -> int:
    return max(0, count - 64 * rank) if count else 0


def _is_none(res: Any) -> None:
    assert res is None, res
