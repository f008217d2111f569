"""Sweep bodies: every collective x algorithm, checked against numpy on every rank."""

from __future__ import annotations

from typing import Any

import numpy as np

import aiocollect as ac
from aiocollect.collectives.registry import REGISTRIES
from tests.support.collectives import assert_close, counts_for, data, reference, valid_ops

CLASS_DTYPES = [np.dtype(d) for d in ("bool", "int32", "uint8", "float32", "float16", "complex64")]


async def sweep_algorithms(g: ac.Group, dtypes: list[Any] | None = None) -> int:
    n, r, checked = g.world_size, g.rank, 0
    for dtype in dtypes or CLASS_DTYPES:
        for count in counts_for(dtype):
            everyone = [data(x, count, dtype) for x in range(n)]
            for alg in REGISTRIES["allreduce"].names:
                for op in valid_ops(dtype):
                    buf = data(r, count, dtype, op=op)
                    await g.allreduce(buf, op=op, algorithm=alg)
                    want = reference([data(x, count, dtype, op=op) for x in range(n)], op)
                    assert_close(buf, want, f"allreduce[{alg}] {dtype} {op.name} n={count}")
                    checked += 1
            for alg in REGISTRIES["broadcast"].names:
                for root in range(n):
                    buf = everyone[r].copy()
                    await g.broadcast(buf, root=root, algorithm=alg)
                    np.testing.assert_array_equal(buf, everyone[root], f"broadcast[{alg}]")
                    checked += 1
            for alg in REGISTRIES["allgather"].names:
                out = await g.allgather(everyone[r], algorithm=alg)
                np.testing.assert_array_equal(out, np.stack(everyone), f"allgather[{alg}]")
            rows = [data(x, n * max(1, count), dtype, seed=9) for x in range(n)]
            k = max(1, count)
            for alg in REGISTRIES["reduce_scatter"].names:
                for op in valid_ops(dtype):
                    rs = await g.reduce_scatter(rows[r], op=op, algorithm=alg)
                    assert_close(
                        rs,
                        reference(rows, op)[r * k : (r + 1) * k],
                        f"reduce_scatter[{alg}] {dtype} {op.name}",
                    )
                    checked += 1
            for root in range(n):
                red = everyone[r].copy()
                await g.reduce(red, root=root, op=ac.MAX if dtype.kind != "c" else ac.SUM)
                if r == root:
                    assert_close(red, reference(everyone, ac.MAX if dtype.kind != "c" else ac.SUM))
            counts = [(r + x + count) % 3 for x in range(n)]
            send = np.concatenate([data(r * 10 + x, counts[x], dtype) for x in range(n)])
            got = await g.alltoallv(send, counts)
            for x in range(n):
                np.testing.assert_array_equal(got[x], data(x * 10 + r, (x + r + count) % 3, dtype))
            for alg in REGISTRIES["allgatherv"].names:  # (ragged: some ranks send no rows)
                gv = await g.allgatherv(data(r, (r + count) % 3, dtype), algorithm=alg)
                for x in range(n):
                    np.testing.assert_array_equal(
                        gv[x], data(x, (x + count) % 3, dtype), f"allgatherv[{alg}]"
                    )
                checked += 1
    return checked
