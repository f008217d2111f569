"""The pure parts of ``aiocollect bench``: sizes, cases, shapes, closed-form checks, stats."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiocollect.bench import machine, report, spec
from aiocollect.bench.stats import summarize
from aiocollect.bench.sweep import MAX_ITERS, MIN_ITERS, calibrate


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4", [4]),
        ("4K", [4096]),
        ("1m", [1 << 20]),
        ("2GiB", [2 << 30]),
        ("1KB", [1024]),
        ("4..4K", [4, 16, 64, 256, 1024, 4096]),
        ("4..64M", [4 * 4**i for i in range(13)]),
        ("1K..8K:2", [1024, 2048, 4096, 8192]),
        ("4..100", [4, 16, 64, 100]),
        ("1M,4,4", [4, 1 << 20]),
    ],
)
def test_parse_sizes(text: str, expected: list[int]) -> None:
    assert spec.parse_sizes(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "no sizes given"),
        ("x", "not a size: 'x'"),
        ("0", "at least 1 byte"),
        ("4..2", "empty size range"),
        ("4..4K:1", "range factor must be at least 2"),
        ("-4", "not a size: '-4'"),
        ("1T", "not a size: '1T'"),
    ],
)
def test_parse_sizes_rejects(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        spec.parse_sizes(text)


def test_format_size() -> None:
    assert [spec.format_size(n) for n in (4, 1024, 1536, 64 << 20, 1 << 30)] == [
        "4",
        "1K",
        "1536",
        "64M",
        "1G",
    ]


def test_parse_collective() -> None:
    assert spec.parse_collective("allreduce") == ("allreduce", 1)
    assert spec.parse_collective("reduce-scatter") == ("reduce_scatter", 1)
    assert spec.parse_collective("allreduce-concurrent4") == ("allreduce", 4)
    assert spec.Case("allreduce", 16, 4).name == "allreduce-concurrent4"
    assert spec.parse_collective("sendrecv") == ("sendrecv", 1)
    assert spec.parse_collective("barrier") == ("barrier", 1)
    for bad in ("allreduce-concurrent1", "nosuch", "scatter"):
        with pytest.raises(ValueError, match=r"concurrency must be|unknown collective"):
            spec.parse_collective(bad)


def test_shapes_follow_nccl_tests() -> None:
    assert spec.shape("allreduce", 4, 4, 2) == spec.Shape(1, (1,), None, 4)
    assert spec.shape("allgather", 64, 4, 4) == spec.Shape(4, (4,), (4, 4), 64)
    assert spec.shape("reduce_scatter", 64, 4, 4) == spec.Shape(4, (16,), (4,), 64)
    # Too small to split: one element per rank, bytes rounded up.
    assert spec.shape("alltoall", 4, 4, 2).total_bytes == 8
    assert spec.busbw_factor("allreduce", 4) == 1.5
    assert spec.busbw_factor("allgather", 4) == 0.75
    assert spec.busbw_factor("broadcast", 4) == 1.0
    # sendrecv: every rank sends size bytes on and receives size bytes (NCCL-tests)
    assert spec.shape("sendrecv", 64, 4, 4) == spec.Shape(16, (16,), (16,), 64)
    assert spec.busbw_factor("sendrecv", 4) == 1.0
    # a barrier moves nothing, whatever the size asked
    assert spec.shape("barrier", 64, 4, 4) == spec.Shape(0, (0,), None, 0)
    assert spec.busbw_factor("barrier", 4) == 0.0


def _simulate(collective: str, sends: list[np.ndarray[Any, Any]], outs: list[Any]) -> None:
    """What a correct library would leave in the buffers (numpy reference)."""
    n = len(sends)
    if collective in ("allreduce", "reduce"):
        total = np.sum(sends, axis=0, dtype=sends[0].dtype)
        for r in range(n):
            if collective == "allreduce" or r == spec.ROOT:
                sends[r][...] = total
    elif collective == "broadcast":
        for r in range(n):
            sends[r][...] = sends[spec.ROOT]
    elif collective == "allgather":
        for r in range(n):
            outs[r][...] = np.stack(sends)
    elif collective == "reduce_scatter":
        total = np.sum(sends, axis=0, dtype=sends[0].dtype).reshape(n, -1)
        for r in range(n):
            outs[r][...] = total[r]
    elif collective == "alltoall":
        for r in range(n):
            outs[r][...] = np.concatenate([s.reshape(n, -1)[r] for s in sends])
    elif collective == "sendrecv":
        for r in range(n):
            outs[r][...] = sends[(r - 1) % n]


@pytest.mark.parametrize("collective", [c for c in spec.COLLECTIVES if c not in spec.NO_DATA])
@pytest.mark.parametrize("dtype", ["float32", "int8", "float16"])
@pytest.mark.parametrize("n", [1, 3])
def test_fill_and_verify_agree_with_numpy(collective: str, dtype: str, n: int) -> None:
    shp = spec.shape(collective, 200, np.dtype(dtype).itemsize, n)
    sends = [np.empty(shp.send, dtype) for _ in range(n)]
    outs = [None if shp.out is None else np.empty(shp.out, dtype) for _ in range(n)]
    for r in range(n):
        spec.fill(collective, sends[r], outs[r], r, n, offset=2)
    _simulate(collective, sends, outs)
    assert all(spec.verify(collective, sends[r], outs[r], r, n, offset=2) for r in range(n))
    target = sends[0] if outs[0] is None else outs[0]
    target.reshape(-1)[-1] += 1
    assert not spec.verify(collective, sends[0], outs[0], 0, n, offset=2)


def test_calibrate_bounds() -> None:
    assert calibrate(0.01, 0.3) == 30
    assert calibrate(1.0, 0.3) == MIN_ITERS
    assert calibrate(1e-9, 0.3) == MAX_ITERS
    assert calibrate(0.0, 0.3) == MAX_ITERS


def _record(times: list[float], correct: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "collective": "allreduce",
        "name": "allreduce",
        "concurrency": 1,
        "size": 1 << 20,
        "bytes": 1 << 20,
        "algorithm": "auto",
        "times_us": times,
        "rss_growth_mib": [1.0, 2.0],
        "correct": correct,
        "wrong_ranks": [],
        "lag_us": {"samples": 3, "p50": 10.0, "p99": 500.0, "max": 600.0},
        **extra,
    }


def test_summarize_bus_bandwidth() -> None:
    s = summarize(_record([1000.0] * 5, mean_us=1000.0), world_size=2)
    assert s["p50_us"] == 1000.0
    assert s["busbw_gbps"] == pytest.approx((1 << 20) / 1e-3 / 1e9)  # 2(n-1)/n == 1
    assert s["lag_p99_ms"] == 0.5
    assert s["rss_growth_mib"] == 2.0


def test_aggregate_medians_ratios_and_correctness() -> None:
    case = spec.Case("allreduce", 1 << 20)
    rounds: list[dict[str, Any]] = [
        {
            "round": i,
            "aiocollect": {"records": [_record([t] * 5)]},
            "gloo": {"records": [_record([2 * t] * 5)]},
        }
        for i, t in enumerate((1, 3, 2))
    ]
    (row,) = report.aggregate(rounds, [case], world_size=2)
    assert row["aiocollect"]["p50_us"] == 2
    assert row["gloo"]["p50_us"] == 4
    assert row["bw_ratio"] == pytest.approx(2.0)
    assert row["lat_ratio"] == pytest.approx(0.5)
    assert report.all_correct([row])
    rounds[1]["aiocollect"]["records"][0]["correct"] = False
    (row,) = report.aggregate(rounds, [case], world_size=2)
    assert not report.all_correct([row])
    table = report.format_tables(
        [row], {"world_size": 2, "transport": "tcp", "dtype": "float32", "rounds": 3}
    )
    assert "WRONG" in table
    assert "gloo p50" in table
    assert machine.clean({"a": [float("nan"), 1.0]}) == {"a": [None, 1.0]}


def test_barrier_has_nothing_to_check() -> None:
    """A barrier moves no data: fill and verify accept its empty buffers, and the report
    is told not to call it checked (its check column says '-')."""
    shp = spec.shape("barrier", 4096, 4, 2)
    send = np.empty(shp.send, np.float32)
    spec.fill("barrier", send, None, 0, 2)
    assert spec.verify("barrier", send, None, 0, 2)
    assert not spec.checked("barrier")
    assert all(spec.checked(c) for c in spec.COLLECTIVES if c != "barrier")
