"""Bad input raises UsageError from the call itself, before a sequence number is taken:
the group stays usable and the other ranks never see a frame."""

from __future__ import annotations

import array
from typing import Any

import numpy as np
import pytest

import aiocollect as ac
from aiocollect.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


def _bad_calls(g: ac.Group) -> list[tuple[str, Any]]:
    f32 = np.zeros(4, np.float32)
    i32 = np.zeros(4, np.int32)
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    strided = np.zeros((4, 4), np.float32)[:, 0]
    return [
        ("root out of range", lambda: g.broadcast(f32, root=g.world_size)),
        ("negative root", lambda: g.reduce(f32, root=-1)),
        ("root not int", lambda: g.gather(f32, root=1.5)),  # type: ignore[call-overload]
        ("non-contiguous", lambda: g.allreduce(strided)),
        ("read-only", lambda: g.allreduce(ro)),
        ("read-only bytes", lambda: g.broadcast(b"abcd")),
        ("not a buffer", lambda: g.allreduce([1, 2, 3])),  # type: ignore[type-var]
        ("unknown op", lambda: g.allreduce(f32, op="sum")),  # type: ignore[arg-type]
        ("bitwise on float", lambda: g.allreduce(f32, op=ac.BXOR)),
        ("avg on int", lambda: g.allreduce(i32, op=ac.AVG)),
        ("non-binary ufunc", lambda: g.allreduce(f32, op=np.sqrt)),
        ("object dtype", lambda: g.allreduce(np.array([object()] * 4))),
        ("allgather out shape", lambda: g.allgather(f32, np.zeros(3, np.float32))),
        ("allgather out dtype", lambda: g.allgather(f32, np.zeros((g.world_size, 4), np.float64))),
        (
            "reduce_scatter not divisible",
            lambda: g.reduce_scatter(np.zeros(g.world_size * 2 + 1, np.float32)),
        ),
        ("alltoall not divisible", lambda: g.alltoall(np.zeros(g.world_size + 1))),
        ("scatter root without send", lambda: g.scatter(None, f32, root=g.rank)),
        ("send to self", lambda: g.send(f32, g.rank)),
        ("send dst out of range", lambda: g.send(f32, g.world_size)),
        ("negative tag", lambda: g.send(f32, (g.rank + 1) % g.world_size, tag=-1)),
        ("bad timeout", lambda: g.barrier(timeout=0)),
        ("recv from self", lambda: g.recv(f32, g.rank)),
    ]


async def _check(g: ac.Group) -> list[str]:
    seen = []
    for what, call in _bad_calls(g):
        seq = g._seq
        with pytest.raises(ac.UsageError) as info:
            call()
        assert isinstance(info.value, ValueError)
        assert g._seq == seq, what
        seen.append(what)
    # the group still works afterwards
    buf = np.ones(5, np.float32)
    await g.allreduce(buf)
    assert (buf == g.world_size).all()
    return seen


@pytest.mark.parametrize("transport", ["memory", "tcp"])
async def test_bad_arguments_raise_before_sending(transport: str) -> None:
    res = await run_ranks(2, _check, transport=transport)
    assert len(res[0]) == 22
    assert res[0] == res[1]


async def test_buffer_protocol_objects() -> None:
    async def body(g: ac.Group) -> tuple[bytes, list[float]]:
        ba = bytearray([g.rank + 1] * 4)
        await g.broadcast(ba, root=1)
        arr = array.array("d", [float(g.rank)] * 3)
        await g.allreduce(arr)
        return bytes(ba), list(arr)

    res = await run_ranks(2, body)
    assert res[0] == (bytes([2] * 4), [1.0, 1.0, 1.0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 0, "world_size": 0}, "world_size"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": -1, "world_size": 2}, "rank"),
        ({"rank": 0, "world_size": 1, "transport": "carrier-pigeon"}, "transport"),
        ({"rank": 0, "world_size": 1, "transport": "tls"}, "ssl"),
        ({"rank": 0, "world_size": 1, "timeout": -1}, "timeout"),
    ],
)
async def test_open_group_usage(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ac.UsageError, match=match):
        await ac.open_group(store="memory://usage", **kwargs)


async def test_use_after_close() -> None:
    g = await ac.open_group(0, 1, store="memory://closed")
    await g.aclose()
    assert g.closed
    with pytest.raises(ac.UsageError, match="closed"):
        g.barrier()


@pytest.mark.timeout(10)
async def test_bad_transport_is_usage_error() -> None:
    with pytest.raises(ac.UsageError, match="shm"):
        await ac.open_group(0, 1, store="memory://bad", transport="bogus")
