"""Statistics of one measured case and their human-readable forms (pure functions).

A *record* is what rank 0 of a backend reports for one case and one round (see
:func:`aiocollect.bench.sweep.measure`): per-iteration times already reduced to the maximum
over ranks, the event-loop lag samples, each rank's peak-RSS growth and the correctness
verdict. :func:`summarize` turns it into p50/p99 latency and bus bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from aiocollect.bench.spec import busbw_factor, format_size

MIB = float(1 << 20)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation); NaN for no values."""
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def median(values: Sequence[float]) -> float:
    """The median of the finite values; NaN when there are none."""
    finite = [v for v in values if v == v]
    return float(np.median(finite)) if finite else float("nan")


def summarize(record: dict[str, Any], world_size: int) -> dict[str, Any]:
    """p50/p99 latency (µs); the mean time (µs, the slowest rank's batch / iterations) and
    the bus bandwidth at that time (GB/s, 1e9 bytes) as NCCL-tests computes them; the
    CPU time per iteration of the busiest rank and of all ranks together (µs), where the
    record has it; for concurrent cases the sequential p50 and the ratio
    concurrent/sequential."""
    times = record["times_us"]
    p50 = percentile(times, 50)
    k = record.get("concurrency", 1)
    nbytes = record["bytes"] * k
    factor = busbw_factor(record["collective"], world_size)
    mean = float(record.get("mean_us") or p50)
    algbw = nbytes / (mean * 1e-6) / 1e9 if mean > 0 else float("nan")
    out: dict[str, Any] = {
        "p50_us": p50,
        "p99_us": percentile(times, 99),
        "mean_us": mean,
        "busbw_gbps": factor * algbw,
        "algbw_gbps": algbw,
        "iters": len(times),
        "rss_growth_mib": max(record.get("rss_growth_mib") or [float("nan")]),
        "lag_p99_ms": float("nan"),
        "correct": bool(record["correct"]),
    }
    lag = record.get("lag_us")
    if lag and lag.get("samples"):
        out["lag_p99_ms"] = lag["p99"] / 1000.0
    if record.get("rank_p50_us") is not None:  # (absent from old records)
        out["rank_p50_us"] = float(record["rank_p50_us"])
    if record.get("sync_p50_us") is not None:
        out["sync_p50_us"] = float(record["sync_p50_us"])
    cpu = record.get("cpu_us")
    if cpu:  # (per rank; absent from older records)
        out["cpu_max_us"] = float(max(cpu))
        out["cpu_sum_us"] = float(sum(cpu))
    seq = record.get("seq_times_us")
    if seq:
        seq50 = percentile(seq, 50)
        out["seq_p50_us"] = seq50
        out["concurrent_ratio"] = p50 / seq50 if seq50 > 0 else float("nan")
    return out


def format_time(us: float) -> str:
    """Microseconds as ``812.3us``, ``12.4ms`` or ``1.20s``."""
    if us != us:
        return "-"
    if us < 1000:
        return f"{us:.1f}us"
    if us < 1_000_000:
        return f"{us / 1000:.2f}ms"
    return f"{us / 1e6:.2f}s"


def format_number(value: float, digits: int = 2, suffix: str = "") -> str:
    """``value`` with ``digits`` decimals, or ``-`` when it is NaN."""
    return "-" if value != value else f"{value:.{digits}f}{suffix}"


def progress_line(backend: str, round_label: str, record: dict[str, Any], world_size: int) -> str:
    """``[aiocollect r1/3 allreduce 1M] 37 iters p50 … p99 … busbw … ok`` (one per case)."""
    s = summarize(record, world_size)
    parts = [
        f"[{backend} {round_label} {record['name']} {format_size(record['size'])}]",
        f"{s['iters']} iters",
        f"p50 {format_time(s['p50_us'])}",
        f"p99 {format_time(s['p99_us'])}",
        f"mean {format_time(s['mean_us'])}",
        f"busbw {format_number(s['busbw_gbps'], 3)} GB/s",
    ]
    if "concurrent_ratio" in s:
        parts.append(
            f"seq p50 {format_time(s['seq_p50_us'])} "
            f"conc/seq {format_number(s['concurrent_ratio'], 2)}"
        )
    if s["lag_p99_ms"] == s["lag_p99_ms"]:
        parts.append(f"lag p99 {s['lag_p99_ms']:.2f}ms")
    parts.append(f"rss+ {format_number(s['rss_growth_mib'], 1)}MiB")
    parts.append("ok" if s["correct"] else "WRONG RESULT")
    return " ".join(parts)
