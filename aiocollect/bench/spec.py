"""What a benchmark measures: sizes, cases, buffer shapes, bus bandwidth, correctness.

Pure functions (no event loop, no sockets), shared by every backend so that aiocollect and
the gloo baseline move the same bytes and are checked against the same closed forms.

Size conventions follow NCCL-tests: the *size* of allreduce, broadcast and reduce is the
buffer each rank passes; the size of allgather, reduce_scatter and alltoall is the total
(allgather's output, reduce_scatter's and alltoall's input), each rank contributing
``size / world_size``. Bus bandwidth is ``size / time`` times a factor that makes it
comparable with the link speed: ``2(n-1)/n`` for allreduce, ``(n-1)/n`` for allgather,
reduce_scatter and alltoall, 1 for broadcast and reduce.

Two more cases ride the same path without being collectives of data: ``sendrecv`` (as
NCCL-tests' sendrecv: every rank sends ``size`` bytes to rank r+1 and receives ``size``
bytes from rank r-1, both in flight at once; bus bandwidth ``size / time``) and
``barrier`` (no data: one case of size 0 whatever sizes are asked for, no bandwidth, and
no result that could show it worked, so its check says ``-``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

Array = np.ndarray[Any, np.dtype[Any]]

#: Collectives the benchmark knows, in the order the table lists them.
COLLECTIVES = (
    "allreduce",
    "broadcast",
    "reduce",
    "allgather",
    "reduce_scatter",
    "alltoall",
    "sendrecv",
    "barrier",
)
#: Cases without data: measured once, at size 0, whatever sizes are asked for.
NO_DATA = frozenset({"barrier"})
#: Collectives whose result replaces the input buffer (no separate output).
IN_PLACE = frozenset({"allreduce", "broadcast", "reduce"})
#: Dtypes the benchmark accepts (all exist in numpy and torch).
DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64")
#: Roots of broadcast and reduce.
ROOT = 0
#: The default sweep: powers of 4 from 4 bytes to 64 MiB.
DEFAULT_SIZES = "4..64M"

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)
_CONCURRENT = re.compile(r"^(.+)[-_]concurrent(\d+)$")


def parse_size(text: str) -> int:
    """``"4"``, ``"4K"``, ``"1M"``, ``"2GiB"`` → bytes (binary units).

    Raises:
        ValueError: not a size, or not positive.
    """
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (examples: 4, 4K, 1M, 1G)")
    value = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if value < 1:
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return value


def parse_sizes(text: str) -> list[int]:
    """Comma-separated sizes and ranges, sorted and deduplicated.

    ``A..B`` steps by a factor of 4 from A, ``A..B:F`` by a factor of F (``4K..64M:2``
    doubles); B is always included.

    Raises:
        ValueError: malformed sizes or ranges.
    """
    sizes: set[int] = set()
    for item in text.split(","):
        if not item.strip():
            continue
        if ".." not in item:
            sizes.add(parse_size(item))
            continue
        lo_text, _, rest = item.partition("..")
        hi_text, _, factor_text = rest.partition(":")
        lo, hi = parse_size(lo_text), parse_size(hi_text)
        factor = int(factor_text) if factor_text.strip() else 4
        if lo > hi:
            raise ValueError(f"empty size range {item!r}: {lo_text} > {hi_text}")
        if factor < 2:
            raise ValueError(f"range factor must be at least 2, got {factor_text!r}")
        size = lo
        while size < hi:
            sizes.add(size)
            size *= factor
        sizes.add(hi)
    if not sizes:
        raise ValueError("no sizes given")
    return sorted(sizes)


def format_size(nbytes: int) -> str:
    """Bytes in the shortest exact binary unit: ``4``, ``1K``, ``64M``, ``1536``."""
    for unit in ("G", "M", "K"):
        scale = _UNITS[unit]
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


@dataclass(frozen=True)
class Case:
    """One line of the table: a collective at one size, ``concurrency`` handles at once
    (1: back to back; K > 1: K in flight together, timed against K in sequence)."""

    collective: str
    size: int
    concurrency: int = 1

    @property
    def name(self) -> str:
        """``allreduce`` or ``allreduce-concurrent4``."""
        if self.concurrency == 1:
            return self.collective
        return f"{self.collective}-concurrent{self.concurrency}"

    @property
    def key(self) -> str:
        return f"{self.name}/{self.size}"


def parse_collective(name: str) -> tuple[str, int]:
    """``"allreduce"`` → ``("allreduce", 1)``; ``"allreduce-concurrent4"`` → ``(…, 4)``.

    Raises:
        ValueError: an unknown collective or a concurrency below 2.
    """
    text = name.strip().lower()
    concurrency = 1
    m = _CONCURRENT.match(text)
    if m is not None:
        text, concurrency = m.group(1), int(m.group(2))
        if concurrency < 2:
            raise ValueError(f"{name}: concurrency must be at least 2")
    text = text.replace("-", "_")
    if text not in COLLECTIVES:
        raise ValueError(
            f"unknown collective {name!r}; choose from {', '.join(COLLECTIVES)}"
            " (optionally with -concurrentK, e.g. allreduce-concurrent4)"
        )
    return text, concurrency


@dataclass(frozen=True)
class Shape:
    """Buffers of one rank: ``send`` (the in-place buffer for allreduce, broadcast and
    reduce) and ``out`` (None for in-place collectives); ``total_bytes`` is the size in
    NCCL-tests terms, rounded to whole elements divisible among the ranks."""

    count: int
    send: tuple[int, ...]
    out: tuple[int, ...] | None
    total_bytes: int


def shape(collective: str, size: int, itemsize: int, world_size: int) -> Shape:
    """The buffers for ``size`` bytes of ``collective`` (at least one element per rank;
    none for a barrier)."""
    n = world_size
    if collective in NO_DATA:
        return Shape(0, (0,), None, 0)
    if collective == "sendrecv":
        count = max(1, size // itemsize)
        return Shape(count, (count,), (count,), count * itemsize)
    if collective in IN_PLACE:
        count = max(1, size // itemsize)
        return Shape(count, (count,), None, count * itemsize)
    count = max(1, size // itemsize // n)
    total = count * n * itemsize
    if collective == "allgather":
        return Shape(count, (count,), (n, count), total)
    if collective == "reduce_scatter":
        return Shape(count, (n * count,), (count,), total)
    if collective == "alltoall":
        return Shape(count, (n * count,), (n * count,), total)
    raise ValueError(f"unknown collective {collective!r}")


def busbw_factor(collective: str, world_size: int) -> float:
    """NCCL-tests' bus-bandwidth factor (bytes on the busiest link per byte of size)."""
    n = world_size
    if collective == "allreduce":
        return 2 * (n - 1) / n
    if collective in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    if collective in NO_DATA:
        return 0.0
    return (n - 1) / n


def checked(collective: str) -> bool:
    """Whether a result can show that ``collective`` worked (not a barrier's: it moves
    no data)."""
    return collective not in NO_DATA


# -- correctness: rank-dependent data and the closed form of every result -----------------


def _ramp(count: int, period: int, start: int = 0) -> Array:
    """``(start + i) % period`` for i < count, as uint32 (small, exact in every dtype)."""
    return np.arange(start, start + count, dtype=np.uint32) % np.uint32(period)


def _put(dst: Array, base: int, ramp: Array, scale: int = 1) -> None:
    """``dst = base + scale * ramp``, computed in int64 and cast like the reduction would
    wrap (integers) or represent exactly (small values in floats)."""
    dst.reshape(-1)[...] = (ramp.astype(np.int64) * scale + base).astype(dst.dtype)


def _equal(actual: Array, base: int, ramp: Array, scale: int = 1) -> bool:
    expected = (ramp.astype(np.int64) * scale + base).astype(actual.dtype)
    return bool(np.array_equal(actual.reshape(-1), expected))


def fill(
    collective: str, send: Array, out: Array | None, rank: int, world_size: int, offset: int = 0
) -> None:
    """Write the rank-dependent input of ``collective`` (``offset`` tells concurrent
    instances apart) and clear the output."""
    n, c = world_size, send.size
    if out is not None:
        out.fill(0)
    if collective in ("allreduce", "reduce", "reduce_scatter"):
        _put(send, rank + 1 + offset, _ramp(c, 7))
    elif collective == "broadcast":
        if rank == ROOT:
            _put(send, 1 + offset, _ramp(c, 13))
        else:
            send.fill(0)
    elif collective == "allgather":
        _put(send, rank + 1 + offset, _ramp(c, 5))
    elif collective == "alltoall":
        per = c // n
        for j, block in enumerate(send.reshape(n, per)):
            _put(block, rank * n + j + 1 + offset, _ramp(per, 3))
    elif collective == "sendrecv":
        _put(send, rank + 1 + offset, _ramp(c, 11))
    elif collective not in NO_DATA:
        raise ValueError(f"unknown collective {collective!r}")


def verify(
    collective: str, send: Array, out: Array | None, rank: int, world_size: int, offset: int = 0
) -> bool:
    """Whether this rank's buffers hold the closed-form result of :func:`fill`'s input."""
    n = world_size
    total = n * (n + 1) // 2 + n * offset
    if collective == "allreduce" or (collective == "reduce" and rank == ROOT):
        return _equal(send, total, _ramp(send.size, 7), n)
    if collective == "reduce":
        return True  # non-root buffers are unspecified for gloo; aiocollect keeps them
    if collective == "broadcast":
        return _equal(send, 1 + offset, _ramp(send.size, 13))
    if collective in NO_DATA:
        return True  # nothing to check (checked() says so)
    assert out is not None
    if collective == "sendrecv":
        return _equal(out, (rank - 1) % n + 1 + offset, _ramp(out.size, 11))
    if collective == "allgather":
        return all(
            _equal(row, j + 1 + offset, _ramp(row.size, 5))
            for j, row in enumerate(out.reshape(n, -1))
        )
    if collective == "reduce_scatter":
        return _equal(out, total, _ramp(out.size, 7, rank * out.size), n)
    if collective == "alltoall":
        per = out.size // n
        return all(
            _equal(block, j * n + rank + 1 + offset, _ramp(per, 3))
            for j, block in enumerate(out.reshape(n, per))
        )
    raise ValueError(f"unknown collective {collective!r}")
