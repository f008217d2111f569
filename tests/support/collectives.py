"""Deterministic test data and numpy references for the collective tests, the
whole-collective sweeps and the staging-bound body (run over every transport)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.types import resolve_op

try:
    import ml_dtypes

    BF16: Any = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    BF16 = None

CHUNK = 16  # bytes: tiny, so small inputs take the multi-chunk path

DTYPES = [
    np.dtype(d)
    for d in (
        "bool",
        "int8",
        "int32",
        "int64",
        "uint8",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
] + ([BF16] if BF16 is not None else [])
CORE_DTYPES = [
    np.dtype(d) for d in ("bool", "int8", "int32", "int64", "float16", "float32", "float64")
]
OPS = list(ac.ReduceOp)


def counts_for(dtype: np.dtype[Any], chunk: int = CHUNK) -> list[int]:
    """0, 1, chunk-1, chunk+1 and several chunks plus a remainder (in elements)."""
    ce = max(1, chunk // dtype.itemsize)
    return sorted({0, 1, max(1, ce - 1), ce + 1, 3 * ce + max(1, ce // 2)})


def valid_ops(dtype: np.dtype[Any]) -> list[ac.ReduceOp]:
    out = []
    for op in OPS:
        try:
            resolve_op(op, dtype)
        except ac.UsageError:
            continue
        out.append(op)
    return out


def data(
    rank: int, count: int, dtype: np.dtype[Any], seed: int = 0, op: Any = None
) -> np.ndarray[Any, Any]:
    """Per-rank deterministic data; PROD gets values near 1 so products stay finite. A new
    writable array on every call (a test may reduce into it); the values are made once per
    arguments (:func:`_made`): in a sweep every rank of the process builds every rank's
    input for its reference, and drawing them took a sixth of an 8-rank sweep's time."""
    return _made(rank, count, dtype, seed, op is ac.ReduceOp.PROD).copy()


@functools.lru_cache(maxsize=4096)
def _made(
    rank: int, count: int, dtype: np.dtype[Any], seed: int, prod: bool
) -> np.ndarray[Any, Any]:
    """The values of :func:`data`, read-only (``prod``: near 1, for PROD)."""
    out = _draw(rank, count, dtype, seed, prod)
    out.flags.writeable = False
    return out


def _draw(
    rank: int, count: int, dtype: np.dtype[Any], seed: int, prod: bool
) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed * 1000 + rank * 7 + count)
    kind = dtype.kind if dtype != BF16 else "f"
    if kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    if kind in "iu":
        hi = 4 if prod else 100
        return rng.integers(0, hi, count).astype(dtype)
    base = rng.uniform(0.5, 1.5, count) if prod else rng.uniform(-4, 4, count)
    if kind == "c":
        return (base + 1j * rng.uniform(-1, 1, count)).astype(dtype)
    return base.astype(dtype)


def reference(arrays: list[np.ndarray[Any, Any]], op: Any) -> np.ndarray[Any, Any]:
    dtype = arrays[0].dtype
    rop, ufunc = resolve_op(op, dtype)
    wide = dtype
    if dtype.kind == "f" or dtype == BF16:
        wide = np.dtype(np.float64)
    if dtype.kind == "c":
        wide = np.dtype(np.complex128)
    acc = functools.reduce(lambda a, b: ufunc(a, b), [a.astype(wide) for a in arrays])
    if rop is ac.ReduceOp.AVG:
        acc = acc / len(arrays)
    return np.asarray(acc)


def assert_close(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], what: str = "") -> None:
    dtype = got.dtype
    if dtype.kind in "fc" or dtype == BF16:
        real = np.dtype(np.float32) if dtype == BF16 else np.empty(0, dtype).real.dtype
        eps = 2.0**-7 if dtype == BF16 else float(np.finfo(real).eps)
        rtol = 64 * eps
        np.testing.assert_allclose(
            got.astype(want.dtype), want, rtol=rtol, atol=rtol * 30, err_msg=what
        )
    else:
        np.testing.assert_array_equal(got, want.astype(dtype), err_msg=what)


async def allreduce_every_op(g: ac.Group, dtypes: list[Any]) -> int:
    """A rank's part of an allreduce of every valid op of every dtype in ``dtypes``, over
    the counts of :func:`counts_for`, each result checked against numpy; returns how many
    were checked (tests/collectives/test_sweep.py, and over shm with pulls)."""
    n, checked = g.world_size, 0
    for dtype in dtypes:
        for op in valid_ops(dtype):
            for count in counts_for(dtype):
                mine = data(g.rank, count, dtype, op=op)
                buf = mine.copy()
                got = await g.allreduce(buf, op=op)
                assert got is buf
                want = reference([data(r, count, dtype, op=op) for r in range(n)], op)
                assert_close(buf, want, f"allreduce {dtype} {op.name} count={count}")
                checked += 1
    return checked


async def move_every_way(g: ac.Group, dtypes: list[Any]) -> None:
    """A rank's part of every data-movement collective (broadcast, gather, scatter,
    allgather, reduce_scatter, alltoall, allgatherv) from every root, over the counts of
    :func:`counts_for` for each dtype in ``dtypes``, each result checked."""
    n, r = g.world_size, g.rank
    for dtype in dtypes:
        for count in counts_for(dtype):
            everyone = [data(x, count, dtype) for x in range(n)]
            for root in range(n):
                buf = everyone[r].copy()
                await g.broadcast(buf, root=root)
                np.testing.assert_array_equal(buf, everyone[root])
                out = await g.gather(everyone[r], root=root)
                if r == root:
                    np.testing.assert_array_equal(out, np.stack(everyone))
                else:
                    assert out is None
                res = np.empty(count, dtype)
                send = (
                    np.stack([data(root * 31 + x, count, dtype) for x in range(n)])
                    if r == root
                    else None
                )
                await g.scatter(send, res, root=root)
                np.testing.assert_array_equal(res, data(root * 31 + r, count, dtype))
            out = await g.allgather(everyone[r])
            np.testing.assert_array_equal(out, np.stack(everyone).reshape(n, count))
            # reduce_scatter / alltoall: first axis world_size * k
            k = max(1, count // 2)
            rows = [data(x, n * k, dtype, seed=5) for x in range(n)]
            for op in valid_ops(dtype)[:3]:
                rs = await g.reduce_scatter(rows[r], op=op)
                want = reference(rows, op)[r * k : (r + 1) * k]
                assert_close(rs, want, f"reduce_scatter {dtype} {op.name}")
            a2a = await g.alltoall(rows[r])
            want = np.concatenate([rows[x][r * k : (r + 1) * k] for x in range(n)])
            np.testing.assert_array_equal(a2a, want)
            parts = await g.allgatherv(data(r, count + r, dtype))
            for x in range(n):
                np.testing.assert_array_equal(parts[x], data(x, count + x, dtype))
        await g.barrier()


async def send_past_staging(g: ac.Group, limit: int, size: int) -> int:
    """Rank 1 sends ``size`` int64s to rank 0 before rank 0 posts the receive; rank 0
    waits until its link reports staging full (``_staging_full``, spied on), checks that
    the staged bytes stayed within ``limit`` plus a chunk, then receives and checks the
    data. Returns the most bytes rank 0 saw staged (0 on rank 1). The caller lowers
    ``transport.mailbox.STAGING_LIMIT`` to ``limit``."""
    if g.rank == 1:
        data = np.arange(size, dtype=np.int64)
        await g.send(data, 0, tag=5)
        return 0
    link = g._fabric.links[1]
    full = asyncio.Event()
    seen = 0

    def on_full() -> None:
        nonlocal seen
        seen = max(seen, link.early_bytes)
        full.set()
        type(link)._staging_full(link)

    link._staging_full = on_full  # type: ignore[method-assign]
    await full.wait()  # the sender ran ahead until staging hit the bound
    assert link.early_bytes <= limit + g.chunk_bytes
    buf = np.empty(size, np.int64)
    await g.recv(buf, 1, tag=5)
    np.testing.assert_array_equal(buf, np.arange(size, dtype=np.int64))
    return seen
