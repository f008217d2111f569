"""Object collectives and the two-phase v-collectives against plain values and hostile peers.

(a) a value comes back exactly (types included) on every rank, or the caller gets
    UsageError before anything is sent;
(b) a peer that passed the handshake and sends crafted object payloads or size frames makes
    the receiving rank's operation fail promptly with ProtocolError naming it, and breaks
    the group on every rank (GroupBrokenError elsewhere), instead of a TypeError on one rank
    and a deadline on the next collective;
(c) any other exception that escapes an operation (a bug) is wrapped as InternalError and
    breaks the group on every rank as well, on the Task and on the Schedule path.

The hostile rank is a hand-driven ``FakePeer`` (tests/support/fakepeer.py) on a real link,
or, with three ranks, a real rank whose serialised value is replaced at call time.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple
from unittest import mock

import ml_dtypes
import msgpack
import numpy as np
import pytest

import aiocollect as ac
from aiocollect import errors, objects
from aiocollect.collectives import bruck, doubling, registry
from aiocollect.collectives.ring import AG_SLOT
from aiocollect.fingerprint import pack
from aiocollect.store import MemoryStore
from aiocollect.testing import run_ranks
from aiocollect.transport.wire import DATA
from aiocollect.types import Collective
from tests.support.fakepeer import (
    CHUNK,
    GROUP_TIMEOUT,
    PROMPT,
    FakePeer,
    echo_header,
    expect_failure,
    group_is_broken_by,
    header,
    linked,
)

pytestmark = pytest.mark.timeout(60)


def same(a: Any, b: Any) -> bool:
    """Equal values of exactly the same types, all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and bool(a == b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(
            same(k, j) and same(a[k], b[j]) for k, j in zip(a, b, strict=True)
        )
    return bool(a == b)


# == (a) exact round trip, or UsageError on the caller ======================================

EXACT: dict[str, Any] = {
    "tuple key": {(1, 2): "x"},
    "nested tuples": (1, (2, [3, (4,)]), ()),
    "tuple keys in tuples": ({(1, (2, 3)): [(), {"a": (None,)}]},),
    "keys of every kind": {b"k": 1, 2: "two", None: 3, 1.5: 4, True: 5, (): 6},
    "plain scalars": [
        None,
        True,
        False,
        0,
        -(2**63),
        2**64 - 1,
        1.5,
        float("inf"),
        "",
        "é",
        b"",
        b"\x00bytes",
    ],
    "numpy scalars": [
        np.float32(1.5),
        np.int8(-3),
        np.bool_(True),
        np.complex64(1j),
        np.uint64(2**64 - 1),
        np.float16(0.5),
    ],
    "arrays": {
        "0-d": np.array(2.5),
        "empty": np.zeros((0, 3), np.int16),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "strided": np.arange(10)[::3],
        "big-endian": np.arange(3, dtype=">i4"),
        "bool": np.array([True, False]),
        "complex": np.ones(2, np.complex128),
    },
}


async def _round_trips(g: ac.Group) -> int:
    checked = 0
    for value in EXACT.values():
        got = await g.broadcast_object(value if g.rank == 1 else None, root=1)
        assert same(got, value), (got, value)
        everyone = await g.allgather_object(value)
        assert len(everyone) == g.world_size
        assert all(same(v, value) for v in everyone)
        gathered = await g.gather_object(value, root=2)
        assert gathered is None if g.rank != 2 else all(same(v, value) for v in gathered)  # type: ignore[union-attr]
        checked += 1
    return checked


async def test_values_round_trip_exactly_on_every_rank(loop_errors: list[Any]) -> None:
    assert (
        await run_ranks(3, _round_trips, transport="tcp", timeout=GROUP_TIMEOUT) == [len(EXACT)] * 3
    )


class Point(NamedTuple):
    x: int
    y: int


class Color(enum.IntEnum):
    RED = 1


deep: list[Any] = []
for _ in range(objects.MAX_DEPTH + 1):
    deep = [deep]

NOT_EXACT: dict[str, Any] = {  # what msgpack would change, or cannot carry
    "named tuple": Point(1, 2),
    "OrderedDict": collections.OrderedDict(a=1),
    "IntEnum": Color.RED,
    "bytearray": bytearray(b"x"),
    "set": {1},
    "int beyond 64 bits": 2**64,
    "string array": np.array(["a"]),
    "bfloat16 array": np.ones(2, ml_dtypes.bfloat16),
    "datetime64": np.datetime64(1, "s"),
    "masked array": np.ma.array([1, 2]),
    "msgpack ExtType": msgpack.ExtType(1, b"\x00"),
    "deep inside": {"ok": [1, (2, bytearray(b"y"))]},
    "nested too deep": deep,
}


async def _refused_then_pickled(g: ac.Group, value: Any) -> bool:
    if g.rank == 0:
        before = g.statistics()["links"]
        with pytest.raises(ac.UsageError, match="allow_pickle"):
            g.broadcast_object(value)
        with pytest.raises(ac.UsageError, match="allow_pickle"):
            g.allgather_object(value)
        with pytest.raises(ac.UsageError, match="allow_pickle"):
            g.gather_object(value, root=1)
        assert g.statistics()["links"] == before  # nothing was sent
    # No sequence number was taken: the group is in step and usable, and pickle (allowed
    # on every rank) carries the value exactly.
    got = await g.broadcast_object(value if g.rank == 0 else None, allow_pickle=True)
    return (
        same(got, value)
        if not isinstance(value, np.ma.MaskedArray)
        else type(got) is np.ma.MaskedArray and got.tolist() == value.tolist()
    )


@pytest.mark.parametrize("kind", sorted(NOT_EXACT))
async def test_value_that_cannot_round_trip_is_usage_error_on_the_caller(
    kind: str, loop_errors: list[Any]
) -> None:
    assert await run_ranks(
        2, _refused_then_pickled, NOT_EXACT[kind], transport="tcp", timeout=GROUP_TIMEOUT
    ) == [True, True]


async def _too_big(g: ac.Group) -> list[str]:
    with pytest.raises(ac.UsageError, match="MAX_OBJECT_BYTES"):
        g.broadcast_object(b"x" * 2000, root=g.rank)
    with pytest.raises(ac.UsageError, match="MAX_OBJECT_BYTES"):
        g.allgather_object(b"x" * 2000)
    return list(await g.allgather_object(f"rank {g.rank}"))


async def test_value_over_max_object_bytes_is_usage_error(
    monkeypatch: pytest.MonkeyPatch, loop_errors: list[Any]
) -> None:
    monkeypatch.setattr(objects, "MAX_OBJECT_BYTES", 1000)
    assert (
        await run_ranks(2, _too_big, transport="tcp", timeout=GROUP_TIMEOUT)
        == [["rank 0", "rank 1"]] * 2
    )


# == (b) hostile payloads from a rank that passed the handshake =============================


def _pack(value: Any) -> bytes:
    return bytes(msgpack.packb(value, use_bin_type=True))


def _ext(code: int, data: bytes) -> bytes:
    return _pack(msgpack.ExtType(code, data))


def _tuples(depth: int) -> bytes:
    data = _pack(None)
    for _ in range(depth):
        data = _ext(2, b"\x91" + data)
    return data


HOSTILE: dict[str, bytes] = {
    "ndarray ext whose header is an int": _ext(1, _pack(7)),
    "ndarray ext with empty data": _ext(1, b""),
    "map with an array key": b"\x81" + _ext(1, _pack(["<i8", [1]]) + bytes(8)) + _pack(1),
    "map with a list key": b"\x81\x91\x01\x01",
    "ndarray of objects": _ext(1, _pack(["|O8", [1]]) + bytes(8)),
    "ndarray of a structured dtype": _ext(1, _pack(["|V8", [1]]) + bytes(8)),
    "ndarray data shorter than its shape": _ext(1, _pack(["<i8", [4]]) + bytes(8)),
    "ndarray with a negative dimension": _ext(1, _pack(["<i8", [-1]])),
    "ndarray with a huge empty shape": _ext(1, _pack(["<f8", [0, 2**62, 2**62]])),
    "tuple ext holding a map": _ext(2, _pack({})),
    "tuples nested too deep": _tuples(5000),
    "unknown extension": _ext(42, b""),
    "truncated": _pack([1, 2, 3])[:-1],
    "trailing bytes": _pack(1) + _pack(2),
    "invalid utf-8": b"\xa2\xff\xfe",
    "pickle while not allowed": objects._PICKLE_MARK + b"\x80\x05K\x01.",
}
ISSUE_CASES = [
    "ndarray ext whose header is an int",
    "ndarray ext with empty data",
    "map with an array key",
    "pickle while not allowed",
]


def _frames(fp: tuple[int, int, int, int, int], slot: int, data: bytes) -> bytes:
    """The DATA frames of op #0 carrying ``data`` in ``slot``, chunked as the rank expects."""
    coll, dtype, elems, op, root = fp
    return b"".join(
        header(
            DATA,
            coll=coll,
            op=op,
            dtype=dtype,
            root=root,
            elems=elems,
            seq=0,
            slot=slot,
            chunk=c,
            length=len(data[i : i + CHUNK]),
        )
        + data[i : i + CHUNK]
        for c, i in enumerate(range(0, len(data), CHUNK))
    )


def _i64(*values: int) -> bytes:
    return np.array(values, np.int64).tobytes()


async def _broken_everywhere(
    g: ac.Group, fake: FakePeer, handle: asyncio.Future[Any], started: float, *phrases: str
) -> None:
    """The real rank's operation failed promptly with a ProtocolError naming the fake rank
    and ``phrases``; the fake got an ABORT and EOF; later calls raise GroupBrokenError."""
    exc = await expect_failure(handle, errors.ProtocolError, started)
    for phrase in ("rank 1", *phrases):
        assert phrase in str(exc), str(exc)
    async with asyncio.timeout(PROMPT):
        aborts = await fake.aborts()
    assert [a["rank"] for a in aborts] == [0], aborts
    await group_is_broken_by(g, exc)


@pytest.mark.both_loops
@pytest.mark.parametrize("kind", sorted(HOSTILE))
async def test_hostile_broadcast_object_payload(
    kind: str,
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    loop_errors: list[Any],
) -> None:
    g, fake = await linked(memory_store, unique_name, fake_peer)
    handle = g.broadcast_object(root=1)
    fp = pack(Collective.OBJECT, None, count=0, root=1)
    payload = HOSTILE[kind]
    started = time.monotonic()
    fake.write(_frames(fp, 0, _i64(len(payload))) + _frames(fp, 1, payload))
    await _broken_everywhere(
        g,
        fake,
        handle,
        started,
        "broadcast_object (op #0)",
        "pickled" if "pickle" in kind else "malformed",
    )


@pytest.mark.parametrize(
    "declared", [-1, 4 << 40, -(2**63), 2**63 - 1], ids=["-1", "4TiB", "min", "max"]
)
async def test_hostile_broadcast_object_size(
    declared: int,
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    loop_errors: list[Any],
) -> None:
    g, fake = await linked(memory_store, unique_name, fake_peer)
    handle = g.broadcast_object(root=1)
    started = time.monotonic()
    fake.write(_frames(pack(Collective.OBJECT, None, count=0, root=1), 0, _i64(declared)))
    await _broken_everywhere(g, fake, handle, started, f"declared a value of {declared}")


def _allgather_reply(h: Any, rows: int, row: int, data: bytes) -> Iterator[bytes]:
    """The fake rank's side of a 2-rank allgatherv, given the real rank's first frame ``h``:
    its size frame, then its rows."""
    yield echo_header(h) + _i64(rows, row)
    for c, i in enumerate(range(0, len(data), CHUNK)):
        part = data[i : i + CHUNK]
        yield echo_header(h, slot=AG_SLOT, chunk=c, length=len(part)) + part


@pytest.mark.parametrize("kind", ISSUE_CASES)
@pytest.mark.parametrize("collective", ["allgather_object", "gather_object"])
async def test_hostile_allgather_object_payload(
    kind: str,
    collective: str,
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    loop_errors: list[Any],
) -> None:
    g, fake = await linked(memory_store, unique_name, fake_peer)
    handle = (
        g.allgather_object("mine")
        if collective == "allgather_object"
        else g.gather_object("mine", root=0)
    )
    h, _ = await fake.read_frame()  # rank 0's size frame
    payload = HOSTILE[kind]
    started = time.monotonic()
    fake.write(b"".join(_allgather_reply(h, len(payload), 1, payload)))
    await _broken_everywhere(g, fake, handle, started, f"{collective} (op #0): rank 1 sent")


@pytest.mark.parametrize("rows", [-1, 4 << 40, -(2**63)], ids=["-1", "4TiB", "min"])
async def test_hostile_allgather_object_size(
    rows: int,
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    loop_errors: list[Any],
) -> None:
    g, fake = await linked(memory_store, unique_name, fake_peer)
    handle = g.allgather_object("mine")
    h, _ = await fake.read_frame()
    started = time.monotonic()
    fake.write(next(_allgather_reply(h, rows, 1, b"")))
    await _broken_everywhere(g, fake, handle, started, f"rank 1 declared {rows} rows")


@pytest.mark.parametrize(
    ("rows", "row"),
    [(-100, 2), (4 << 40, 2), (3, -2), (2**62, 0)],
    ids=["-100 rows", "4TiB", "negative row", "huge empty rows"],
)
async def test_hostile_allgatherv_sizes(
    rows: int,
    row: int,
    memory_store: MemoryStore,
    unique_name: str,
    fake_peer: Callable[..., FakePeer],
    loop_errors: list[Any],
) -> None:
    g, fake = await linked(memory_store, unique_name, fake_peer)
    handle = g.allgatherv(np.ones((3, 2), np.float32))
    h, _ = await fake.read_frame()
    started = time.monotonic()
    fake.write(next(_allgather_reply(h, rows, row, b"")))
    await _broken_everywhere(g, fake, handle, started, f"rank 1 declared {rows} rows")


async def _gather_with_hostile_rank(g: ac.Group, crafted: bytes) -> list[Any]:
    """Rank 2 sends ``crafted`` as its serialised value (its own call is replaced at call
    time; the frames are real); returns what this rank's gather_object and the barrier after
    it raised (or "ok"), and how long both took."""
    if g.rank == 2:
        with mock.patch.object(objects, "dumps", return_value=crafted):
            handle = g.gather_object(None, root=0)
    else:
        handle = g.gather_object(g.rank, root=0)
    started = time.monotonic()
    outcome: list[Any] = []
    for call in (lambda: handle, g.barrier):
        try:
            await call()
            outcome.append("ok")
        except ac.AiocollectError as exc:
            outcome.append(exc)
    outcome.append(time.monotonic() - started)
    return outcome


@pytest.mark.parametrize("kind", ISSUE_CASES)
async def test_hostile_value_breaks_the_group_on_every_rank(
    kind: str, loop_errors: list[Any]
) -> None:
    """Three real ranks; rank 2's value is malformed. The root, which decodes it, raises
    ProtocolError naming rank 2; the other ranks' next call fails with GroupBrokenError at
    once (not at its deadline)."""
    res = await run_ranks(
        3, _gather_with_hostile_rank, HOSTILE[kind], transport="tcp", timeout=GROUP_TIMEOUT
    )
    first, later, took = res[0]
    assert isinstance(first, errors.ProtocolError), first
    assert "gather_object (op #0): rank 2 sent" in str(first), str(first)
    assert isinstance(later, ac.GroupBrokenError)
    assert later.__cause__ is first
    for rank in (1, 2):
        first, later, took = res[rank]
        assert first == "ok" or isinstance(first, ac.GroupBrokenError), first
        assert isinstance(later, ac.GroupBrokenError), later
        assert "rank 0 aborted the group" in str(later.__cause__ or later), later
        assert took < PROMPT, f"rank {rank} took {took:.2f} s: a deadline, not the ABORT"


# == (c) anything else escaping an operation is wrapped and breaks the group ================


async def _two_calls(g: ac.Group, first: Callable[[ac.Group], Any]) -> list[Any]:
    started = time.monotonic()
    outcome: list[Any] = []
    for call in (lambda: first(g), g.barrier):
        try:
            await call()
            outcome.append("ok")
        except ac.AiocollectError as exc:
            outcome.append(exc)
    outcome.append(time.monotonic() - started)
    return outcome


def _check_wrapped(
    res: list[list[Any]], failing: list[int], cause: type[BaseException], kind: str
) -> None:
    for rank, (first, later, took) in enumerate(res):
        if rank in failing:
            assert isinstance(first, errors.InternalError), first
            assert isinstance(first.__cause__, cause), repr(first.__cause__)
            assert f"{kind} (op #0) on rank {rank}" in str(first), str(first)
        else:
            assert first == "ok" or isinstance(first, ac.GroupBrokenError), first
        assert isinstance(later, ac.GroupBrokenError), later
        assert took < PROMPT, f"rank {rank} took {took:.2f} s"


async def test_unexpected_exception_in_a_task_op_is_wrapped_and_breaks_the_group(
    monkeypatch: pytest.MonkeyPatch, loop_errors: list[Any]
) -> None:
    """A bug (here: decoding raises RuntimeError) in a Task-run operation: InternalError
    with the original as __cause__ on the rank it hit (the root, the only one that
    decodes), the group broken on all three."""

    def buggy(data: bytes, allow_pickle: bool, origin: str = "") -> Any:
        raise RuntimeError("injected bug")

    monkeypatch.setattr(objects, "loads", buggy)
    res = await run_ranks(
        3,
        _two_calls,
        lambda g: g.gather_object(g.rank, root=0),
        transport="tcp",
        timeout=GROUP_TIMEOUT,
    )
    _check_wrapped(res, [0], RuntimeError, "gather_object")


async def test_unexpected_exception_in_a_schedule_is_wrapped_and_breaks_the_group(
    monkeypatch: pytest.MonkeyPatch, loop_errors: list[Any]
) -> None:
    """The same on the callback-driven small-message path: a step's callback raises on
    rank 1 (from the transport's read path)."""
    entry = registry.ALLREDUCE.algorithms["recursive_doubling"]
    original = entry.program
    assert original is doubling.small_program

    def boom(q: Any) -> None:
        raise ZeroDivisionError("injected bug")

    def buggy(n: int, rank: int, *args: Any) -> Any:
        program = original(n, rank, *args)
        if rank == 1:
            last = dataclasses.replace(program.steps[-1], then=boom)
            program = dataclasses.replace(program, steps=(*program.steps[:-1], last))
        return program

    monkeypatch.setitem(
        registry.ALLREDUCE.algorithms,
        "recursive_doubling",
        dataclasses.replace(entry, program=buggy),
    )
    res = await run_ranks(
        2,
        _two_calls,
        lambda g: g.allreduce(np.ones(4, np.float32), algorithm="recursive_doubling"),
        transport="tcp",
        timeout=GROUP_TIMEOUT,
    )
    _check_wrapped(res, [1], ZeroDivisionError, "allreduce")


async def _split_with_hostile_rank(g: ac.Group) -> list[Any]:
    return await _two_calls(g, lambda _g: g.split(0))


async def test_hostile_split_entry_breaks_the_group(loop_errors: list[Any]) -> None:
    """split's (color, key) pairs travel as int64 rows (bruck.allgather_rows): a rank
    sending a color no real rank sends (below -1, which is None) is a ProtocolError where
    it is read, and the group breaks everywhere."""
    real = bruck.allgather_rows

    async def lying(o: Any, mine: Any) -> Any:
        if o.rank == 2:
            mine = np.array([-7, 0], np.int64)
        return await real(o, mine)

    with mock.patch.object(bruck, "allgather_rows", lying):
        res = await run_ranks(3, _split_with_hostile_rank, transport="tcp", timeout=GROUP_TIMEOUT)
    firsts = [first for first, _, _ in res]
    assert any(isinstance(f, errors.ProtocolError) for f in firsts), firsts
    for first, later, took in res:
        assert isinstance(first, errors.ProtocolError | ac.GroupBrokenError), first
        if isinstance(first, errors.ProtocolError):
            assert "split (op #0): rank 2 sent a malformed color and key" in str(first)
        assert isinstance(later, ac.GroupBrokenError), later
        assert took < PROMPT, f"took {took:.2f} s"
